"""What travels between devices where a call computes in a narrower dtype
(:attr:`~jax_seqpar.kernels.options.Options.compute`): the operands the kernels consume,
in their compute dtype, never the inputs' wider one.

* :func:`rotated`: the Hadamard rotation of q and k (``Compute.hadamard``, FP8's
  default) is applied ONCE, where a strategy starts (in the inputs' dtype, differentiable:
  the gradients rotate back through it), so the rotated K is what travels and the
  kernels take q and k as given;
* :class:`Wire`: one pass's K/V (Ulysses: q, and dout in the backward) travel
  :func:`~jax_seqpar.core.quant.encode`-d: FP8 as one ``uint8 [..., D + 4]`` array per
  operand (values and the float32 scale of each token and head), bf16 cast. They are
  :func:`~jax_seqpar.core.quant.decode`-d on arrival; the kernel quantizes the decoded
  rows again to the very values that travelled (per-token scales), at the cost of one
  elementwise pass. Partial sums (the ring's dK/dV accumulators, the all-gather's
  reduce-scatter) still travel in float32, and finished results (the output, Ulysses'
  gradients) in the inputs' dtype.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jax_seqpar.core import quant
from jax_seqpar.core.shape import dtype_of_size
from jax_seqpar.kernels.options import Options

__all__ = ["Wire", "as_bytes", "from_bytes", "packed", "rotated", "wire_bytes"]


def rotated(options: Options, q: jax.Array, k: jax.Array
            ) -> tuple[Options, jax.Array, jax.Array]:
    """``(options, q, k)`` with the call's Hadamard rotation applied to ``q [.., Dqk]``
    and ``k [.., Dqk]`` (:func:`jax_seqpar.core.quant.rotate`, in their dtype) and taken
    off ``options`` (the kernels must not rotate again); as given without one."""
    compute = options.compute
    if compute is None or not compute.hadamard:
        return options, q, k
    done = dataclasses.replace(compute, hadamard=False)
    return dataclasses.replace(options, compute=done), quant.rotate(q), quant.rotate(k)


@dataclasses.dataclass(frozen=True)
class Wire:
    """How one pass's operands of dtype ``like`` travel: ``dtype`` (an FP8 format or a
    narrower float, :func:`jax_seqpar.core.quant.wire_dtype`), or None: as they are."""

    dtype: Optional[str]
    like: jnp.dtype

    @classmethod
    def of(cls, compute: Optional[quant.Compute], like: jax.typing.DTypeLike,
           backward: bool = False, saved: bool = False) -> "Wire":
        """The wire of a call computing in ``compute`` (:attr:`Options.compute
        <jax_seqpar.kernels.options.Options.compute>`), its forward (or ``backward``),
        for operands of ``like``; ``saved``: what arrives is kept for the other pass too
        (or, in a backward, serves its recomputed scores), so it travels in a dtype that
        serves both passes (an FP8 forward with a bf16 backward sends them as they are)."""
        like = jnp.dtype(like)
        dtype = quant.wire_dtype(compute, like, backward)
        if saved and dtype != quant.wire_dtype(compute, like, not backward):
            dtype = None
        return cls(dtype, like)

    def encode(self, x: jax.Array) -> jax.Array:
        """``x [..., F]`` as it travels (FP8: ``uint8 [..., F + 4]``)."""
        return quant.encode(x, self.dtype)

    def decode(self, raw: jax.Array) -> jax.Array:
        """What :meth:`encode` sent, back as ``[..., F]`` in ``like``."""
        return quant.decode(raw, self.dtype, self.like)

    def decode_kv(self, block: tuple) -> tuple[jax.Array, jax.Array]:
        """``(k, v)`` of a travelling block ``(k, v, ...)`` (:meth:`decode` of each)."""
        return self.decode(block[0]), self.decode(block[1])

    def width(self, features: int) -> int:
        """The last axis of :meth:`encode` ``(x [..., features])``."""
        fp8 = self.dtype is not None and quant.is_fp8(self.dtype)
        return features + (quant.SCALE_BYTES if fp8 else 0)

    def row_bytes(self, features: int) -> float:
        """The bytes one row (a token's head) of ``features`` sends (FP8: the values and
        their scale)."""
        itemsize = jnp.dtype(self.dtype or self.like).itemsize
        return features * itemsize + self.width(features) - features


def as_bytes(x: jax.Array) -> jax.Array:
    """``x [..., D]`` as ``uint8 [..., D * itemsize]``: its bytes along the last axis (one
    buffer for arrays of several dtypes, the collectives' leading axes kept)."""
    raw = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return raw if x.dtype.itemsize == 1 else raw.reshape(*x.shape[:-1], -1)


def from_bytes(raw: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
    """Inverse of :func:`as_bytes`: ``uint8 [..., D * itemsize]`` as ``[..., D]`` in ``dtype``."""
    width = jnp.dtype(dtype).itemsize
    shaped = raw if width == 1 else raw.reshape(*raw.shape[:-1], -1, width)
    return jax.lax.bitcast_convert_type(shaped, dtype)


def packed(tree: Any) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """``tree``'s arrays (each at least 1-D) as one flat ``uint8`` buffer, and the function
    that unpacks such a buffer into ``tree``'s structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    raw = [as_bytes(x).reshape(-1) for x in leaves]
    ends = list(itertools.accumulate(r.size for r in raw))

    def unpack(buffer):
        return jax.tree.unflatten(treedef, [
            from_bytes(buffer[end - r.size:end].reshape(*x.shape[:-1], -1), x.dtype)
            for x, end, r in zip(leaves, ends, raw)])

    return jnp.concatenate(raw), unpack


def wire_bytes(compute: Optional[quant.Compute], dtype_bytes: float, rows: float,
               features: int, *, backward: bool = False, saved: bool = False) -> float:
    """The bytes model's view of :class:`Wire`: ``rows`` rows of ``features`` (K or V of
    one token and head) in the wire of ``compute`` for inputs of ``dtype_bytes`` per
    element (``compute=None``: ``rows * features * dtype_bytes``)."""
    if compute is None:
        return rows * features * dtype_bytes
    wire = Wire.of(compute, dtype_of_size(dtype_bytes), backward=backward, saved=saved)
    return rows * wire.row_bytes(features)
