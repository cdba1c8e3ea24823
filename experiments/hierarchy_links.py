"""The hierarchy compiled where the slow links are real: bytes over each kind of link.

The hybrid runs Ulysses inside a host (NVLink) or a TPU slice (ICI) and the ring across
hosts or slices (the network, DCN). This compiles it for two hosts of 8 H100s
(``h100:16``) and two v5p slices of 8 chips (``v5p:2x2x2*2``) on a ``("dcn", "ici")``
mesh and reads the compiled programs: the bytes one device sends within a host / slice
and across, and the share of each that the schedule hides behind a kernel
(:func:`jax_seqpar.tools.schedule.bytes_by_link`). The tokens arrive already in the
order the call computes in (for plain causal, ``positions`` given, as a model that
permutes its batch once passes them; a chunked or windowed mask computes in the tokens' own
contiguous order), so only the strategy's own transfers are counted. A mask whose reach stays
inside a host (``chunk:16384`` at S=32768 over 2 x 8 devices: the outer ring's reach is
(0, 0)) sends nothing across; one whose reach is (0, 0) over every device (``chunk:2048``)
sends nothing at all; a window sends its halo.

Run (the ``[aot]`` extra; about a minute a target)::

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/hierarchy_links.py
    ... --targets h100:16 --masks causal chunk:16384   # one target, two masks
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar  # noqa: E402
from jax_seqpar.tools import schedule, targets  # noqa: E402

AXES = ("dcn", "ici")


def links(target: str, *, seq: int, heads: int, kv_heads: int, head_dim: int,
          backward: bool, **mask) -> dict:
    """``bytes_by_link`` of the hybrid's compiled forward (or forward + vjp) on
    ``target``'s ``("dcn", "ici")`` mesh, bf16, B=1."""
    mesh = targets.target_mesh(target, AXES)
    platform = targets.target_platform(target)
    sharded = NamedSharding(mesh, P(None, AXES))
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16, sharding=sharded)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.bfloat16, sharding=sharded)
    positions = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=sharded)

    def forward(q, k, v, positions):
        # A bounded reach needs the contiguous split, which tokens in their own order are
        # (no positions); plain causal is balanced in the zigzag order positions describe.
        return jax_seqpar.sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=AXES, strategy="hybrid", causal=True,
            positions=None if mask else positions, **mask)

    def step(q, k, v, positions):
        out, pull = jax.vjp(lambda q, k, v: forward(q, k, v, positions), q, k, v)
        return pull(jnp.ones_like(out))

    compiled = jax.jit(step if backward else forward).trace(q, kv, kv, positions).lower(
        lowering_platforms=(platform,)).compile(
        compiler_options=targets.compile_options(platform, "hybrid"))
    return schedule.bytes_by_link(compiled, mesh.shape["ici"])


def parse_mask(text: str) -> dict:
    """``causal``, ``chunk:N`` (causal chunks) or ``window:N`` (causal window (N, 0))."""
    if text == "causal":
        return {}
    kind, size = text.split(":")
    return {"chunk_size": int(size)} if kind == "chunk" else {"window": (int(size), 0)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=["h100:16", "v5p:2x2x2*2"])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--masks", nargs="+", default=["causal"],
                        help="causal, chunk:N (causal chunks), window:N (causal window)")
    args = parser.parse_args(argv)
    print(f"hybrid, S={args.seq}, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
          "bf16, causal; MiB one device sends per program run, and the share hidden "
          "behind a kernel")
    print("| target | mask | program | within: MiB | hidden | across: MiB | hidden |")
    print("|---|---|---|---|---|---|---|")
    for target in args.targets:
        for text in args.masks:
            for backward in (False, True):
                by_link = links(target, seq=args.seq, heads=args.heads,
                                kv_heads=args.kv_heads, head_dim=args.head_dim,
                                backward=backward, **parse_mask(text))
                cells = [f"{part['total'] / 2**20:.2f} | "
                         + (f"{part['fraction']:.0%}" if part["total"] else "-")
                         for part in (by_link["within"], by_link["across"])]
                print(f"| {target} | {text} | {'fwd+bwd' if backward else 'fwd'} "
                      f"| {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
