"""The precision a call computes in (:class:`Compute`) and its numbers: per-block scaled
FP8 (:func:`quantize`), the Hadamard rotation that spreads outliers (:func:`rotation`).

``compute_dtype=`` of every entry point is a dtype (``jnp.float8_e4m3fn``,
``jnp.bfloat16``, ...) or a :class:`Compute`; :func:`compute` reads either. Q·Kᵀ and
P·V take their operands in it; the softmax, the lse, every carry and every partial sum
that crosses devices stay float32, and inputs, outputs and gradients keep the inputs'
dtype.

FP8 (``float8_e4m3fn``, ``float8_e5m2``) is scaled per block: q, k, v (and dout) one
float32 scale per token and head (:func:`quantize`), the probabilities and the score
gradients one per head and kernel tile, each ``amax / finfo.max`` of the block's finite
entries, so each block uses the format's whole range (FlashAttention-3,
arXiv:2407.08608, scales per tile; TransformerEngine's per-block recipes). Paper for the rotation:
QuaRot, arXiv:2404.00456 (a random orthogonal Hadamard transform leaves ``q.kᵀ``
unchanged and spreads a few large entries over the head dimension).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["COMPUTE_DTYPES", "FP8_DTYPES", "SCALE_BYTES", "Compute", "ComputeLike", "compute",
           "decode", "dequantize", "encode", "is_fp8", "quantize", "rotate", "rotation", "scaled",
           "wire_dtype"]

#: Bytes of the float32 scale that travels with each FP8 row (one token's head of K or V,
#: ``D`` values) in :func:`encode`.
SCALE_BYTES = 4
#: The FP8 formats a call computes in.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
#: Every dtype ``compute_dtype=`` takes.
COMPUTE_DTYPES = ("float32", "bfloat16", "float16") + FP8_DTYPES


def is_fp8(dtype_name: Optional[str]) -> bool:
    """Whether ``dtype_name`` (a :attr:`Compute.dtype`) is an FP8 format."""
    return dtype_name in FP8_DTYPES


@dataclasses.dataclass(frozen=True)
class Compute:
    """The precision of a call's matrix products (hashable: part of its static options).

    Attributes:
      dtype: the forward's Q·Kᵀ and P·V operands (a name of :data:`COMPUTE_DTYPES`).
      backward_dtype: the backward's four products (dP, dV, dK, dQ); None: ``dtype``.
        The backward recomputes the forward's scores in ``dtype`` whatever it is, so its
        probabilities are the forward's.
      hadamard: rotate q and k by one random orthogonal Hadamard matrix along the head
        dimension before they are quantized (FP8 only: in a wider dtype it changes
        nothing but the rounding). None (the default): True for an FP8 ``dtype``.
    """

    # Any dtype-like when made, its name after (``__post_init__``).
    dtype: Any
    backward_dtype: Any = None
    hadamard: Optional[bool] = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtype_name("compute_dtype", self.dtype))
        if self.backward_dtype is not None:
            object.__setattr__(self, "backward_dtype",
                               _dtype_name("backward_dtype", self.backward_dtype))
        if self.hadamard is None:
            object.__setattr__(self, "hadamard", is_fp8(self.dtype))
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"Compute.hadamard must be a bool. Got {self.hadamard!r}.")
        if self.hadamard and not is_fp8(self.dtype):
            raise ValueError(
                f"Compute(hadamard=True) rotates q and k before FP8 quantization; with "
                f"dtype={self.dtype} there is no quantization to protect. Pass an FP8 dtype "
                f"({', '.join(FP8_DTYPES)}) or hadamard=False.")

    @property
    def backward(self) -> str:
        """The backward's product dtype."""
        return self.backward_dtype or self.dtype

    @property
    def quantizes(self) -> bool:
        """Whether the forward or the backward computes in FP8 (scaled per block)."""
        return is_fp8(self.dtype) or is_fp8(self.backward)


#: What ``compute_dtype=`` takes: None (the inputs' dtype), a dtype or its name, or a
#: :class:`Compute`.
ComputeLike = Union[None, str, jax.typing.DTypeLike, Compute]


def _dtype_name(name: str, value) -> str:
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in COMPUTE_DTYPES:
        raise ValueError(f"{name}={value!r} is not a compute dtype: pass one of "
                         f"{', '.join(COMPUTE_DTYPES)} (a jnp dtype or its name), or None "
                         "for the inputs' dtype.")
    return dtype.name


def compute(value: ComputeLike, input_dtype: jax.typing.DTypeLike) -> Optional[Compute]:
    """``compute_dtype=`` as a :class:`Compute`, or None where it is the inputs' own
    dtype in both passes with no rotation (today's computation). ``ValueError`` naming a
    dtype that is not one of :data:`COMPUTE_DTYPES`."""
    if value is None:
        return None
    chosen = value if isinstance(value, Compute) else Compute(value)
    same = np.dtype(input_dtype).name
    if chosen.dtype == same and chosen.backward == same and not chosen.hadamard:
        return None
    return chosen


