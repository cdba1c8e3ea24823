"""Time the local attention kernels on one accelerator chip: the table of kernel speed.

On a GPU: our Pallas (Triton) kernel, cuDNN (``jax.nn.dot_product_attention(...,
implementation="cudnn")``) and our XLA kernel; on a TPU: our Mosaic kernel, JAX's splash
attention and our XLA kernel. Forward and forward+backward, bf16 (``--dtype``),
``[batch, seq, heads, head_dim]`` with ``--kv-heads`` K/V heads (GQA), non-causal and
causal; prints milliseconds (median of ``--runs`` timed calls after ``--warmup`` calls,
each ended by ``block_until_ready``), TFLOP/s and the ratio of that to the platform's
vendor kernel (cuDNN on GPU, splash on TPU; 1.0: parity, > 1: faster), and the largest
difference of the results (out, or dq/dk/dv) from the vendor kernel's (from our XLA
kernel's where it is absent).

FLOPs count the useful work only: ``4 * B * H * Sq * Sk * D`` for the forward
(``QK^T`` and ``PV``), half of it when causal, and 2.5x that for the backward
(the FlashAttention convention), so a kernel that skips masked tiles is not
credited for them.

    python experiments/kernel_bench.py                          # GPU or TPU: S = 4k, 8k, 16k
    python experiments/kernel_bench.py --seq 8192 --kv-heads 2 --head-dim 64
    python experiments/kernel_bench.py --allow-cpu --seq 256    # CPU smoke test

The table is for ``docs/benchmarks.md`` (kernel speed); no accelerator has run it yet.
Correctness on the accelerator first: ``jax-seqpar check``. On CPU the Pallas kernel runs
in the (slow) interpreter and cuDNN is absent, so the numbers only show that the script
works.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jax_seqpar import kernels
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.kernels.options import Options

CPU_MAX_SEQ = 1024
IMPLEMENTATIONS = ("pallas", "mosaic", "cudnn", "splash", "xla")
#: What each platform times by default, the vendor's kernel (the ratio's base) second.
PLATFORM_IMPLEMENTATIONS = {"gpu": ("pallas", "cudnn", "xla"),
                            "tpu": ("mosaic", "splash", "xla"), "cpu": ("pallas", "xla")}
VENDOR = {"gpu": "cudnn", "tpu": "splash"}


def _splash_fn(causal: bool, seq: int, heads: int):
    """``(q, k, v) -> out`` through JAX's splash attention (TPU; layout ``[H, S, D]`` per
    batch row, vmapped over the batch)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as splash_mask)

    mask_type = splash_mask.CausalMask if causal else splash_mask.FullMask
    mask = splash_mask.MultiHeadMask([mask_type((seq, seq)) for _ in range(heads)])

    def fn(q, k, v):
        make = (splash.make_splash_mqa_single_device if k.shape[2] == 1
                else splash.make_splash_mha_single_device)
        kernel = make(mask)
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, H, S, D]
        if k.shape[1] == 1:
            k, v = k[:, 0], v[:, 0]
        out = jax.vmap(kernel)(q * q.shape[-1] ** -0.5, k, v)
        return jnp.swapaxes(out, 1, 2).astype(q.dtype)

    return fn


def _attention_fn(impl: str, causal: bool, seq: int, batch: int, heads: int):
    """``(q, k, v) -> out`` in q.dtype for one implementation."""
    if impl == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn")
    if impl == "splash":
        return _splash_fn(causal, seq, heads)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    tokens = Tokens(positions)
    spec = MaskSpec.make(causal=causal)

    def fn(q, k, v):
        out, _ = kernels.attention(Options(spec, q.shape[-1] ** -0.5, impl),
                                   q, k, v, tokens, tokens)
        return out.astype(q.dtype)

    return fn


