"""One-command check of the Mosaic kernel on a machine WITH a TPU: correctness, then speed.

    python experiments/mosaic_tpu_check.py            # defaults: S=8192, H=16, Hkv=4, D=128
    python experiments/mosaic_tpu_check.py --seq 32768 --head-dim 128 --kv-heads 8

1. Correctness: ``kernel="mosaic"`` (compiled by Mosaic, not interpreted) against
   :mod:`jax_seqpar.core.reference` on small cases (MHA/GQA/MQA, causal, window,
   segments, ragged, MLA 576/512, softcap-free), out, lse, dq, dk, dv, float32
   and bfloat16, with the test suite's tolerances; exits non-zero on a mismatch.
2. Speed: forward and forward+backward of one chip's attention at the given
   shape with the Mosaic kernel, the XLA kernel and JAX's splash attention:
   median wall time and model TFLOP/s (causal counts half the score matrix).

Refuses to run without a TPU (the CPU path is the interpreter: see tests/).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar import kernels
from jax_seqpar.core import reference
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.kernels.options import Options

TOLERANCES = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 5e-2)}
CASES = [  # (batch, seq, heads, kv_heads, d_qk, d_v, causal, window, segments)
    (2, 1024, 4, 4, 128, 128, False, None, False),
    (1, 1536, 8, 2, 128, 128, True, None, True),
    (1, 1000, 4, 1, 64, 64, True, (300, 0), False),
    (1, 1024, 4, 4, 256, 256, True, None, False),
    (1, 1024, 4, 1, 576, 512, True, None, False),
]


def _case_inputs(case, dtype):
    batch, seq, heads, kv_heads, d_qk, d_v, causal, window, segments = case
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (batch, seq, heads, d_qk), dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, d_qk), dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, d_v), dtype)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    seg = (positions >= seq // 3).astype(jnp.int32) if segments else None
    weights = (jax.random.normal(keys[3], (batch, seq, heads, d_v)),
               jax.random.normal(keys[4], (batch, seq, heads)))
    return (q, k, v), Tokens(positions, seg), MaskSpec.make(causal, window), weights


def _grads(attend, inputs, weights):
    def loss(q, k, v):
        out, lse = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * weights[0]) + jnp.sum(lse * weights[1]), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*inputs)
    return [out, lse, *grads]


def check_correctness() -> bool:
    module = kernels.get("mosaic")
    ok = True
    for case in CASES:
        for dtype in (jnp.float32, jnp.bfloat16):
            inputs, tokens, spec, weights = _case_inputs(case, dtype)
            scale = case[4] ** -0.5
            options = Options(spec, scale, module)
            ours = _grads(lambda q, k, v: module.attention(q, k, v, tokens, tokens, options),
                          inputs, weights)
            theirs = _grads(lambda q, k, v: reference.attention(
                *(x.astype(jnp.float32) for x in (q, k, v)), causal=spec.causal,
                window=spec.window, scale=scale, positions=tokens.positions,
                segment_ids=tokens.segment_ids, return_lse=True), inputs, weights)
            atol, rtol = TOLERANCES[dtype]
            for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), ours, theirs):
                got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
                # Gradients sum over the sequence: compare relative to their size.
                size = 1.0 if name in ("out", "lse") else max(1.0, float(np.abs(want).max()))
                err = float(np.abs(got - want).max()) / size
                good = np.allclose(got / size, want / size, atol=atol, rtol=rtol)
                ok &= good
                print(f"{'ok  ' if good else 'FAIL'} {str(case):<52} {jnp.dtype(dtype).name:<8} "
                      f"{name:<3} max err {err:.2e}", flush=True)
    return ok


def _time(fn, args, repeats=10):
    out = fn(*args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def check_speed(batch, seq, heads, kv_heads, d_qk, d_v):
    import importlib.util
    import os

    spec_path = os.path.join(os.path.dirname(__file__), "mosaic_tpu.py")
    loader = importlib.util.spec_from_file_location("mosaic_tpu", spec_path)
    helpers = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(helpers)
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, d_qk), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, d_qk), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, d_v), jnp.bfloat16)
    flops_fwd = 2 * batch * heads * seq * seq * (d_qk + d_v) / 2  # causal: half the pairs
    tokens = Tokens(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)))
    print(f"\nspeed, one chip: B={batch} S={seq} H={heads} Hkv={kv_heads} D={d_qk}/{d_v} "
          "bf16 causal (median of 10)")
    for name in ("mosaic", "xla", "splash"):
        if name == "splash":
            bwd = jax.jit(helpers.splash_fn(heads, seq))
            fwd = None
        else:
            module = kernels.get(name)
            fwd = jax.jit(lambda q, k, v, m=module: m.attention(
                q, k, v, tokens, tokens, Options(MaskSpec.make(True), d_qk**-0.5, m))[0])
            bwd = jax.jit(helpers.kernel_fn(name))
        line = f"{name:<7}"
        if fwd is not None:
            seconds = _time(fwd, (q, k, v))
            line += f" fwd {seconds * 1e3:8.2f} ms {flops_fwd / seconds / 1e12:6.1f} TFLOP/s"
        seconds = _time(bwd, (q, k, v))
        tflops = 3.5 * flops_fwd / seconds / 1e12  # backward = 2.5 forwards (recompute)
        line += f"   fwd+bwd {seconds * 1e3:8.2f} ms {tflops:6.1f} TFLOP/s"
        print(line, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--v-head-dim", type=int, default=None)
    args = parser.parse_args(argv)
    if jax.default_backend() != "tpu":
        sys.exit(f"needs a TPU; this host's backend is {jax.default_backend()!r}.")
    print(f"{jax.devices()[0].device_kind}: correctness of kernel='mosaic' vs the reference")
    ok = check_correctness()
    if not ok:
        sys.exit("correctness FAILED; no timing.")
    check_speed(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim,
                args.v_head_dim or args.head_dim)


if __name__ == "__main__":
    main()
