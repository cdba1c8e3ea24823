"""``jax-seqpar bench --packed``: how evenly each token order spreads the work of packed
documents over the devices, and what that does to a ring layer's time.

For three document mixes (:data:`jax_seqpar.tools.mixes.MIXES`: one long document per
row; uniform short documents; heavy-tailed lengths) and the orders contiguous, zigzag,
striped and per_document, over ``seeds`` draws of each mix:

* ``tokens``: the busiest device's causal-within-document (query, key) pairs over the
  mean (:func:`jax_seqpar.core.work.work_per_shard`);
* ``tiles <kernel>``: the busiest device's computed tiles over the mean, for the
  kernels' default tiles (:func:`jax_seqpar.core.work.computed_tiles_per_shard`: XLA
  and Mosaic compute the non-EMPTY tiles, Triton every tile within its loop bounds),
  and the busiest device's count itself (``busiest``: what a ring waits for);
* ``masked``: for the masked mixes (:data:`jax_seqpar.tools.mixes.MASKED`: prefix-LM,
  vision-language images, chunked causal), the busiest device's visible pairs and
  computed 128-token tiles over the mean, zigzag, striped and the per-document order
  balanced by the mask;
* time: a causal ring layer on this machine's mesh (the XLA kernel on CPU), zigzag vs
  per_document, median milliseconds of forward (and forward + backward) calls.

    jax-seqpar bench --packed --batch 2 --seq 16384 --heads 2 --kv-heads 1 --head-dim 32
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core import layout, packing, work
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.tools import mixes
from jax_seqpar.tools.report import text_table

#: The kernels' default tiles (block_q, block_k) and what each computes of them.
KERNEL_TILES = {"xla 256": (256, 256, "skip"), "triton 128x64": (128, 64, "range"),
                "mosaic 512": (512, 512, "skip"), "128": (128, 128, "skip")}


def positions_of(name: str, ids: np.ndarray, num_shards: int, block: int) -> np.ndarray:
    """``int32[B, S]`` positions of ``ids``' rows in the order ``name``."""
    seq_len = ids.shape[1]
    if name == "per_document":
        return packing.per_document_positions(ids, num_shards, block)
    order = {"contiguous": np.arange(seq_len, dtype=np.int32),
             "zigzag": np.asarray(layout.zigzag_positions(seq_len, num_shards)),
             "striped": np.asarray(layout.striped_positions(seq_len, num_shards))}[name]
    return np.broadcast_to(order, ids.shape)


def measure(ids: np.ndarray, positions: np.ndarray, num_shards: int,
            aligned: Optional[dict] = None) -> dict:
    """Token work and computed tiles of one batch laid out by ``positions``; ``aligned``:
    ``{block_q: positions}``, the order each kernel's tiles are counted in when it
    depends on the tile (per_document, aligned to the kernel's ``block_q``)."""
    laid = np.take_along_axis(ids, positions, 1)
    causal = MaskSpec(causal=True)
    tokens = work.work_per_shard(causal, Tokens(positions, laid), num_shards)
    row = {"tokens": float(tokens.max() / tokens.mean()), "token_work": tokens.tolist()}
    for name, (block_q, block_k, count) in KERNEL_TILES.items():
        order = (aligned or {}).get(block_q, positions)
        tiles = work.computed_tiles_per_shard(
            causal, Tokens(order, np.take_along_axis(ids, order, 1)), num_shards,
            block_q=block_q, block_k=block_k, count=count)
        row[f"tiles {name}"] = float(tiles.max() / tiles.mean())
        row[f"busiest {name}"] = int(tiles.max())
        row[f"per device {name}"] = tiles.tolist()
    return row


def _aligned(name: str, ids: np.ndarray, num_shards: int) -> Optional[dict]:
    """per_document's order aligned to each kernel's ``block_q`` (what a caller passes as
    ``block_size`` for its kernel); None for the orders that do not depend on tiles."""
    if name != "per_document":
        return None
    blocks = {block_q for block_q, _, _ in KERNEL_TILES.values()}
    return {block_q: positions_of(name, ids, num_shards, block_q) for block_q in blocks}


def balance(batch: int, seq_len: int, num_shards: int, seeds: int, block: int) -> list[dict]:
    """One row per (mix, layout): median and worst over ``seeds`` of every measure."""
    rows = []
    for mix_name, mix in mixes.MIXES.items():
        draws = [mix(batch, seq_len, np.random.default_rng(seed)) for seed in range(seeds)]
        for name in layout.LAYOUTS:
            found = [measure(ids, positions_of(name, ids, num_shards, block), num_shards,
                             _aligned(name, ids, num_shards)) for ids in draws]
            row = {"mix": mix_name, "layout": name, "first": found[0]}
            for key, value in found[0].items():
                if isinstance(value, (float, int)):
                    values = [f[key] for f in found]
                    row[key] = {"median": float(np.median(values)), "worst": float(max(values))}
            rows.append(row)
    return rows


#: The orders the masked mixes are measured in.
MASKED_LAYOUTS = tuple(name for name in layout.LAYOUTS if name != "contiguous")


