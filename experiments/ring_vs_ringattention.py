"""Our zigzag ring against the ``ringattention`` package (Liu et al., arXiv:2310.01889).

Makes the README's Benchmarks table (time and temp memory, ours / ringattention;
``docs/benchmarks.md``) with ``--seqs 8192`` and ``--seqs 16384``, one at a time.

Both run causal fwd+bwd attention, B=1 H=8 D=64 float32, on an 8-device CPU mesh
(emulated: the 8 devices share this machine's cores, so times compare the two
programs, not real interconnects). For each sequence length S it reports:

* fwd and fwd+bwd time: ``jax.jit(attention)`` and
  ``jax.jit(jax.value_and_grad(sum(out * w)))`` w.r.t. q, k, v, median of
  ``--repeats`` runs after ``--warmup`` runs;
* per-device temp memory from ``compiled.memory_analysis()`` (fwd+bwd and fwd);
* bytes one device sends, read from the compiled HLO (:mod:`jax_seqpar.tools.hlo`);
* max abs error of out and of dq/dk/dv against an exact reference computed in
  query blocks (``jax_seqpar.core.reference`` per chunk, rematerialized), or against
  the other implementation when S exceeds ``--reference-max-seq``.

Theirs: ``ring_attention(q, k, v, attn_bias, segment_ids, cache_idx, axis_name,
float32_logits, blockwise_kwargs)`` from ``ringattention/ringattention_jax.py``
(the jnp/XLA implementation; the package's ``__init__`` picks a backend at
import and breaks on current JAX, so that one file is loaded on its own),
inside ``jax.shard_map`` with ``in_specs=P(None, "sp", None, None)`` (contiguous
sequence shards: its causal mask derives positions from ``axis_index``), and
``check_vma=False`` (its scan/cond carries mix device-invariant zeros with
device-varying values). Settings as in its own examples: ``causal_block_size=1``
(token-level causal; larger values are block-causal, a different mask),
``float32_logits=True``, ``policy=nothing_saveable``, ``prevent_cse=True``, and
``query_chunk_size = key_chunk_size = --chunk``.

Ours: ``jax_seqpar.sequence_parallel_attention(..., strategy="ring",
causal=True, layout="zigzag")`` with the kernel's tiles set to ``--chunk``; the
call includes relayouting q, k, v into zigzag order and the output back.

Usage::

    pip install ringattention==0.1.2 --no-deps && pip install einops
    PYTHONPATH=. python3 experiments/ring_vs_ringattention.py --seqs 8192,16384
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_seqpar.tools import hlo
from jax_seqpar.core import reference  # noqa: E402

BATCH, HEADS, HEAD_DIM = 1, 8, 64
MIB = 2**20


def load_ringattention_jax():
    """``ringattention/ringattention_jax.py`` as a module, without the package ``__init__``."""
    spec = importlib.util.find_spec("ringattention")  # locates; does not import
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("ringattention is not installed: pip install ringattention==0.1.2 "
                         "--no-deps && pip install einops")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "ringattention_jax.py"
    file_spec = importlib.util.spec_from_file_location("_ringattention_jax_file", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


def theirs(mesh, chunk):
    """``f(q, k, v) -> out`` on global ``[B, S, H, D]`` arrays, ringattention's ring."""
    ringattention_jax = load_ringattention_jax()
    blockwise_kwargs = dict(
        causal_block_size=1, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
        query_chunk_size=chunk, key_chunk_size=chunk, dtype=jnp.float32,
        policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True)

    def per_shard(q, k, v):  # [B, S/8, H, D] each
        return ringattention_jax.ring_attention(
            q, k, v, None, None, None, "sp", True, blockwise_kwargs)

    seq = P(None, "sp", None, None)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq,
                         check_vma=False)


def ours(mesh, tile):
    """``f(q, k, v) -> out``: ``jax_seqpar.sequence_parallel_attention``, zigzag ring.

    ``tile=None`` keeps the kernel's default tiles.
    """
    import jax_seqpar
    from jax_seqpar.kernels import BlockSizes

    return functools.partial(
        jax_seqpar.sequence_parallel_attention, mesh=mesh, seq_axes="sp", strategy="ring",
        causal=True, layout="zigzag", block_sizes=tile and BlockSizes(tile, tile, tile, tile))


