"""Token orders for sequence parallelism: contiguous, zigzag and striped.

With a *contiguous* split, shard ``r`` of ``P`` holds tokens ``r*S/P .. (r+1)*S/P - 1``:
under a causal mask the last shard of a ring does ``P`` blocks of work, the first one.
The *zigzag* order cuts the sequence into ``2P`` half-shards and gives shard ``r`` half-shards ``r``
and ``2P-1-r``, so every shard does the same causal work at every ring step
(ring-flash-attention; Llama 3's context parallelism, arXiv:2407.21783). The *striped*
order (Striped Attention, arXiv:2311.09431) deals tokens round-robin (``r, r+P, ...``).

A layout is a property of the token order, applied once to a model's inputs (tokens,
positions, segment ids); attention is told the true positions. Global view (any array,
any axis): :func:`zigzag_permute`, :func:`zigzag_unpermute`, :func:`zigzag_positions`,
:func:`striped_permute`, :func:`striped_unpermute`, :func:`striped_positions`,
:func:`contiguous_positions`. Per shard, inside ``jax.shard_map``:
:func:`shard_positions`, :func:`to_zigzag` / :func:`from_zigzag` (two half-shard
``ppermute`` calls) and :func:`to_striped` / :func:`from_striped` (one ``all_to_all``).
"""

from __future__ import annotations

import typing
from typing import Hashable, Literal, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LAYOUTS", "LayoutName", "contiguous_positions", "from_striped", "from_zigzag",
           "shard_positions", "striped_permute", "striped_positions", "striped_unpermute",
           "to_striped", "to_zigzag", "zigzag_permute", "zigzag_positions", "zigzag_unpermute"]

#: A token order, what ``layout=`` names; contiguous, zigzag and striped are formulas of
#: the length and the shard count, per_document follows a batch's documents.
LayoutName = Literal["contiguous", "zigzag", "striped", "per_document"]
#: Every layout name, in the order tables list them.
LAYOUTS: tuple[str, ...] = typing.get_args(LayoutName)
#: The orders a formula gives (positions inside ``shard_map``: :func:`shard_positions`).
_FORMULA_LAYOUTS = tuple(name for name in LAYOUTS if name != "per_document")

AxisName = Union[Hashable, Sequence[Hashable]]


def _check_num_shards(num_shards: int) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int. Got {num_shards=!r}.")
    return int(num_shards)