def masked_positions(name: str, ids: np.ndarray, bids: np.ndarray | None, spec: MaskSpec,
                     num_shards: int, block: int) -> np.ndarray:
    """``int32[B, S]`` positions of a masked mix's rows in the order ``name`` (the
    per-document order balanced by the mask: its bidirectional ids and chunks)."""
    if name == "per_document":
        return packing.per_document_positions(ids, num_shards, block, bidirectional_ids=bids,
                                              chunk_size=spec.chunk_size)
    return positions_of(name, ids, num_shards, block)


def masked_measure(spec: MaskSpec, natural: Tokens, positions: np.ndarray, num_shards: int,
                   block: int) -> dict:
    """Busiest/mean shard of visible pairs and of computed ``block`` tiles, and the
    per-shard counts, of ``natural`` (ids in natural order) laid out by ``positions``."""
    laid = Tokens(positions, *(None if x is None else np.take_along_axis(x, positions, 1)
                               for x in (natural.segment_ids, natural.bidirectional_ids)))
    pairs = work.work_per_shard(spec, laid, num_shards)
    tiles = work.computed_tiles_per_shard(spec, laid, num_shards, block_q=block)
    return {"pairs": float(pairs.max() / pairs.mean()), "tiles": float(tiles.max() / tiles.mean()),
            "busiest tiles": int(tiles.max()), "pairs per device": pairs.tolist(), "tiles per device": tiles.tolist()}


def masked_balance(batch: int, seq_len: int, num_shards: int, seeds: int,
                   block: int) -> list[dict]:
    """One row per (masked mix, layout): median and worst over ``seeds`` of the busiest
    shard's pairs and ``block``-tiles over the mean (:data:`~jax_seqpar.tools.mixes.MASKED`: prefix-LM,
    vision-language, chunked causal)."""
    rows = []
    for mix_name, (mix, chunk_size) in mixes.MASKED.items():
        spec = MaskSpec.make(causal=True, chunk_size=chunk_size)
        draws = [mix(batch, seq_len, np.random.default_rng(seed)) for seed in range(seeds)]
        for name in MASKED_LAYOUTS:
            found = [masked_measure(spec, Tokens(None, ids, bids),
                                    masked_positions(name, ids, bids, spec, num_shards, block),
                                    num_shards, block) for ids, bids in draws]
            row = {"mix": mix_name, "layout": name, "first": found[0]}
            for key in ("pairs", "tiles", "busiest tiles"):
                values = [f[key] for f in found]
                row[key] = {"median": float(np.median(values)), "worst": float(max(values))}
            rows.append(row)
    return rows


def _ring_layer(mesh, backward: bool, block: int):
    """A jitted causal ring layer on laid-out tokens (forward, or forward + vjp)."""
    from jax_seqpar.api.attention import sequence_parallel_attention
    from jax_seqpar.kernels.contract import BlockSizes

    def layer(q, k, v, segment_ids, positions):
        return sequence_parallel_attention(
            q, k, v, mesh=mesh, strategy="ring", causal=True, segment_ids=segment_ids,
            positions=positions, kernel="xla", block_sizes=BlockSizes(block, block))

    if not backward:
        return jax.jit(layer)
    return jax.jit(lambda q, k, v, ids, pos: jax.vjp(
        lambda q, k, v: layer(q, k, v, ids, pos), q, k, v)[1](jnp.ones_like(q)))


def ring_times(shape: LayerShape, num_shards: int, *, runs: int, warmup: int,
               blocks: tuple[int, ...] = (256, 128), backward: bool = True) -> list[dict]:
    """Median ms of a causal ring layer (XLA kernel) per mix, zigzag vs per_document,
    for each kernel tile in ``blocks`` (the per-document order aligned to it)."""
    from jax_seqpar.tools.bench import median_ms

    mesh = jax.make_mesh((num_shards,), ("sp",))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, s, shape.dtype)
               for key, s in zip(keys, shape.operand_shapes()[:3]))
    results = []
    for mix_name, mix in mixes.MIXES.items():
        ids = mix(shape.batch, shape.seq_len, np.random.default_rng(0))
        for block in blocks:
            for name in ("zigzag", "per_document"):
                positions = positions_of(name, ids, num_shards, block)
                args = [jnp.take_along_axis(x, jnp.asarray(positions)[..., None, None], 1)
                        for x in (q, k, v)]
                args += [jnp.asarray(np.take_along_axis(ids, positions, 1)),
                         jnp.asarray(positions)]
                row = {"mix": mix_name, "layout": name, "block": block}
                for mode in ("fwd", "fwd_bwd") if backward else ("fwd",):
                    layer = _ring_layer(mesh, mode == "fwd_bwd", block)
                    row[f"{mode}_ms"], _ = median_ms(layer, args, warmup, runs)
                results.append(row)
    return results


