"""Shims over the JAX API that moved between the releases we support (0.7 - 0.11)."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["match_varying", "shape_struct", "varying_axes"]


def varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes along which ``x`` varies inside ``shard_map``."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


# Any: ``tree`` and ``like`` are pytrees (an array, a tuple, Tokens), which JAX types as
# Any; a TypeVar would say "same structure back" but the docs cannot link a private one.
def match_varying(tree: Any, like: Any) -> Any:
    """Mark every array of ``tree`` as varying along every axis an array of ``like`` does.

    ``tree`` and ``like`` are pytrees of arrays (one array, a tuple, tokens);
    ``tree`` comes back with the same structure.

    Scan carries inside ``shard_map`` must keep one varying-axes type; fresh
    constants (zeros, -inf) are replicated until marked.
    """

    axes = frozenset().union(*map(varying_axes, jax.tree.leaves(like)))

    def mark(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pvary"):
            return jax.lax.pvary(x, missing)
        return jax.lax.pcast(x, missing, to="varying")

    return jax.tree.map(mark, tree)


def shape_struct(shape: tuple[int, ...], dtype: jax.typing.DTypeLike,
                 like: jax.Array) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` that varies over the mesh axes ``like`` varies over.

    ``pallas_call`` inside ``shard_map`` must declare how its outputs vary.
    """
    aval = jax.typeof(like)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        # JAX before manual_axis_type took vma=; this JAX's signature has no vma.
        return jax.ShapeDtypeStruct(shape, dtype, vma=vma)  # type: ignore[call-arg]
    return jax.ShapeDtypeStruct(shape, dtype)
