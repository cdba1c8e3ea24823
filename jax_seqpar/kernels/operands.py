"""The XLA kernel's operands in the call's compute dtype
(:attr:`jax_seqpar.kernels.options.Options.compute`): q, k, v and dout as its products take
them (:class:`Operand`: values in the compute dtype, FP8 scaled per token and head; q and
k as given: the Hadamard rotation is the strategies'), and a tile's probabilities or score gradients
rounded for their product (:func:`product`). The products take the values in the compute
dtype and accumulate in float32 (XLA:GPU compiles FP8 x FP8 or bf16 x bf16 GEMMs);
without a compute dtype every operand is taken in float32, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jax_seqpar.core import quant
from jax_seqpar.kernels.options import Options

__all__ = ["Operand", "group_scale", "operand", "product", "products", "products_dtype",
           "scored", "tile", "times"]

_F32 = jnp.float32


def tile(x: jax.Array, row: jax.typing.ArrayLike, index: jax.typing.ArrayLike,
         block: int) -> jax.Array:
    """Tile ``index`` of batch row ``row`` of ``x`` along the sequence axis 1, ``[1, block,
    ...]`` (a slice, no copy of ``x``)."""
    start = (row, index * block) + (0,) * (x.ndim - 2)
    return jax.lax.dynamic_slice(x, start, (1, block) + x.shape[2:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Operand:
    """One operand as the products take it: ``values [B, S, *heads, F]`` in the compute
    dtype (or the input's) and, in FP8, the per-token ``scales float32[B, S, *heads]``
    of their blocks (else None). ``computed``: the values are in the call's compute
    dtype, and the products take them in it (FP8 or bf16 matrix units, float32
    accumulation); else the products take them in float32."""

    values: jax.Array
    scales: Optional[jax.Array] = None
    computed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def map(self, fn: Callable[[jax.Array], jax.Array]) -> "Operand":
        return Operand(fn(self.values), None if self.scales is None else fn(self.scales),
                       self.computed)

    def tile(self, row: jax.typing.ArrayLike, index: jax.typing.ArrayLike, block: int):
        """``(values [1, *heads, block, F], scales [1, *heads, block] | None)``."""
        values = jnp.moveaxis(tile(self.values, row, index, block), 1, -2)
        values = values if self.computed else values.astype(_F32)
        if self.scales is None:
            return values, None
        return values, jnp.moveaxis(tile(self.scales, row, index, block), 1, -1)


def operand(x: jax.Array, dtype_name: str) -> Operand:
    """``x [B, S, *heads, F]`` in ``dtype_name`` (FP8: scaled per token and head,
    :func:`jax_seqpar.core.quant.quantize`)."""
    values, scales = quant.quantize(x, dtype_name)
    return Operand(values, scales, computed=True)


def product(x: jax.Array, dtype_name: Optional[str], fold: Optional[jax.Array] = None,
            over_group: bool = False):
    """A tile's float32 ``x [B, Hkv, G, bq, bk]`` (probabilities, score gradients) as a
    product's operand: times ``fold`` (the other operand's per-token scales, which vary
    along the contracted axis), then rounded to ``dtype_name`` (FP8: scaled per head and
    tile; ``over_group``: one scale for a K/V head's query group, for a product that sums
    over it). Returns ``(values in dtype_name (float32 without one), scale [B, Hkv,
    G or 1, 1, 1] | None)``."""
    if fold is not None:
        x = x * fold
    if dtype_name is None:
        return x, None
    values, scale = quant.scaled(x, dtype_name, (2, 3, 4) if over_group else (3, 4))
    return values, scale


def times(x: jax.Array, scale: Optional[jax.Array]) -> jax.Array:
    """``x`` times its product's ``scale`` (None: ``x``)."""
    return x if scale is None else x * scale


def scored(options: Options, q: jax.Array, k: jax.Array, v: jax.Array):
    """q, k and v as the forward's products take them (:class:`Operand`): in the
    call's compute dtype (:attr:`~jax_seqpar.kernels.options.Options.compute`), FP8 scaled
    per token and head; as given without a compute dtype. The backward recomputes the scores from the same operands, so its
    probabilities are the forward's."""
    compute = options.compute
    if compute is None:
        return Operand(q), Operand(k), Operand(v)
    return tuple(operand(x, compute.dtype) for x in (q, k, v))


def products_dtype(options: Options, backward: bool) -> Optional[str]:
    """The dtype probabilities (forward) or the backward's tiles are rounded to before
    their products, None without a compute dtype."""
    compute = options.compute
    if compute is None:
        return None
    return compute.backward if backward else compute.dtype


def products(options: Options, q: jax.Array, k: jax.Array, v: jax.Array, dout: jax.Array,
             scored: tuple):
    """q, k, v and dout as the backward's products take them (:class:`Operand`): in the
    backward's dtype, FP8 scaled per token and head; the forward's ``scored`` q and k
    where they are the same numbers."""
    compute = options.compute
    if compute is None:
        return tuple(Operand(x) for x in (q, k, v, dout))
    dtype = compute.backward
    if dtype == compute.dtype:
        q_b, k_b = scored
    else:
        q_b, k_b = operand(q, dtype), operand(k, dtype)
    return q_b, k_b, operand(v, dtype), operand(dout, dtype)


def group_scale(scale: Optional[jax.Array]) -> Optional[jax.Array]:
    """``[B, Hkv, 1, 1, 1]`` (one scale per K/V head's group) as ``[B, Hkv, 1, 1]`` for a
    K/V-sized product; None stays None."""
    return None if scale is None else scale[:, :, 0]
