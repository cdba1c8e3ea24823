"""The FP8 operands of the Pallas kernels (:mod:`jax_seqpar.kernels.gpu.pallas`,
:mod:`jax_seqpar.kernels.tpu.mosaic`), made OUTSIDE their ``pallas_call``: q, k, v (and
the backward's dout) scaled per token and head (:func:`jax_seqpar.core.quant.quantize`),
``values [B, S, H, D]`` in the FP8 format with ``scales float32[B, S, H]``, ``x ≈ values *
scales[..., None]``. The kernels take these values and scales, so operands quantized
earlier (an FP8 KV cache) could skip :func:`inputs` later.

A Pallas kernel computes in FP8 where :func:`in_kernel` holds: the call's forward dtype is
FP8 and its backward is the same format or bfloat16; other
combinations run in the XLA kernel (:mod:`jax_seqpar.kernels.xla`).

The Hadamard rotation (:attr:`jax_seqpar.core.quant.Compute.hadamard`) is the caller's
(:func:`jax_seqpar.strategies.wire.rotated`, once where a strategy starts): no kernel
rotates, and :mod:`jax_seqpar.kernels.lowering` refuses a call that still asks for it.
"""

from __future__ import annotations

import jax

from jax_seqpar.core import quant
from jax_seqpar.core.quant import Compute
from jax_seqpar.kernels.options import Options, pallas_computes

__all__ = ["cotangent", "in_kernel", "inputs"]


def in_kernel(options: Options) -> bool:
    """Whether a Pallas kernel runs ``options`` in FP8: an FP8 forward with a backward in
    the same FP8 format or in bfloat16
    (:func:`jax_seqpar.kernels.options.pallas_computes`)."""
    return pallas_computes(options.compute)


def _compute(options: Options) -> Compute:
    if options.compute is None:
        raise ValueError("the FP8 operands are made for a call with compute_dtype= (FP8).")
    return options.compute


def inputs(options: Options, q: jax.Array, k: jax.Array, v: jax.Array):
    """``((q8, k8, v8), (q_scales, k_scales, v_scales))``: ``q [B, Sq, H, Dqk]``, ``k [B,
    Sk, Hkv, Dqk]``, ``v [B, Sk, Hkv, Dv]`` in the forward's FP8 format, scaled per token and
    head (scales float32 ``[B, Sq, H]``, ``[B, Sk, Hkv]``, ``[B, Sk, Hkv]``). The backward
    calls it on the same q, k, v: its scores are the forward's."""
    dtype = _compute(options).dtype
    (q8, qs), (k8, ks), (v8, vs) = (quant.quantize(x, dtype) for x in (q, k, v))
    return (q8, k8, v8), (qs, ks, vs)


def cotangent(options: Options, dout: jax.Array):
    """``dout [B, Sq, H, Dv]`` as the backward's products take it: in an FP8 backward its
    values in that format and ``scales float32[B, Sq, H]``; in a bfloat16 one, rounded to
    bfloat16 and None."""
    dtype = _compute(options).backward
    if quant.is_fp8(dtype):
        return quant.quantize(dout, dtype)
    return dout.astype(dtype), None
