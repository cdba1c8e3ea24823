"""Bytes each strategy sends for a mask whose reach is bounded (chunks, windows): issue 41.

For the global call ``sequence_parallel_attention`` on inputs already sharded along the
sequence (``[B, S, H, D]`` bfloat16, ``P(None, "sp")``, natural order, ``layout="auto"``),
compiles the forward and the forward + backward (``jax.vjp`` with a given cotangent) for
``strategy="ring"``, ``"allgather"`` and ``"auto"`` under causal chunks and a causal
window, and prints per device the bytes every collective sends in the compiled program
(:func:`jax_seqpar.tools.hlo.collective_bytes`) next to :func:`jax_seqpar.comm_bytes`
(``-`` where the package has no ``chunk_size=`` in its model: before issue 41) and what
``"auto"`` chose (the ``jax_seqpar`` logger's line).

By default the programs are compiled for this host's CPU mesh (8 emulated devices; XLA:CPU
sends bf16 collectives as f32, so its bytes are twice a GPU's); ``--target h100:8`` or
``--target v5p:2x2x2`` compiles for a compile-only target of
:mod:`jax_seqpar.tools.targets` (no device needed)::

    python experiments/mask_reach_bytes.py                      # S=8192, the issue's table
    JAX_PLATFORMS=cpu python experiments/mask_reach_bytes.py --target h100:8
    JAX_PLATFORMS=cpu python experiments/mask_reach_bytes.py --target h100:8 --seq 131072 \\
        --masks chunk:8192 --strategies ring allgather auto

Run it with another checkout first on ``PYTHONPATH`` to measure that one (the "before").
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # compile-only GPUs

from jax_seqpar.tools import targets  # noqa: E402

targets.emulate_cpu_devices(8, cpu_only=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar as sp  # noqa: E402
from jax_seqpar import comm_bytes  # noqa: E402
from jax_seqpar.tools import aot, hlo  # noqa: E402

MIB = 2.0**20


def parse_mask(text: str) -> dict:
    """``chunk:1024`` -> causal chunks of 1024; ``window:1024`` -> causal window (1024, 0)."""
    kind, size = text.split(":")
    if kind == "chunk":
        return dict(causal=True, chunk_size=int(size))
    if kind == "window":
        return dict(causal=True, window=(int(size), 0))
    raise ValueError(f"mask {text!r}: chunk:N or window:N")


class _Chosen(logging.Handler):
    """Keeps the last ``strategy="auto"`` line of the ``jax_seqpar`` logger."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.line = ""

    def emit(self, record):
        self.line = record.getMessage()


def _program(mesh: Mesh, strategy: str, mask: dict, seq: int, heads: int, head_dim: int,
             backward: bool):
    spec = NamedSharding(mesh, P(None, "sp"))
    shapes = [jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16, sharding=spec)
              for _ in range(4 if backward else 3)]
    f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes="sp",
                          strategy=strategy, **mask)
    return (aot.with_vjp(f) if backward else f), shapes


def _model(strategy: str, mask: dict, seq: int, heads: int, head_dim: int, shards: int,
           backward: bool, dtype_bytes: int):
    if strategy == "auto":
        return None
    try:
        return comm_bytes(strategy, batch=1, seq_len=seq, num_heads=heads, num_kv_heads=heads,
                          head_dim=head_dim, axis_sizes=shards, dtype_bytes=dtype_bytes,
                          backward=backward, **mask)
    except TypeError:  # no chunk_size= in this checkout's model
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--masks", nargs="+",
                        default=["chunk:1024", "chunk:512", "chunk:2048", "window:1024"])
    parser.add_argument("--strategies", nargs="+", default=["ring", "allgather", "auto"])
    parser.add_argument("--target", default="cpu")
    args = parser.parse_args(argv)
    platform = targets.target_platform(args.target)
    devices = targets.target_mesh(args.target).devices.ravel()[:args.shards]
    mesh = Mesh(devices, ("sp",))
    chosen = _Chosen()
    logging.getLogger("jax_seqpar").addHandler(chosen)
    logging.getLogger("jax_seqpar").setLevel(logging.INFO)
    wire = 4 if platform == "cpu" else 2  # XLA:CPU sends bf16 as f32
    need = args.seq // args.shards * args.heads * args.head_dim * 2 * wire / MIB
    print(f"B=1, S={args.seq}, H=Hkv={args.heads}, D={args.head_dim}, bfloat16, "
          f"{args.shards} devices, {args.target} ({platform}), sharded along the sequence, "
          f"MiB one device sends (K+V of one shard on the wire: {need:.2f} MiB)")
    print(f"{'mask':<12} {'strategy':<10} {'fwd HLO':>9} {'fwd model':>9} {'f+b HLO':>9} "
          f"{'f+b model':>9}  auto chose")
    for text in args.masks:
        mask = parse_mask(text)
        for strategy in args.strategies:
            cells, why = [], ""
            for backward in (False, True):
                chosen.line = ""
                fn, shapes = _program(mesh, strategy, mask, args.seq, args.heads,
                                      args.head_dim, backward)
                compiled = aot.compile_for(fn, shapes, platform).compiled
                sent = sum(hlo.collective_bytes(compiled).values()) / MIB
                model = _model(strategy, mask, args.seq, args.heads, args.head_dim,
                               args.shards, backward, wire)
                cells += [f"{sent:9.2f}", "        -" if model is None else f"{model / MIB:9.2f}"]
                why = why or chosen.line
            found = re.search(r'over \(.*?\): (.+?), layout="auto" -> (\w+)', why)
            why = f"{found.group(1)}, {found.group(2)}" if found else ""
            print(f"{text:<12} {strategy:<10} {' '.join(cells)}  {why}", flush=True)


if __name__ == "__main__":
    main()
