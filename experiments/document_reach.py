"""Documents stay home: balance, span and ring bytes for each ``max_document_shards`` (issue 41).

For packed rows of ``--seq`` tokens over ``--shards`` devices, each mix and seed is laid out
with ``jax_seqpar.permute_batch(batch, "per_document", P, segment_ids=ids,
max_document_shards=D)`` for D = 1, 2, 3, ``"auto"`` and without the bound (the unbounded
per-document order of issue 29), and the table gives per layout:

* ``pairs`` / ``tiles``: the busiest shard's visible (query, key) pairs and computed
  128-token tiles over their means (:func:`jax_seqpar.core.home_packing.balance`, the
  exact counts of :mod:`jax_seqpar.core.work`; the bound's promise: <= 1.05 and <= 1.10);
* ``span``: the widest document in shards (:func:`jax_seqpar.core.packing.document_shards`);
  or, where an int D is refused (``ValueError``), ``refused: floor X``: the lower bound
  on busiest/mean pairs that every order with documents on at most D shards has
  (:func:`jax_seqpar.core.home_packing.lower_bounds`), and the smallest D the error names;
* the MiB one device sends for the ring with that reach, forward and forward + backward,
  from ``jax_seqpar.comm_bytes("ring", ..., with_segment_ids=True,
  max_document_shards=span)`` (the span is what a model passes on; ``-`` when refused),
  and the forward + backward as a share of the unbounded ring's.

Mixes: ``heavy_tailed``, Pareto lengths ``ceil(64 (1 + Pareto(1.3)))`` clipped to
``--longest`` (64..8192 tokens; the generator of ``tests/test_document_reach.py``'s
home-layout tests), and issue 29's masked mixes ``prefix_lm`` and ``vlm``
(:mod:`jax_seqpar.tools.mixes`), whose bidirectional ids (a document's prefix, an image)
the layout is given, so their balance is that of the prefix / image mask.

With ``--compile`` (the default) the ring is compiled for ``--target`` (compile only, no
device: ``h100:8``) at the same S (B=1, bf16, causal, ``segment_ids`` and ``positions``
of the laid-out batch's shape, ``--compile-seed``'s heavy-tailed mix), the forward and
the forward + backward (``jax.grad`` of a sum), with ``max_document_shards`` the smallest
of ``--compile-bound`` and the smallest D that seed's layout keeps, and without; the
bytes one device sends are read from the compiled HLO
(:func:`jax_seqpar.tools.hlo.collective_bytes`) next to ``comm_bytes``.

Run (the ``[aot]`` extra for ``--compile``; a few minutes)::

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/document_reach.py
    python experiments/document_reach.py --seq 8192 --seeds 0 --no-compile --out /tmp/r.txt
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
import time

#: The environment the command was given (for the results file's first line).
_GIVEN = {k: os.environ[k] for k in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
          if k in os.environ}
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # compile-only GPUs

from jax_seqpar.tools import targets  # noqa: E402

targets.emulate_cpu_devices(8)  # the --fallback-target's devices (before JAX starts)

import numpy as np  # noqa: E402

import jax_seqpar  # noqa: E402
from jax_seqpar.core import home_packing, masks, packing  # noqa: E402
from jax_seqpar.core.masks import MaskSpec  # noqa: E402
from jax_seqpar.tools import mixes  # noqa: E402

MIB = 2.0**20
BOUNDS = (None, 1, 2, 3, "auto")
MIXES = ("heavy_tailed", "prefix_lm", "vlm")


def draw(mix: str, seq: int, seed: int, longest: int):
    """``(segment_ids, bidirectional_ids or None)``, ``int32[1, seq]``, natural order."""
    rng = np.random.default_rng(seed)
    if mix == "heavy_tailed":
        return mixes.draw(lambda r, n: np.minimum(np.ceil(64 * (1 + r.pareto(1.3, n))),
                                                  longest), 1, seq, rng), None
    return getattr(mixes, mix)(1, seq, rng)


def layout(ids, bids, shards: int, bound, block: int) -> dict:
    """One layout of one row: balance and span, or the refusal."""
    batch = {"ids": ids} if bids is None else {"ids": ids, "bids": bids}
    keywords = {} if bound is None else {"max_document_shards": bound}
    start = time.perf_counter()
    try:
        laid, positions = jax_seqpar.permute_batch(batch, "per_document", shards,
                                                   segment_ids=ids, bidirectional_ids=bids,
                                                   block_size=block, **keywords)
    except ValueError as error:
        found = re.search(r"smallest bound that keeps it is max_document_shards=(\d+)",
                          str(error))
        return dict(refused=True, keeps=int(found.group(1)) if found else None,
                    message=str(error), seconds=time.perf_counter() - start)
    tokens = masks.Tokens(positions, laid["ids"], laid.get("bids"))
    pairs, tiles = home_packing.balance(MaskSpec(causal=True), tokens, shards, block)
    span = packing.document_shards(laid["ids"], shards)
    return dict(refused=False, pairs=pairs, tiles=tiles, span=span,
                seconds=time.perf_counter() - start)


def model_bytes(args, bound, backward: bool, dtype_bytes: int = 2) -> float:
    """``comm_bytes`` of the ring with segment ids (and ``max_document_shards=bound``)."""
    return jax_seqpar.comm_bytes(
        "ring", batch=1, seq_len=args.seq, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, axis_sizes=args.shards, dtype_bytes=dtype_bytes,
        backward=backward, with_segment_ids=True, causal=True, max_document_shards=bound)


def compiled_bytes(args, target: str, bound, backward: bool) -> float:
    """Bytes one device sends in the ring compiled for ``target`` (HLO)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_seqpar.tools import aot, hlo

    mesh = Mesh(targets.target_mesh(target).devices.ravel()[:args.shards], ("sp",))
    platform = targets.target_platform(target)
    seq = NamedSharding(mesh, P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, args.seq, args.heads, args.head_dim), jnp.bfloat16,
                             sharding=seq)
    kv = jax.ShapeDtypeStruct((1, args.seq, args.kv_heads, args.head_dim), jnp.bfloat16,
                              sharding=seq)
    index = jax.ShapeDtypeStruct((1, args.seq), jnp.int32, sharding=seq)
    attend = functools.partial(jax_seqpar.sequence_parallel_attention, mesh=mesh,
                               seq_axes="sp", strategy="ring", causal=True,
                               max_document_shards=bound)

    def forward(q, k, v, ids, positions):
        return attend(q, k, v, segment_ids=ids, positions=positions)

    def step(q, k, v, ids, positions):
        return jax.grad(lambda q, k, v: forward(q, k, v, ids, positions).astype(
            jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    compiled = aot.compile_for(step if backward else forward, (q, kv, kv, index, index),
                               platform).compiled
    return float(sum(hlo.collective_bytes(compiled).values()))


def _check_bytes(args, bound) -> float:
    """Bytes of the bound's check (one all-gather of the int32 ids), inside ``comm_bytes``."""
    from jax_seqpar.core.masks import MaskSpec
    from jax_seqpar.strategies import traffic

    return traffic.document_check_bytes(MaskSpec.make(max_document_shards=bound), batch=1,
                                        seq_len=args.seq, devices=args.shards)


def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:.2f}"


def _name(bound) -> str:
    return "unbounded" if bound is None else f"D={bound}"


def header(argv) -> str:
    """The exact command, the commit and JAX's version."""
    import jax

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "jax_seqpar"],
                               cwd=os.path.dirname(here), capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    env = "".join(f"{k}={v} " for k, v in _GIVEN.items())
    command = " ".join(shlex.quote(a) for a in ["python", "experiments/document_reach.py",
                                                *argv])
    return (f"$ {env}{command}   # jax {jax.__version__}, commit {commit or 'unknown'}"
            f"{' (jax_seqpar modified)' if dirty else ''}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=131072, help="tokens per row S")
    parser.add_argument("--shards", type=int, default=8, help="devices P")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    parser.add_argument("--longest", type=int, default=8192,
                        help="heavy_tailed: longest document")
    parser.add_argument("--block", type=int, default=128, help="tile the layout aligns to")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the ring for --target and read its bytes (default on)")
    parser.add_argument("--target", default="h100:8")
    parser.add_argument("--fallback-target", default="cpu:8",
                        help="compiled where --target fails ('' for none)")
    parser.add_argument("--compile-seed", type=int, default=0)
    parser.add_argument("--compile-bound", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "document_reach.txt"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    lines: list[str] = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    say(header(argv))
    say(f"B=1, S={args.seq}, P={args.shards} shards; balance: busiest/mean visible pairs and "
        f"computed {args.block}-tiles (bound: <= {home_packing.PAIRS_BOUND}, <= "
        f"{home_packing.TILES_BOUND}); span: widest document in shards")
    say(f"ring MiB one device sends (comm_bytes, H={args.heads}, Hkv={args.kv_heads}, "
        f"head dim {args.head_dim}, bf16, segment ids, max_document_shards=span); "
        "f+b/unb: forward+backward over the unbounded ring's (a span of P, or a D whose "
        "reach covers every shard, is the full ring plus the bound's check)")
    say("prefix_lm, vlm: the home layout takes their bidirectional ids (permute_batch("
        "bidirectional_ids=)): balance of the prefix / image mask")
    say("the home layout's line search evaluates a fixed number of orders (jax_seqpar.core."
        "home_line.SEARCH_TRIALS): the same layout on every machine, every run")
    say()
    say(f"| mix | seed | layout | span | pairs | tiles | fwd MiB | f+b MiB | f+b/unb |")
    say("|---|---|---|---|---|---|---|---|---|")
    feasible = {}  # (mix, seed): smallest D kept
    full = {b: model_bytes(args, None, b) for b in (False, True)}
    for mix in args.mixes:
        for seed in args.seeds:
            ids, bids = draw(mix, args.seq, seed, args.longest)
            natural = masks.Tokens(np.arange(args.seq, dtype=np.int32)[None], ids, bids)
            floors = home_packing.lower_bounds(MaskSpec(causal=True), natural, args.shards)
            real = ids[ids != masks.PAD_SEGMENT]
            longest = int(np.bincount(real - real.min()).max()) if real.size else 0
            for bound in BOUNDS:
                got = layout(ids, bids, args.shards, bound, args.block)
                if got["refused"]:
                    keeps = got["keeps"]
                    note = (f"; smallest kept D={keeps}" if keeps else
                            f"; no D < {args.shards} keeps it"
                            if "no bound below" in got["message"] else "")
                    if np.isfinite(floors[bound - 1]):
                        floor = f"{floors[bound - 1]:.3f}"
                    else:  # a document has more tokens than D shards hold
                        floor = f"inf (a document of {longest} tokens)"
                    say(f"| {mix} | {seed} | {_name(bound)} | refused: floor "
                        f"{floor}{note} | - | - | - | - | - |")
                    continue
                if isinstance(bound, int):
                    feasible.setdefault((mix, seed), bound)
                reach = None if bound is None else got["span"]
                fwd, both = (model_bytes(args, reach, b) for b in (False, True))
                say(f"| {mix} | {seed} | {_name(bound)} | {got['span']} | {got['pairs']:.3f} "
                    f"| {got['tiles']:.3f} | {_mib(fwd)} | {_mib(both)} "
                    f"| {both / full[True]:.0%} |")
    say()
    say(f"balance and model: {time.perf_counter() - started:.0f} s")

    if args.compile:
        compile_started = time.perf_counter()
        kept = feasible.get(("heavy_tailed", args.compile_seed))
        if kept is None and "heavy_tailed" in args.mixes:
            ids, _ = draw("heavy_tailed", args.seq, args.compile_seed, args.longest)
            laid, _ = jax_seqpar.permute_batch({"ids": ids}, "per_document", args.shards,
                                               segment_ids=ids, block_size=args.block,
                                               max_document_shards="auto")
            kept = packing.document_shards(laid["ids"], args.shards)
        bound = args.compile_bound if kept is None else max(args.compile_bound, kept)
        say()
        say(f"compiled ring (compile only), B=1, S={args.seq}, H={args.heads}, "
            f"Hkv={args.kv_heads}, head dim {args.head_dim}, bf16, causal, segment_ids + "
            f"positions (heavy_tailed seed {args.compile_seed}'s layout keeps D={kept}); MiB "
            f"one device sends, from the HLO and comm_bytes (XLA:CPU sends bf16 as f32: "
            f"dtype_bytes=4 there)")
        say("| target | max_document_shards | program | HLO MiB | comm_bytes MiB | "
            "the check's gather MiB |")
        say("|---|---|---|---|---|---|")
        failures = {}
        for target in dict.fromkeys([args.target, args.fallback_target]):
            if not target:
                continue
            wire = 4 if targets.target_platform(target) == "cpu" else 2
            for reach in (bound, None):
                if target == args.fallback_target and target != args.target and not failures:
                    continue  # the fallback only where the target failed
                for backward in (False, True):
                    program = "fwd+bwd" if backward else "fwd"
                    try:
                        sent = _mib(compiled_bytes(args, target, reach, backward))
                    except Exception as error:  # noqa: BLE001 - recorded, not hidden
                        reason = (f"{type(error).__name__}: "
                                  f"{str(error).strip().splitlines()[-1][:200]}")
                        failures[(target, reach, program)] = reason
                        sent = "failed (below)"
                    model = model_bytes(args, reach, backward, wire)
                    check = _check_bytes(args, reach)
                    say(f"| {target} | {reach} | {program} | {sent} | {_mib(model)} | "
                        f"{_mib(check)} |")
        for (target, reach, program), reason in failures.items():
            say(f"failed: {target} max_document_shards={reach} {program}: {reason}")
        say("(the bound's check, jax_seqpar.core.checks.refuse_unless, raises through a "
            "host callback, which a program compiled for a platform this process has no "
            "device of cannot hold: a compile-only program keeps neither the callback nor "
            "the ids' gather, so its HLO bytes are comm_bytes less the gather; on a "
            "device both are in the program)")
        say()
        say(f"compile: {time.perf_counter() - compile_started:.0f} s")
    say(f"total: {time.perf_counter() - started:.0f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as file:
            file.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
