"""Whether FP8 on the wire keeps the transfers hidden behind the kernels (issue 42): the
share of bytes each strategy's compiled training step hides
(:func:`jax_seqpar.tools.schedule.bytes_hidden`) with ``compute_dtype=None`` (bf16) and
``compute_dtype=float8_e4m3fn``, at the compile gate's shape (B=1, S=4096, H=16, Hkv=4,
D=128, bf16, causal; ``positions=`` given: no relayout), on its meshes, with the
target's compile options, for compile-only targets::

    JAX_PLATFORMS=cpu python experiments/fp8_wire_hidden.py --targets h100:8 v5p:2x2x2
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # compile-only GPUs

from jax_seqpar.tools import targets  # noqa: E402

targets.emulate_cpu_devices(8, cpu_only=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar as sp  # noqa: E402
from jax_seqpar.tools import aot, hlo, schedule  # noqa: E402

MESHES = {"ring": {"sp": 8}, "allgather": {"sp": 8}, "ulysses": {"sp": 8},
          "hybrid": {"dcn": 2, "ici": 4}}
MIB = 2.0**20


def training_step(target: str, strategy: str, compute, seq=4096, heads=16, kv_heads=4, dim=128):
    axes = MESHES[strategy]
    mesh = targets.target_mesh(target, tuple(axes), tuple(axes.values()))
    seq_axes = tuple(axes) if len(axes) > 1 else tuple(axes)[0]
    sharding = NamedSharding(mesh, P(None, seq_axes))
    args = [jax.ShapeDtypeStruct((1, seq, h, dim), jnp.bfloat16, sharding=sharding)
            for h in (heads, kv_heads, kv_heads)]
    args.append(jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=sharding))

    def loss(q, k, v, positions):
        out = sp.sequence_parallel_attention(q, k, v, mesh=mesh, seq_axes=seq_axes,
                                             strategy=strategy, causal=True,
                                             positions=positions, compute_dtype=compute)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    platform = targets.target_platform(target)
    return aot.compile_for(jax.grad(loss, argnums=(0, 1, 2)), args, platform,
                           compiler_options=targets.compile_options(platform, strategy)).compiled


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=["h100:8", "v5p:2x2x2"])
    parser.add_argument("--strategies", nargs="+", default=list(MESHES))
    args = parser.parse_args(argv)
    print("training step (jax.grad), B=1, S=4096, H=16, Hkv=4, D=128, bf16 inputs, causal: "
          "MiB sent and the share hidden behind kernels, bf16 compute -> FP8 compute")
    for target in args.targets:
        for strategy in args.strategies:
            cells = []
            for compute in (None, jnp.float8_e4m3fn):
                compiled = training_step(target, strategy, compute)
                sent = sum(hlo.collective_bytes(compiled).values()) / MIB
                cells.append(f"{sent:7.2f} MiB {schedule.bytes_hidden(compiled)['fraction']:6.1%}")
            print(f"{target:<11} {strategy:<10} {cells[0]}  ->  {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
