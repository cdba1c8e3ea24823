"""What one attention layer sends: relayout per call vs the batch laid out once.

For each strategy on 8 emulated CPU devices, compiles one global
``sequence_parallel_attention`` call two ways and reads the bytes each device sends
from the compiled HLO (``jax_seqpar.tools.hlo``), forward and forward+backward:

* ``natural order``: tokens in natural order, relayouted (zigzag) inside every call
  and back, in the forward and the backward;
* ``positions=``: the batch already laid out once (``permute_batch``), no relayout;

next to ``jax_seqpar.comm_bytes``. Default shape: ring, causal, H=8, Hkv=1, D=64, fp32,
S=1024 (XLA:CPU sends bf16 as f32, so fp32 is what a CPU program measures).

    PYTHONPATH=. python experiments/layer_bytes.py
"""

import argparse
import functools
import os

os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_seqpar as sp  # noqa: E402
from jax_seqpar.tools import hlo  # noqa: E402


def layer_bytes(strategy, *, batch, seq, heads, kv_heads, dim, laid_out):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("sp",))
    q = jnp.ones((batch, seq, heads, dim), jnp.float32)
    k = v = jnp.ones((batch, seq, kv_heads, dim), jnp.float32)
    kwargs = dict(mesh=mesh, strategy=strategy, causal=True)
    if laid_out:
        kwargs["positions"] = jnp.broadcast_to(sp.zigzag_positions(seq, 8), (batch, seq))
    else:
        kwargs["layout"] = "zigzag" if strategy != "ulysses" else "contiguous"
    f = functools.partial(sp.sequence_parallel_attention, **kwargs)
    fwd = sum(hlo.collective_bytes(jax.jit(f).lower(q, k, v).compile()).values())

    def fwd_bwd(q, k, v, dout):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(dout)

    both = sum(hlo.collective_bytes(jax.jit(fwd_bwd).lower(q, k, v, q).compile()).values())
    return fwd, both


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="ring,allgather,ulysses")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    shape = dict(batch=1, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads,
                 dim=args.head_dim)
    print(f"B=1 S={args.seq} H={args.heads} Hkv={args.kv_heads} D={args.head_dim} fp32 causal, "
          "8 devices; bytes sent per device (compiled HLO)")
    print(f"{'strategy':>10} {'pass':>8} {'natural order':>14} {'positions=':>12} "
          f"{'comm_bytes':>12} {'natural/laid':>13}")
    for strategy in args.strategies.split(","):
        model = functools.partial(sp.comm_bytes, strategy, batch=1, seq_len=args.seq,
                                  num_heads=args.heads, num_kv_heads=args.kv_heads,
                                  head_dim=args.head_dim, axis_sizes=8, dtype_bytes=4)
        natural = layer_bytes(strategy, laid_out=False, **shape)
        laid = layer_bytes(strategy, laid_out=True, **shape)
        for name, a, b, m in (("fwd", natural[0], laid[0], model()),
                              ("fwd+bwd", natural[1], laid[1], model(backward=True))):
            print(f"{strategy:>10} {name:>8} {a:14,.0f} {b:12,.0f} {m:12,.0f} {a / b:12.2f}x")


if __name__ == "__main__":
    main()
