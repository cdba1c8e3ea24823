"""One-command GPU check: correctness on the GPU first, then speed against cuDNN.

1. The Pallas kernel alone (one GPU), for every head dim it supports, bf16 and
   fp16, causal + packed documents + GQA, and softcap: ``out``, ``lse`` and the
   gradients against :mod:`jax_seqpar.core.reference` (float32 on the same GPU).
2. Every strategy (ring, Ulysses, hybrid, all-gather) through the global API over
   all local GPUs, ``kernel="pallas"`` and ``"xla"``: output and gradients against
   the reference.
3. ``experiments/kernel_bench.py``: TFLOP/s of our Pallas kernel against
   ``jax.nn.dot_product_attention(..., implementation="cudnn")``, fwd and fwd+bwd.

    PYTHONPATH=. python experiments/gpu_check.py            # all three
    PYTHONPATH=. python experiments/gpu_check.py --quick    # fewer shapes

Prints one line per check and exits non-zero when any check fails. Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core import reference
from jax_seqpar.api.attention import sequence_parallel_attention
from jax_seqpar.kernels import make_options
from jax_seqpar.kernels.gpu import pallas
from jax_seqpar.core.masks import MaskSpec, Tokens

sys.path.insert(0, os.path.dirname(__file__))
import kernel_bench  # noqa: E402

HEAD_DIMS = [(64, 64), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128),
             (576, 512)]
#: Max |error| / max |reference| allowed (bf16/fp16 inputs, float32 reference).
TOLERANCE = {"out": 2e-2, "grad": 5e-2}


def _relative_error(got, wanted) -> float:
    got, wanted = np.asarray(got, np.float32), np.asarray(wanted, np.float32)
    return float(np.max(np.abs(got - wanted)) / max(np.max(np.abs(wanted)), 1e-6))


def _segments(batch, seq):
    ids = jax.random.randint(jax.random.key(3), (batch, seq), 0, 4)
    return jnp.sort(ids, axis=1).astype(jnp.int32)


def _report(label, errors) -> bool:
    ok = all(err <= TOLERANCE["grad" if name.startswith("d") else "out"]
             for name, err in errors.items())
    detail = " ".join(f"{name}={err:.1e}" for name, err in errors.items())
    print(f"{'ok  ' if ok else 'FAIL'} {label}: {detail}", flush=True)
    return ok


def check_kernel(d_qk, d_v, dtype, *, seq=1024, q_len=None, heads=8, kv_heads=2,
                 softcap=None) -> bool:
    """The Pallas kernel against the reference: out, lse, dq, dk, dv (``q_len``: the
    queries are the last ``q_len`` tokens, e.g. 1 for decode)."""
    q_len = seq if q_len is None else q_len
    keys = jax.random.split(jax.random.key(d_qk), 5)
    q = jax.random.normal(keys[0], (2, q_len, heads, d_qk), dtype)
    k = jax.random.normal(keys[1], (2, seq, kv_heads, d_qk), dtype)
    v = jax.random.normal(keys[2], (2, seq, kv_heads, d_v), dtype)
    w_out = jax.random.normal(keys[3], (2, q_len, heads, d_v))
    w_lse = jax.random.normal(keys[4], (2, q_len, heads))
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (2, seq))
    segments = _segments(2, seq)
    kv_tokens = Tokens(positions, segments)
    q_tokens = Tokens(positions[:, seq - q_len:], segments[:, seq - q_len:])
    scale = d_qk**-0.5

    def ours(q, k, v):
        return pallas.attention(q, k, v, q_tokens, kv_tokens, make_options(
            q, MaskSpec.make(causal=True), scale=scale, kernel="pallas", softcap=softcap))

    def theirs(q, k, v):
        return reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True,
                                   positions=q_tokens.positions,
                                   segment_ids=q_tokens.segment_ids,
                                   kv_positions=kv_tokens.positions,
                                   kv_segment_ids=kv_tokens.segment_ids, scale=scale,
                                   softcap=softcap, return_lse=True)

    def value_and_grads(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse), (out, lse)

        grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])

    got, wanted = value_and_grads(ours), value_and_grads(theirs)
    label = (f"kernel {d_qk}/{d_v} {jnp.dtype(dtype).name} Sq={q_len} Sk={seq} H={heads} "
             f"Hkv={kv_heads}"
             f"{f' softcap={softcap}' if softcap else ''}")
    return _report(label, {name: _relative_error(got[name], wanted[name]) for name in got})


def check_strategy(strategy, kernel, *, seq=4096, heads=8, kv_heads=2, dim=128) -> bool:
    """One strategy over all local GPUs against the reference: out and grads."""
    devices = np.array(jax.devices())
    if strategy == "hybrid":
        if len(devices) < 4 or len(devices) % 2:
            print(f"skip {strategy}: needs an even number >= 4 of GPUs")
            return True
        mesh, axes = jax.sharding.Mesh(devices.reshape(2, -1), ("dcn", "ici")), ("dcn", "ici")
    else:
        mesh, axes = jax.sharding.Mesh(devices, ("sp",)), "sp"
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (1, seq, heads, dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, seq, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, seq, kv_heads, dim), jnp.bfloat16)
    weights = jax.random.normal(keys[3], (1, seq, heads, dim))
    segments = _segments(1, seq)

    def ours(q, k, v):
        return sequence_parallel_attention(q, k, v, mesh=mesh, seq_axes=axes, strategy=strategy,
                                           causal=True, segment_ids=segments, kernel=kernel)

    def theirs(q, k, v):
        return reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True,
                                   segment_ids=segments)

    def value_and_grads(fn):
        def loss(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * weights), out

        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return dict(out=out, dq=grads[0], dk=grads[1], dv=grads[2])

    got, wanted = value_and_grads(ours), value_and_grads(theirs)
    label = f"{strategy} kernel={kernel} on {len(devices)} GPUs S={seq} H={heads} Hkv={kv_heads}"
    return _report(label, {name: _relative_error(got[name], wanted[name]) for name in got})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D=64/128/576 only, short bench")
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"gpu_check needs a GPU (the default backend is {jax.default_backend()!r}).",
              file=sys.stderr)
        return 2
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}")
    start, ok = time.perf_counter(), True
    dims = [(64, 64), (128, 128), (576, 512)] if args.quick else HEAD_DIMS
    for d_qk, d_v in dims:
        for dtype in (jnp.bfloat16, jnp.float16):
            ok &= check_kernel(d_qk, d_v, dtype, heads=4 if d_qk > 256 else 8,
                               kv_heads=1 if d_qk > 256 else 2)
    ok &= check_kernel(128, 128, jnp.bfloat16, softcap=20.0)
    ok &= check_kernel(128, 128, jnp.float32)
    ok &= check_kernel(128, 128, jnp.bfloat16, q_len=1, kv_heads=1)  # decode rows, MQA
    for strategy in ("ring", "ulysses", "hybrid", "allgather"):
        for kernel in ("pallas", "xla"):
            ok &= check_strategy(strategy, kernel)
    print(f"correctness: {'all ok' if ok else 'FAILURES'} ({time.perf_counter() - start:.0f} s)")
    if not args.no_bench:
        seqs = ["8192"] if args.quick else ["4096", "8192", "16384"]
        kernel_bench.main(["--seq", *seqs, "--impl", "pallas", "cudnn"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