def run_packed(shape: LayerShape, num_shards: int, *, seeds: int = 4, runs: int = 3,
               warmup: int = 1, time_ring: bool = True,
               block: int = packing.DEFAULT_BLOCK) -> dict:
    """The bench's numbers (JSON-able): ``balance`` rows and ``times`` of the ring."""
    if shape.seq_len % (2 * num_shards):
        raise ValueError(f"--packed lays out {num_shards} shards: seq_len must be a multiple "
                         f"of {2 * num_shards}. Got {shape.seq_len}.")
    result = {"shape": {"batch": shape.batch, "seq_len": shape.seq_len,
                        "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
                        "head_dim": shape.head_dim, "dtype": shape.dtype},
              "num_shards": num_shards, "seeds": seeds, "block": block,
              "balance": balance(shape.batch, shape.seq_len, num_shards, seeds, block),
              "masked": masked_balance(shape.batch, shape.seq_len, num_shards, seeds, block)}
    if time_ring:
        result["times"] = ring_times(shape, num_shards, runs=runs, warmup=warmup)
        result["load"] = _load()
    return result


def _load() -> str:
    return "load average %.1f %.1f %.1f" % os.getloadavg() if hasattr(os, "getloadavg") else ""


def _cell(measure: dict, fmt: str = "{:.2f}") -> str:
    return (fmt + "/" + fmt).format(measure["median"], measure["worst"])


def format_packed(result: dict) -> str:
    """The balance table, then the ring's times."""
    shape, shards = result["shape"], result["num_shards"]
    kernels = list(KERNEL_TILES)
    headers = ["mix", "layout", "tokens"] + [f"tiles {k}" for k in kernels] + [
        f"busiest {k}" for k in kernels[:2]]
    lines = [[r["mix"], r["layout"], _cell(r["tokens"], "{:.3f}")]
             + [_cell(r[f"tiles {k}"]) for k in kernels]
             + [_cell(r[f"busiest {k}"], "{:.0f}") for k in kernels[:2]]
             for r in result["balance"]]
    text = [f"busiest/mean per device, median/worst over {result['seeds']} seeds: "
            f"B={shape['batch']}, S={shape['seq_len']}, P={shards} (per_document: tokens "
            f"aligned to {result['block']}-token tiles, tiles to each kernel's block_q); "
            "tiles: per-row classes with segment signatures, the kernels' default tiles "
            "(triton: its loop bounds); busiest: computed tiles of the busiest device "
            "(row-tiles)", text_table(headers, lines)]
    if "masked" in result:
        lines = [[r["mix"], r["layout"], _cell(r["pairs"], "{:.3f}"), _cell(r["tiles"], "{:.3f}"),
                  _cell(r["busiest tiles"], "{:.0f}")] for r in result["masked"]]
        text += ["", f"masked mixes, busiest/mean per device, median/worst over "
                 f"{result['seeds']} seeds: visible (query, key) pairs and computed "
                 f"{result['block']}-token tiles (per_document: balanced by the mask); "
                 "busiest tiles: the busiest device's computed tiles (row-tiles)",
                 text_table(["mix", "layout", "pairs", "tiles", "busiest tiles"], lines)]
    if "times" in result:
        modes = [m for m in ("fwd_ms", "fwd_bwd_ms") if m in result["times"][0]]
        rows = [[t["mix"], t["layout"], t["block"]] + [f"{t[m]:.0f}" for m in modes]
                for t in result["times"]]
        text += ["", f"causal ring layer on {shards} CPU devices (XLA kernel, tiles "
                 f"block x block), H={shape['num_heads']}, Hkv={shape['num_kv_heads']}, "
                 f"D={shape['head_dim']}, {shape['dtype']}, median ms; {result['load']}",
                 text_table(["mix", "layout", "block"] + [m.replace("_", " ") for m in modes],
                            rows)]
    return "\n".join(text)


def plot_packed(result: dict, path: str) -> None:
    """PNG: work per device (token work and XLA tiles over the mean) of the first draw of
    each mix, one bar group per layout."""
    from matplotlib.figure import Figure

    mixes_seen = list(dict.fromkeys(r["mix"] for r in result["balance"]))
    figure = Figure(figsize=(4.2 * len(mixes_seen), 6.4), layout="constrained")
    axes = figure.subplots(2, len(mixes_seen), squeeze=False)
    shards = result["num_shards"]
    for column, mix in enumerate(mixes_seen):
        rows = [r for r in result["balance"] if r["mix"] == mix]
        for row_index, (key, what) in enumerate((("token_work", "token work"),
                                                 ("per device xla 256", "tiles (xla 256)"))):
            ax = axes[row_index][column]
            width = 0.8 / len(rows)
            for i, r in enumerate(rows):
                values = np.asarray(r["first"][key], float)
                ax.bar(np.arange(shards) + i * width, values / max(values.mean(), 1e-12),
                       width, label=r["layout"])
            ax.axhline(1.0, color="k", linewidth=0.6)
            ax.set(title=f"{mix}: {what}", xlabel="device", ylabel="/ mean")
            ax.set_xticks(np.arange(shards) + 0.4 - width / 2, range(shards))
    axes[0][0].legend(fontsize=7)
    figure.savefig(path, dpi=110)


__all__ = ["KERNEL_TILES", "MASKED_LAYOUTS", "balance", "format_packed",
           "masked_balance", "masked_measure", "masked_positions",
           "measure", "plot_packed", "positions_of", "ring_times", "run_packed"]