def chunked_reference(q, k, v, chunk):
    """Exact causal attention, ``chunk`` queries at a time (never the full [S, S] scores)."""
    batch, seq_len, heads, head_dim = q.shape
    kv_positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))

    @jax.checkpoint
    def one_chunk(args):
        q_chunk, positions = args  # [B, C, H, D], [C]
        return reference.attention(q_chunk, k, v, causal=True, kv_positions=kv_positions,
                                   positions=jnp.broadcast_to(positions, (batch, chunk)))

    q_chunks = q.reshape(batch, seq_len // chunk, chunk, heads, head_dim).swapaxes(0, 1)
    positions = jnp.arange(seq_len, dtype=jnp.int32).reshape(seq_len // chunk, chunk)
    out = jax.lax.map(one_chunk, (q_chunks, positions))  # [S/C, B, C, H, D]
    return out.swapaxes(0, 1).reshape(batch, seq_len, heads, v.shape[-1])


def value_and_grads(attention):
    """``(q, k, v, w) -> (sum(out * w), (dq, dk, dv))``, plus the output itself."""

    def loss(q, k, v, w):
        out = attention(q, k, v)
        return jnp.sum(out * w), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


def run(name, attention, args, repeats, warmup):
    """Compiles, measures memory and traffic, times fwd+bwd; returns a result dict."""
    compiled = jax.jit(value_and_grads(attention)).lower(*args).compile()
    forward = jax.jit(attention).lower(*args[:3]).compile()

    def median_seconds(program, program_args):
        for _ in range(warmup):
            jax.block_until_ready(program(*program_args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = jax.block_until_ready(program(*program_args))
            times.append(time.perf_counter() - start)
        return statistics.median(times), result

    forward_seconds, _ = median_seconds(forward, args[:3])
    seconds, ((_, out), grads) = median_seconds(compiled, args)
    return dict(
        name=name, seconds=seconds, forward_seconds=forward_seconds, out=out, grads=grads,
        temp=hlo.memory_bytes(compiled)["temp"], forward_temp=hlo.memory_bytes(forward)["temp"],
        sent=sum(hlo.collective_bytes(compiled).values()))


def max_errors(result, expected_out, expected_grads):
    def error(actual, expected):  # on the host: the arrays live on different devices
        return float(np.max(np.abs(np.asarray(actual) - np.asarray(expected))))

    out_error = error(result["out"], expected_out)
    grad_error = max(error(a, b) for a, b in zip(result["grads"], expected_grads))
    return out_error, grad_error


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="8192,16384",
                        help="comma-separated sequence lengths (multiples of 16 * chunk / 8)")
    parser.add_argument("--chunk", type=int, default=512,
                        help="ringattention's query/key chunk size (and the reference's)")
    parser.add_argument("--tile", type=int, default=None,
                        help="our kernel's tile size (default: the kernel's own default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    parser.add_argument("--reference-max-seq", type=int, default=16384,
                        help="above this S, compare ours against theirs instead")
    parser.add_argument("--only", choices=("theirs", "ours"), default=None,
                        help="run one implementation only")
    options = parser.parse_args()
    seqs = [int(s) for s in options.seqs.split(",")]

    mesh = Mesh(np.array(jax.devices()), ("sp",))
    sharding = NamedSharding(mesh, P(None, "sp", None, None))
    implementations = {"theirs": theirs, "ours": ours}
    if options.only:
        implementations = {options.only: implementations[options.only]}

    rows = []
    for seq_len in seqs:
        keys = jax.random.split(jax.random.key(seq_len), 4)
        args = tuple(jax.device_put(jax.random.normal(key, (BATCH, seq_len, HEADS, HEAD_DIM)),
                                    sharding) for key in keys)  # q, k, v, w
        sizes = {"theirs": options.chunk, "ours": options.tile}
        results = [run(name, make(mesh, sizes[name]), args, options.repeats, options.warmup)
                   for name, make in implementations.items()]
        expected, against = None, "-"
        if seq_len <= options.reference_max_seq:
            host = jax.devices()[0]
            local = tuple(jax.device_put(x, host) for x in args)
            (_, out), grads = jax.jit(value_and_grads(
                functools.partial(chunked_reference, chunk=options.chunk)))(*local)
            expected, against = (out, grads), "reference"
        elif len(results) == 2:  # the full reference would not fit: ours vs theirs
            expected, against = (results[0]["out"], results[0]["grads"]), "theirs"
        for result in results:
            compare = expected is not None and not (against == "theirs"
                                                    and result["name"] == "theirs")
            errors = max_errors(result, *expected) if compare else (float("nan"),) * 2
            rows.append((seq_len, result, errors, against if compare else "-"))
            print(f"done S={seq_len} {result['name']}: {result['seconds']:.2f} s", flush=True)
        del results

    print(f"\nB={BATCH} H={HEADS} D={HEAD_DIM} float32 causal, 8 CPU devices, ringattention "
          f"chunk {options.chunk}, our tile {options.tile or 'default'}, median of "
          f"{options.repeats}\n")
    header = (f"{'S':>6} {'impl':>6} {'fwd s':>7} {'fwd+bwd s':>10} {'temp MiB':>9} "
              f"{'fwd temp MiB':>12} "
              f"{'sent MiB':>9} {'max|dout|':>10} {'max|dgrad|':>10}  vs")
    print(header)
    print("-" * len(header))
    for seq_len, result, (out_error, grad_error), against in rows:
        print(f"{seq_len:>6} {result['name']:>6} {result['forward_seconds']:>7.3f} "
              f"{result['seconds']:>10.3f} "
              f"{result['temp'] / MIB:>9.1f} {result['forward_temp'] / MIB:>12.1f} "
              f"{result['sent'] / MIB:>9.2f} {out_error:>10.2e} {grad_error:>10.2e}  {against}")

    by_key = {(seq_len, result["name"]): result for seq_len, result, _, _ in rows}
    if len(implementations) == 2:
        print("\nours / theirs")
        for seq_len in seqs:
            mine, other = by_key[seq_len, "ours"], by_key[seq_len, "theirs"]
            forward_ratio = mine["forward_seconds"] / other["forward_seconds"]
            print(f"  S={seq_len}: fwd time {forward_ratio:.2f}x, "
                  f"fwd+bwd time {mine['seconds'] / other['seconds']:.2f}x, "
                  f"temp memory {mine['temp'] / other['temp']:.2f}x, "
                  f"bytes sent {mine['sent'] / other['sent']:.2f}x")
    print("\ntemp memory growth when S doubles")
    for name in implementations:
        for small, large in zip(seqs, seqs[1:]):
            if large == 2 * small:
                growth = by_key[large, name]["temp"] / by_key[small, name]["temp"]
                print(f"  {name}: S {small} -> {large}: {growth:.2f}x")


if __name__ == "__main__":
    main()