def scaled(x: jax.Array, dtype_name: str, axes: tuple[int, ...]):
    """``x`` scaled over ``axes`` (one scale per index of the other axes) and rounded to
    ``dtype_name``: ``(values, scales float32)`` with ``x ≈ values * scales`` (scales
    keep ``axes`` as size-1 dims). Outside FP8: ``x`` rounded, scales None.

    A scale is the largest finite magnitude over ``axes`` divided by ``finfo.max`` (1
    where all are zero); non-finite entries stay non-finite (NaN in ``float8_e4m3fn``,
    which has no inf) and reach no other entry's scale, so a value the mask hides
    changes nothing a query sees."""
    dtype = jnp.dtype(dtype_name)
    if not is_fp8(dtype_name):
        return x.astype(dtype), None
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    amax = jnp.where(finite, jnp.abs(x), 0.0).max(axis=axes, keepdims=True)
    largest = float(jnp.finfo(dtype).max)
    scales = jnp.where(amax > 0, amax / largest, 1.0)
    values = x / scales
    values = jnp.where(finite, jnp.clip(values, -largest, largest), values)
    return values.astype(dtype), scales


def quantize(x: jax.Array, dtype_name: str):
    """``x [B, S, *heads, F]`` scaled per token and head (:func:`scaled` over ``F``):
    ``(values [B, S, *heads, F] in dtype_name, scales float32[B, S, *heads])``, ``x ≈
    values * scales[..., None]``; outside FP8, ``x`` rounded and scales None.

    One scale per token (not per tile of tokens) gives every token the same numbers
    whichever call, shard or piece holds it: the backward's calls, which split the
    sequence otherwise than the forward's (Ulysses' pieces), recompute the forward's
    scores exactly, and the result does not depend on the device count."""
    values, scales = scaled(x, dtype_name, (x.ndim - 1,))
    return values, None if scales is None else scales[..., 0]


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """``values [B, S, *heads, F] * scales [B, S, *heads]`` in float32, the inverse of
    :func:`quantize`. Quantizing the result again gives back the same FP8 ``values``
    (bit for bit: the float32 products are within a few float32 ulps of the values times
    their scale, far inside half an FP8 step) and the same scales to float32 rounding
    (the largest entry is ``finfo.max`` times its scale)."""
    return values.astype(jnp.float32) * scales[..., None]


@functools.cache
def _hadamard(size: int, seed: int) -> np.ndarray:
    """``size x size`` (a power of two) orthogonal Hadamard matrix with random signs on
    its rows (Sylvester's construction over ``sqrt(size)``)."""
    matrix = np.ones((1, 1))
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size)
    return (signs[:, None] * matrix / np.sqrt(size)).astype(np.float32)


def rotation(head_dim: int, seed: int = 0) -> np.ndarray:
    """``float32[head_dim, head_dim]``: a random orthogonal Hadamard transform, block
    diagonal in blocks of the largest power of two dividing ``head_dim`` (576 = 9 x 64
    for MLA). ``(q R)(k R)ᵀ = q kᵀ``."""
    size = head_dim & -head_dim  # the largest power of two dividing it
    block = _hadamard(size, seed)
    return np.kron(np.eye(head_dim // size, dtype=np.float32), block)


def rotate(x: jax.Array) -> jax.Array:
    """``x [..., D]`` times :func:`rotation` ``(D)``, computed in float32, in ``x``'s dtype."""
    return (x.astype(jnp.float32) @ rotation(x.shape[-1])).astype(x.dtype)


def wire_dtype(compute: Optional[Compute], input_dtype: jax.typing.DTypeLike,
               backward: bool = False) -> Optional[str]:
    """The dtype q, k, v (and dout) travel in between devices for one pass of a call
    computing in ``compute``: the pass's product dtype where it is FP8 or narrower than
    the inputs' (what the kernel consumes: bf16 compute of float32 inputs sends bf16),
    else None (they travel as they are)."""
    if compute is None:
        return None
    name = compute.backward if backward else compute.dtype
    if is_fp8(name) or np.dtype(name).itemsize < np.dtype(input_dtype).itemsize:
        return name
    return None


def encode(x: jax.Array, dtype_name: Optional[str]) -> jax.Array:
    """``x [..., F]`` as it travels in ``dtype_name`` (:func:`wire_dtype`): FP8 as ONE
    ``uint8 [..., F + 4]`` array, each row's ``F`` values scaled per row (per token and
    head: :func:`quantize`) followed by the bytes of its float32 scale, so any
    collective over the leading axes moves values and scales together; another dtype:
    ``x`` cast; None: ``x``. Per-row scales make a row's numbers the same whichever
    device encodes it: the kernel that quantizes the :func:`decode`-d row again gets
    the very values that travelled."""
    if dtype_name is None:
        return x
    if not is_fp8(dtype_name):
        return x.astype(dtype_name)
    values, scales = quantize(x, dtype_name)
    raw = jax.lax.bitcast_convert_type(values, jnp.uint8)
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8)  # [..., 4]
    return jnp.concatenate([raw, scale_bytes], axis=-1)


def decode(raw: jax.Array, dtype_name: Optional[str], like: jax.typing.DTypeLike) -> jax.Array:
    """Inverse of :func:`encode` ``(x, dtype_name)``: ``[..., F]`` in ``like`` (values
    times their scale; the rounding to ``like`` keeps more mantissa bits than FP8 has, so
    quantizing the result per row reproduces the FP8 values exactly)."""
    if dtype_name is None or not is_fp8(dtype_name):
        return raw.astype(like)
    values = jax.lax.bitcast_convert_type(raw[..., :-SCALE_BYTES], jnp.dtype(dtype_name))
    scales = jax.lax.bitcast_convert_type(
        raw[..., -SCALE_BYTES:], jnp.float32)  # [...]: the last axis of 4 bytes folds in
    return dequantize(values, scales).astype(like)
