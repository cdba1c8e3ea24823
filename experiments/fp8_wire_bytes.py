"""Bytes each strategy sends with FP8 compute against bf16 compute (issue 42: K/V travel
in the compute dtype).

For the global call ``sequence_parallel_attention`` on bf16 inputs sharded along the
sequence (``[B, S, H, D]``, ``P(None, "sp")``, ``layout="contiguous"``: no relayout
traffic, the strategy's own bytes), compiles the forward and the forward +
backward (``jax.vjp`` with a given cotangent) once with ``compute_dtype=None`` (bf16)
and once with ``compute_dtype=float8_e4m3fn`` (and with ``Compute(float8_e4m3fn,
backward_dtype=bfloat16)``), and prints per device the bytes every collective sends in
the compiled program (:func:`jax_seqpar.tools.hlo.collective_bytes`), the ratio to bf16,
and :func:`jax_seqpar.comm_bytes` with ``compute_dtype=``. Compile-only targets of
:mod:`jax_seqpar.tools.targets` (no device needed)::

    JAX_PLATFORMS=cpu python experiments/fp8_wire_bytes.py --target h100:8
    JAX_PLATFORMS=cpu python experiments/fp8_wire_bytes.py --target v5p:2x2x2
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # compile-only GPUs

from jax_seqpar.tools import targets  # noqa: E402

targets.emulate_cpu_devices(8, cpu_only=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar as sp  # noqa: E402
from jax_seqpar.tools import aot, hlo  # noqa: E402

MIB = 2.0**20
COMPUTES = {"bf16": None, "fp8": jnp.float8_e4m3fn,
            "fp8/bf16-bwd": sp.Compute(jnp.float8_e4m3fn, backward_dtype=jnp.bfloat16)}
MASKS = {"causal": dict(causal=True), "window": dict(causal=True, window=(1024, 0))}


def _program(mesh, strategy, mask, compute, seq, heads, kv_heads, head_dim, backward):
    spec = NamedSharding(mesh, P(None, "sp"))
    shapes = [jax.ShapeDtypeStruct((1, seq, h, head_dim), jnp.bfloat16, sharding=spec)
              for h in (heads, kv_heads, kv_heads, heads)[:4 if backward else 3]]
    extra = dict(ulysses_size=2) if strategy == "hybrid" else {}
    f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes="sp",
                          strategy=strategy, layout="contiguous", compute_dtype=compute,
                          **mask, **extra)
    return (aot.with_vjp(f) if backward else f), shapes


def _model(strategy, mask, compute, args, backward) -> float:
    sizes = (4, 2) if strategy == "hybrid" else 8
    return sp.comm_bytes(strategy, batch=1, seq_len=args.seq, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.head_dim, axis_sizes=sizes,
                         dtype_bytes=2, backward=backward, compute_dtype=compute, **mask)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--masks", nargs="+", default=list(MASKS))
    parser.add_argument("--strategies", nargs="+",
                        default=["ring", "allgather", "ulysses", "hybrid"])
    parser.add_argument("--target", default="h100:8")
    args = parser.parse_args(argv)
    platform = targets.target_platform(args.target)
    mesh = Mesh(targets.target_mesh(args.target).devices.ravel()[:8], ("sp",))
    print(f"B=1, S={args.seq}, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
          f"bfloat16 inputs, 8 devices, {args.target} ({platform}); MiB one device sends, "
          "and the ratio to the bf16 program")
    print(f"{'mask':<8} {'strategy':<10} {'pass':<5} " + " ".join(
        f"{name:>20}" for name in COMPUTES) + "  model (MiB, in the same order)")
    for mask_name in args.masks:
        for strategy in args.strategies:
            for backward in (False, True):
                cells, models, base = [], [], None
                for compute in COMPUTES.values():
                    fn, shapes = _program(mesh, strategy, MASKS[mask_name], compute, args.seq,
                                          args.heads, args.kv_heads, args.head_dim, backward)
                    compiled = aot.compile_for(fn, shapes, platform).compiled
                    sent = sum(hlo.collective_bytes(compiled).values())
                    base = base or sent
                    cells.append(f"{sent / MIB:10.2f} ({sent / base:5.3f}x)")
                    models.append(_model(strategy, MASKS[mask_name], compute, args, backward))
                print(f"{mask_name:<8} {strategy:<10} {'f+b' if backward else 'fwd':<5} "
                      + " ".join(f"{c:>20}" for c in cells) + "  "
                      + " / ".join(f"{m / MIB:.2f}" for m in models), flush=True)


if __name__ == "__main__":
    main()
