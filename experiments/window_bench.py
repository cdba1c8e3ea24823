"""Sliding-window attention under sequence parallelism: what each strategy sends.

For a causal window ``W`` at sequence length ``S`` on ``P`` devices, compiles the
forward + backward (``jax.vjp`` with a given cotangent) of the window ring (halo
exchange), the full ring (the same window with explicit positions, which forbid
skipping), the windowed all-gather and Ulysses, and prints per device: the bytes
every collective sends (read from the compiled HLO by :mod:`jax_seqpar.hlo`), the
model's :func:`jax_seqpar.plan.comm_bytes`, and XLA's temp memory. With ``--time``
it also runs each program on the CPU mesh (median of ``--runs`` calls).

    python experiments/window_bench.py                       # S=32768, W=128,1024,4096, P=2,4,8
    python experiments/window_bench.py --seq 8192 --windows 128 1024 --time

Shapes: B=1, H=8, Hkv=8, D=64, float32 (the CPU backend sends bf16 as f32 anyway).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar as sp  # noqa: E402
from jax_seqpar import hlo  # noqa: E402
from jax_seqpar.plan import comm_bytes  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 8, 64
# (label, per-shard function, comm_bytes strategy, whether the window is modelled)
VARIANTS = (("window ring", "ring", True), ("full ring", "ring", False),
            ("allgather", "allgather", True), ("ulysses", "ulysses", True))


def _program(strategy: str, num_shards: int, seq: int, window, full_ring: bool):
    mesh = Mesh(np.array(jax.devices()[:num_shards]), ("sp",))
    spec = P(None, "sp")
    fn = getattr(sp, f"{strategy}_attention")

    def body(q, k, v):
        positions = None
        if full_ring:  # explicit (contiguous) positions: the ring may not skip a hop
            positions = sp.layout.shard_positions("contiguous", q.shape[1], axis_name="sp")
            positions = jnp.broadcast_to(positions, q.shape[:2])
        return fn(q, k, v, axis_name="sp", causal=True, window=window, positions=positions,
                  kernel="xla")

    attend = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def f_and_vjp(q, k, v, cotangent):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(cotangent)

    sharding = NamedSharding(mesh, spec)
    shapes = [jax.ShapeDtypeStruct((1, seq, h, HEAD_DIM), jnp.float32, sharding=sharding)
              for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    return jax.jit(f_and_vjp), shapes


def _time(fn, shapes, runs: int) -> float:
    args = [jax.device_put(jnp.ones(s.shape, s.dtype), s.sharding) for s in shapes]
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--time", action="store_true", help="also run on the CPU mesh")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"causal window, S={args.seq}, B=1, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, "
          "float32, forward+backward, per device")
    header = f"{'W':>5} {'P':>2} {'strategy':<12} {'HLO bytes':>13} {'comm_bytes':>13} {'temp MiB':>9}"
    print(header + ("  time s" if args.time else ""))
    for window in args.windows:
        for num_shards in args.shards:
            for label, strategy, windowed in VARIANTS:
                fn, shapes = _program(strategy, num_shards, args.seq, (window, 0),
                                      full_ring=not windowed)
                compiled = fn.lower(*shapes).compile()
                measured = sum(hlo.collective_bytes(compiled).values())
                model = comm_bytes(strategy, batch=1, seq_len=args.seq, num_heads=HEADS,
                                   num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                   axis_sizes=num_shards, dtype_bytes=4, backward=True,
                                   window=(window, 0) if windowed else None, causal=True)
                temp = hlo.memory_bytes(compiled)["temp"] / 2**20
                line = (f"{window:>5} {num_shards:>2} {label:<12} {measured:>13,.0f} "
                        f"{model:>13,.0f} {temp:>9.1f}")
                if args.time:
                    line += f"  {_time(fn, shapes, args.runs):6.3f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