def _compile(impl, causal, backward, shape):
    batch, seq, heads = shape[:3]
    attend = _attention_fn(impl, causal, seq, batch, heads)
    if not backward:
        return jax.jit(attend)

    def loss(q, k, v, dout):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * dout)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _median_seconds(fn, args, warmup: int, runs: int):
    """``(median seconds of one call, the call's result)``."""
    result = None
    for _ in range(warmup):
        result = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _max_difference(result, baseline) -> float:
    """Largest absolute difference over all outputs (out, or dq, dk, dv), in float32."""
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(baseline)))


def _flops(shape, causal: bool, backward: bool) -> float:
    batch, seq, heads, dim = shape
    forward = 4.0 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return forward * (3.5 if backward else 1.0)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--runs", type=int, default=20, help="timed calls (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls after compiling")
    parser.add_argument("--impl", nargs="+", choices=IMPLEMENTATIONS, default=None,
                        help="default: pallas cudnn xla on a GPU, mosaic splash xla on a TPU")
    parser.add_argument("--allow-cpu", action="store_true",
                        help=f"smoke-test on CPU (Pallas interpreter; --seq <= {CPU_MAX_SEQ})")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    backend = jax.default_backend()
    impls = args.impl or PLATFORM_IMPLEMENTATIONS.get(backend, ("xla",))
    vendor = VENDOR.get(backend)
    if backend not in VENDOR:
        if not args.allow_cpu:
            print(f"kernel_bench needs a GPU or TPU (the default backend is {backend!r}); for "
                  "a smoke test run it with --allow-cpu --seq 256.", file=sys.stderr)
            return 2
        if max(args.seq) > CPU_MAX_SEQ:
            print(f"--seq {max(args.seq)} is too long for the CPU interpreter; use "
                  f"--seq <= {CPU_MAX_SEQ} with --allow-cpu.", file=sys.stderr)
            return 2
    print(f"backend={backend} devices={jax.devices()[0].device_kind} batch={args.batch} "
          f"heads={args.heads} kv_heads={kv_heads} head_dim={args.head_dim} dtype={args.dtype} "
          f"median of {args.runs} runs after {args.warmup} warm-up")
    print(f"{'seq':>6} {'causal':>6} {'pass':>8} {'impl':>7} {'ms':>9} {'TFLOP/s':>8} "
          f"{'vs ' + (vendor or '-'):>9} {'max|diff|':>10}")
    for seq in args.seq:
        shape = (args.batch, seq, args.heads, args.head_dim)
        kv_shape = (args.batch, seq, kv_heads, args.head_dim)
        keys = jax.random.split(jax.random.key(seq), 4)
        q, dout = (jax.random.normal(key, shape, args.dtype) for key in keys[:2])
        k, v = (jax.random.normal(key, kv_shape, args.dtype) for key in keys[2:])
        for causal in (False, True):
            for backward in (False, True):
                inputs = (q, k, v, dout.astype(jnp.float32)) if backward else (q, k, v)
                label = f"{seq:>6} {causal!s:>6} {'fwd+bwd' if backward else 'fwd':>8}"
                seconds, results = {}, {}
                for impl in impls:
                    try:
                        seconds[impl], results[impl] = _median_seconds(
                            _compile(impl, causal, backward, shape), inputs, args.warmup,
                            args.runs)
                    except Exception as error:  # e.g. cuDNN absent or shape unsupported
                        print(f"{label} {impl:>7} failed: {type(error).__name__}: "
                              f"{str(error).splitlines()[0][:100] if str(error) else ''}")
                # Results are checked against the vendor's (or our XLA kernel without it).
                baseline = results.get(vendor, results.get("xla"))
                for impl, time_s in seconds.items():
                    rate = _flops(shape, causal, backward) / time_s / 1e12
                    ratio = (f"{seconds[vendor] / time_s:9.2f}" if vendor in seconds
                             else f"{'n/a':>9}")
                    diff = _max_difference(results[impl], baseline)
                    print(f"{label} {impl:>7} {time_s * 1e3:9.3f} {rate:8.2f} {ratio} "
                          f"{diff:10.2e}")
                del results
    return 0


if __name__ == "__main__":
    sys.exit(main())