def _check_zigzag_len(seq_len: int, num_shards: int) -> int:
    """The zigzag half-shard length ``seq_len / (2 * num_shards)``, or a ValueError."""
    num_shards = _check_num_shards(num_shards)
    num_halves = 2 * num_shards
    if seq_len % num_halves:
        padded = -(-seq_len // num_halves) * num_halves
        raise ValueError(
            f"zigzag needs seq_len divisible by 2*num_shards={num_halves}. Got {seq_len=} "
            f"with {num_shards=}; pad the sequence to {padded} (e.g. with a separate "
            f"segment id) or use the contiguous layout.")
    return seq_len // num_halves


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for an array with {ndim=}.")
    return axis % ndim


def zigzag_permute(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """Reorder ``x`` along ``axis`` from the natural order into the zigzag order.

    The sequence is cut into ``2 * num_shards`` half-shards; the result holds half-shards
    ``0, 2P-1, 1, 2P-2, ..., P-1, P``, so that splitting it contiguously into
    ``num_shards`` pieces gives shard ``r`` half-shards ``r`` and ``2P-1-r``.

    Args:
      x: any array, e.g. ``[batch, seq, heads, head_dim]`` activations or
        ``int32[batch, seq]`` token ids / segment ids; any dtype.
      num_shards: ``P``, the number of sequence shards.
      axis: the sequence axis (default 1, the ``[batch, seq, ...]`` layout).

    Returns:
      An array of the same shape and dtype as ``x``, reordered along ``axis``.

    Raises:
      ValueError: if ``x.shape[axis]`` is not divisible by ``2 * num_shards``.

    >>> zigzag_permute(jnp.arange(8), num_shards=2, axis=0)
    Array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
    """
    axis = _normalize_axis(axis, jnp.ndim(x))
    x = jnp.asarray(x)
    seq_len = x.shape[axis]
    half = _check_zigzag_len(seq_len, num_shards)
    lead, trail = x.shape[:axis], x.shape[axis + 1:]
    halves = x.reshape(*lead, 2, num_shards, half, *trail)  # [..., 2, P, S/2P, ...]
    early = halves[(slice(None),) * axis + (0,)]  # [..., P, S/2P, ...] half-shards 0..P-1
    late = jnp.flip(halves[(slice(None),) * axis + (1,)], axis=axis)  # half-shards 2P-1..P
    paired = jnp.stack([early, late], axis=axis + 1)  # [..., P, 2, S/2P, ...]
    return paired.reshape(x.shape)


def zigzag_unpermute(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """Inverse of :func:`zigzag_permute`: zigzag order back to the natural order.

    Args:
      x: any array whose ``axis`` is in zigzag order (e.g. the gathered output of
        a zigzag-sharded model, ``[batch, seq, heads, head_dim]``).
      num_shards: ``P``, the number of sequence shards used for the permutation.
      axis: the sequence axis (default 1).

    Returns:
      An array of the same shape and dtype as ``x`` in the natural token order.

    Raises:
      ValueError: if ``x.shape[axis]`` is not divisible by ``2 * num_shards``.

    >>> x = jnp.arange(8)
    >>> bool((zigzag_unpermute(zigzag_permute(x, 2, axis=0), 2, axis=0) == x).all())
    True
    """
    axis = _normalize_axis(axis, jnp.ndim(x))
    x = jnp.asarray(x)
    seq_len = x.shape[axis]
    half = _check_zigzag_len(seq_len, num_shards)
    lead, trail = x.shape[:axis], x.shape[axis + 1:]
    paired = x.reshape(*lead, num_shards, 2, half, *trail)  # [..., P, 2, S/2P, ...]
    early = paired[(slice(None),) * (axis + 1) + (0,)]  # [..., P, S/2P, ...]
    late = jnp.flip(paired[(slice(None),) * (axis + 1) + (1,)], axis=axis)
    halves = jnp.stack([early, late], axis=axis)  # [..., 2, P, S/2P, ...]
    return halves.reshape(x.shape)


def zigzag_positions(seq_len: int, num_shards: int) -> jax.Array:
    """Global position of every token of a zigzag-ordered sequence.

    Args:
      seq_len: ``S``, the full sequence length (divisible by ``2 * num_shards``).
      num_shards: ``P``, the number of sequence shards.

    Returns:
      ``int32[seq_len]``, equal to ``zigzag_permute(arange(seq_len), num_shards, 0)``;
      broadcast it to ``[batch, seq]`` for the ``positions`` argument of attention.

    >>> zigzag_positions(8, num_shards=2)
    Array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
    """
    _check_zigzag_len(seq_len, num_shards)
    return zigzag_permute(jnp.arange(seq_len, dtype=jnp.int32), num_shards, axis=0)


def contiguous_positions(seq_len: int) -> jax.Array:
    """Global position of every token in the natural order: ``int32[seq_len]`` arange.

    >>> contiguous_positions(4)
    Array([0, 1, 2, 3], dtype=int32)
    """
    return jnp.arange(seq_len, dtype=jnp.int32)


def _check_layout(layout: str) -> None:
    if layout not in _FORMULA_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {_FORMULA_LAYOUTS}.")


def _check_even_local_len(local_len: int, what: str) -> int:
    if local_len % 2:
        raise ValueError(
            f"{what} needs an even local shard length (two zigzag half-shards per shard). "
            f"Got {local_len=}; make the global sequence length a multiple of "
            f"2 * (number of shards).")
    return local_len // 2


def shard_positions(layout: LayoutName, local_len: int, *, axis_name: AxisName) -> jax.Array:
    """Global positions of this shard's tokens, inside ``jax.shard_map``.

    Args:
      layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``, the sequence's order.
      local_len: ``S/P``, the number of tokens on this shard (static int).
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.

    Returns:
      ``int32[local_len]``: for ``"contiguous"``, ``r*S/P + arange(S/P)``; for
      ``"zigzag"``, the positions of half-shards ``r`` and ``2P-1-r``; for ``"striped"``,
      ``r + P*arange(S/P)`` (``r`` is this shard's index along ``axis_name``).

    Raises:
      ValueError: for an unknown layout, or an odd ``local_len`` with ``"zigzag"``.

    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))
    >>> f = lambda: shard_positions("zigzag", 4, axis_name="sp")
    >>> jax.shard_map(f, mesh=mesh, in_specs=(), out_specs=jax.P("sp"))()
    Array([0, 1, 2, 3], dtype=int32)
    """
    _check_layout(layout)
    index = jax.lax.axis_index(axis_name)
    arange = jnp.arange(local_len, dtype=jnp.int32)
    if layout == "contiguous":
        return index * local_len + arange
    if layout == "striped":
        return index + jax.lax.axis_size(axis_name) * arange
    half = _check_even_local_len(local_len, "shard_positions('zigzag')")
    num_shards = jax.lax.axis_size(axis_name)
    first = index * half + arange[:half]
    second = (2 * num_shards - 1 - index) * half + arange[:half]
    return jnp.concatenate([first, second]).astype(jnp.int32)


def _half_destination(half: int, num_shards: int) -> int:
    """The zigzag shard that holds global half ``half`` (of ``2 * num_shards``)."""
    return half if half < num_shards else 2 * num_shards - 1 - half


def _zigzag_perms(num_shards: int):
    """``ppermute`` pairs moving the even / odd contiguous half-shards to their zigzag shard.

    Shard ``r`` of a contiguous split holds half-shards ``2r`` and ``2r+1``. Each of the
    two maps ``r -> destination`` is a bijection of the shards, so each is one
    ``ppermute``.
    """
    even = [(r, _half_destination(2 * r, num_shards)) for r in range(num_shards)]
    odd = [(r, _half_destination(2 * r + 1, num_shards)) for r in range(num_shards)]
    return even, odd


def _halves(x, axis: int, what: str):
    axis = _normalize_axis(axis, jnp.ndim(x))
    half = _check_even_local_len(x.shape[axis], what)
    first = jax.lax.slice_in_dim(x, 0, half, axis=axis)
    second = jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
    return axis, first, second


def to_zigzag(x: jax.Array, *, axis_name: AxisName, axis: int = 1) -> jax.Array:
    """Relayout a contiguously sharded shard into its zigzag shard, inside ``shard_map``.

    The global effect equals :func:`zigzag_permute` followed by a contiguous split,
    without gathering the sequence: each shard sends two half-shards (one
    ``ppermute`` each). Differentiable (the transpose of a ``ppermute`` is the
    inverse ``ppermute``).

    Args:
      x: this shard of a contiguously split array, e.g. ``[batch, S/P, heads, dim]``
        (any dtype); ``x.shape[axis]`` must be even.
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
      axis: the local sequence axis (default 1).

    Returns:
      This shard of the zigzag order: same shape and dtype, holding global half-shards
      ``r`` and ``2P-1-r``.

    Raises:
      ValueError: if the local sequence length is odd.

    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))
    >>> f = lambda x: to_zigzag(x, axis_name="sp", axis=0)
    >>> jax.shard_map(f, mesh=mesh, in_specs=jax.P("sp"), out_specs=jax.P("sp"))(
    ...     jnp.arange(4))
    Array([0, 1, 2, 3], dtype=int32)
    """
    axis, even_half, odd_half = _halves(x, axis, "to_zigzag")
    # [..., S/2P, ...] each: contiguous half-shards 2r and 2r+1
    num_shards = jax.lax.axis_size(axis_name)
    even_perm, odd_perm = _zigzag_perms(num_shards)
    got_even = jax.lax.ppermute(even_half, axis_name, perm=even_perm)  # [..., S/2P, ...]
    got_odd = jax.lax.ppermute(odd_half, axis_name, perm=odd_perm)  # [..., S/2P, ...]
    # Shard d holds half-shards d and 2P-1-d; the even one of them is half d iff d is even.
    even_first = jax.lax.axis_index(axis_name) % 2 == 0
    first = jnp.where(even_first, got_even, got_odd)
    second = jnp.where(even_first, got_odd, got_even)
    return jnp.concatenate([first, second], axis=axis)  # [..., S/P, ...]


def from_zigzag(x: jax.Array, *, axis_name: AxisName, axis: int = 1) -> jax.Array:
    """Inverse of :func:`to_zigzag`: a zigzag shard back to its contiguous shard.

    Args:
      x: this shard of a zigzag-ordered array (global half-shards ``r`` and ``2P-1-r``),
        e.g. ``[batch, S/P, heads, dim]``; ``x.shape[axis]`` must be even.
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
      axis: the local sequence axis (default 1).

    Returns:
      This shard of the natural order (global half-shards ``2r`` and ``2r+1``): same
      shape and dtype.

    Raises:
      ValueError: if the local sequence length is odd.

    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))
    >>> f = lambda x: from_zigzag(x, axis_name="sp", axis=0)
    >>> jax.shard_map(f, mesh=mesh, in_specs=jax.P("sp"), out_specs=jax.P("sp"))(
    ...     jnp.arange(4))
    Array([0, 1, 2, 3], dtype=int32)
    """
    axis, first, second = _halves(x, axis, "from_zigzag")  # [..., S/2P, ...] each
    num_shards = jax.lax.axis_size(axis_name)
    even_perm, odd_perm = _zigzag_perms(num_shards)
    even_first = jax.lax.axis_index(axis_name) % 2 == 0
    even_half = jnp.where(even_first, first, second)
    odd_half = jnp.where(even_first, second, first)
    inverse = lambda perm: [(dst, src) for src, dst in perm]
    got_even = jax.lax.ppermute(even_half, axis_name, perm=inverse(even_perm))
    got_odd = jax.lax.ppermute(odd_half, axis_name, perm=inverse(odd_perm))
    return jnp.concatenate([got_even, got_odd], axis=axis)  # [..., S/P, ...]


def _check_striped_len(seq_len: int, num_shards: int) -> None:
    num_shards = _check_num_shards(num_shards)
    if seq_len % num_shards:
        raise ValueError(f"striped needs seq_len divisible by num_shards={num_shards}. "
                         f"Got {seq_len=}; pad the sequence or use the contiguous layout.")


def _swap_split(x, axis: int, outer: int):
    """``[..., S, ...] -> [..., outer, S/outer, ...]`` transposed to ``[..., S/outer, outer]``."""
    lead, trail = x.shape[:axis], x.shape[axis + 1:]
    split = x.reshape(*lead, outer, x.shape[axis] // outer, *trail)
    return jnp.swapaxes(split, axis, axis + 1).reshape(x.shape)


def striped_permute(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """Reorder ``x`` along ``axis`` from the natural order into the striped order.

    Splitting the result contiguously into ``num_shards`` pieces gives shard ``r``
    the tokens ``r, r+P, r+2P, ...`` (Striped Attention, arXiv:2311.09431).

    Args:
      x: any array, e.g. ``[batch, seq, heads, head_dim]``; ``x.shape[axis]`` must be
        divisible by ``num_shards``.
      num_shards: ``P``; axis: the sequence axis (default 1).

    Returns:
      The same shape and dtype, reordered along ``axis``.

    >>> striped_permute(jnp.arange(6), num_shards=2, axis=0)
    Array([0, 2, 4, 1, 3, 5], dtype=int32)
    """
    axis = _normalize_axis(axis, jnp.ndim(x))
    x = jnp.asarray(x)
    _check_striped_len(x.shape[axis], num_shards)
    return _swap_split(x, axis, x.shape[axis] // num_shards)


def striped_unpermute(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """Inverse of :func:`striped_permute`.

    >>> striped_unpermute(jnp.array([0, 2, 4, 1, 3, 5]), num_shards=2, axis=0)
    Array([0, 1, 2, 3, 4, 5], dtype=int32)
    """
    axis = _normalize_axis(axis, jnp.ndim(x))
    x = jnp.asarray(x)
    _check_striped_len(x.shape[axis], num_shards)
    return _swap_split(x, axis, num_shards)


def striped_positions(seq_len: int, num_shards: int) -> jax.Array:
    """Global position of every token of a striped sequence: ``int32[seq_len]``.

    >>> striped_positions(6, num_shards=2)
    Array([0, 2, 4, 1, 3, 5], dtype=int32)
    """
    return striped_permute(jnp.arange(seq_len, dtype=jnp.int32), num_shards, axis=0)


def to_striped(x: jax.Array, *, axis_name: AxisName, axis: int = 1) -> jax.Array:
    """Relayout a contiguously sharded shard into its striped shard (one ``all_to_all``).

    Shard ``r`` of the contiguous split holds tokens ``r*L .. r*L+L-1``; token
    ``r*L + a*P + d`` goes to shard ``d`` (``L = S/P`` must be divisible by ``P``).

    Args:
      x: this shard, e.g. ``[batch, S/P, heads, dim]``; axis_name: the sequence
        axis (or axes); axis: the local sequence axis.

    Returns:
      This shard of the striped order (same shape and dtype).
    """
    axis = _normalize_axis(axis, jnp.ndim(x))
    num_shards, local_len = jax.lax.axis_size(axis_name), x.shape[axis]
    if local_len % num_shards:
        raise ValueError(f"to_striped needs the local length {local_len} divisible by the "
                         f"{num_shards} shards; make the sequence a multiple of "
                         f"{num_shards * num_shards}.")
    lead, trail = x.shape[:axis], x.shape[axis + 1:]
    dealt = x.reshape(*lead, local_len // num_shards, num_shards, *trail)  # [.., L/P, P, ..]
    got = jax.lax.all_to_all(dealt, axis_name, split_axis=axis + 1, concat_axis=axis,
                             tiled=True)  # [.., L, 1, ..]: from shard r, tokens a*P + d
    return got.reshape(x.shape)


def from_striped(x: jax.Array, *, axis_name: AxisName, axis: int = 1) -> jax.Array:
    """Inverse of :func:`to_striped`: a striped shard back to its contiguous shard."""
    axis = _normalize_axis(axis, jnp.ndim(x))
    local_len = x.shape[axis]
    lead, trail = x.shape[:axis], x.shape[axis + 1:]
    got = jax.lax.all_to_all(x.reshape(*lead, local_len, 1, *trail), axis_name,
                             split_axis=axis, concat_axis=axis + 1, tiled=True)
    return got.reshape(x.shape)  # [.., L/P, P, ..] -> [.., L, ..]
