"""How Ulysses splits heads over devices, and its exchange into pipelined pieces.

The all-to-all gives each of P devices ``H/P`` query heads; K/V heads are replicated
just enough (:func:`kv_replication`) for every device to hold the K/V heads of its
query heads. The exchange is pipelined (``overlap="auto"``) along the sequence where
each device holds enough tokens (:mod:`jax_seqpar.strategies.seq_pipeline`, and the
hybrid's :mod:`jax_seqpar.strategies.ring_pieces`: :func:`piece_counts`,
:func:`piece_sizes`, :func:`default_pieces`), else over head groups
(:mod:`jax_seqpar.strategies.head_pipeline`: :func:`head_group_counts`,
:func:`default_head_groups`). :func:`resolve_pieces` reads the call's ``overlap``,
``pieces`` and ``head_groups`` with these rules, which the planner's
:attr:`~jax_seqpar.strategies.entry.Strategy.pieces` shares.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from jax_seqpar.strategies.inputs import axis_size

__all__ = ["piece_counts", "piece_sizes", "default_pieces", "default_head_groups",
           "head_group_counts", "held_max_logit", "kv_replication", "local_head_counts",
           "local_heads", "MAX_AUTO_PIECES", "MAX_AUTO_HEAD_GROUPS", "MAX_PIECES",
           "MIN_PIECE_TOKENS", "resolve_head_groups", "resolve_pieces"]

#: ``head_groups="auto"`` takes at most this many groups: 4 hide three quarters of the
#: groups' traffic; every further group is one more kernel call and two more collectives
#: (latency) for less and less.
MAX_AUTO_HEAD_GROUPS = 4
#: ``pieces="auto"`` takes at most this many sequence pieces: they leave ``1/2^(c-1)`` of
#: the bytes exposed (5: 6.25 %); every further chunk doubles the K/V pieces (a kernel
#: call each, forward and backward) for half as much again.
MAX_AUTO_PIECES = 5
#: ``pieces="auto"`` keeps the smallest chunk at this many tokens after the all-to-all
#: (``P`` devices' share of it): whole kernel tiles.
MIN_PIECE_TOKENS = 128
#: The most pieces a call takes when forced, ``2^(c-1)`` K/V pieces, a kernel call each.
MAX_PIECES = 6


def kv_replication(num_heads: int, num_kv_heads: int, num_shards: int) -> int:
    """How many times Ulysses repeats each K/V head so ``num_shards`` devices split them.

    Raises ``ValueError`` when the query heads cannot be split over the shards.
    """
    if num_heads % num_shards:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by the ulysses axis size {num_shards}; "
            'use strategy="ring" or "hybrid" (Ulysses over a smaller inner axis).')
    return num_shards // math.gcd(num_kv_heads, num_shards)


def local_head_counts(num_heads: int, num_kv_heads: int, num_shards: int) -> tuple[int, int]:
    """``(query heads, K/V heads)`` a device holds after :func:`~jax_seqpar.strategies.head_pipeline.seq_to_heads` (K/V heads
    replicated by :func:`kv_replication`)."""
    repeats = kv_replication(num_heads, num_kv_heads, num_shards)
    return num_heads // num_shards, num_kv_heads * repeats // num_shards


def head_group_counts(num_heads: int, num_kv_heads: int, num_shards: int) -> tuple[int, ...]:
    """Every head-group count :func:`~jax_seqpar.strategies.ulysses.ulysses_attention` takes for these heads.

    A count ``G`` divides the ``H/P`` local query heads, and keeps GQA groups whole:
    either every group gets whole K/V heads (``G`` divides the local K/V heads) or every
    K/V head serves whole groups (the local K/V heads divide ``G``; the K/V then travel
    once, ahead of the first group).

    >>> head_group_counts(16, 4, 8)  # 2 query heads, 1 K/V head per device
    (1, 2)
    >>> head_group_counts(32, 8, 4)  # 8 query heads, 2 K/V heads per device
    (1, 2, 4, 8)
    """
    q_local, kv_local = local_head_counts(num_heads, num_kv_heads, num_shards)
    return tuple(g for g in range(1, q_local + 1)
                 if q_local % g == 0 and (kv_local % g == 0 or g % kv_local == 0))


def default_head_groups(num_heads: int, num_kv_heads: int, num_shards: int, *,
                        shared_kv: bool = True) -> int:
    """What ``head_groups="auto"`` takes: the largest count of :func:`head_group_counts`
    up to :data:`MAX_AUTO_HEAD_GROUPS` (``shared_kv=False``: only counts that give every
    group its own K/V heads, for the hybrid, whose ring would otherwise rotate the shared
    K/V once per group)."""
    q_local, kv_local = local_head_counts(num_heads, num_kv_heads, num_shards)
    return max(g for g in head_group_counts(num_heads, num_kv_heads, num_shards)
               if g <= MAX_AUTO_HEAD_GROUPS and (shared_kv or kv_local % g == 0))


def resolve_head_groups(head_groups: int | Literal['auto'], num_heads: int, num_kv_heads: int,
                        num_shards: int, *, shared_kv: bool = True) -> int:
    """``head_groups`` checked against the heads (``"auto"``: :func:`default_head_groups`)."""
    if head_groups == "auto":
        return default_head_groups(num_heads, num_kv_heads, num_shards, shared_kv=shared_kv)
    allowed = head_group_counts(num_heads, num_kv_heads, num_shards)
    if isinstance(head_groups, bool) or head_groups not in allowed:
        q_local, kv_local = local_head_counts(num_heads, num_kv_heads, num_shards)
        raise ValueError(
            f"head_groups={head_groups!r} does not split the {q_local} query heads and "
            f"{kv_local} K/V head(s) a device holds after the all-to-all (num_heads="
            f"{num_heads}, num_kv_heads={num_kv_heads} over {num_shards} devices) into whole "
            f"GQA groups; it takes one of {allowed} or 'auto'.")
    return int(head_groups)


def local_heads(x: jax.Array | None, axis_name: str | tuple[str, ...]) -> jax.Array | None:
    """This device's slice of a per-head ``[H]`` array after :func:`~jax_seqpar.strategies.head_pipeline.seq_to_heads`: ``[H/P]``."""
    if x is None:
        return None
    size = x.shape[0] // axis_size(axis_name)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * size, size)


def held_max_logit(rows: list[jax.Array], axis_name: str | tuple[str, ...],
                   shape: tuple[int, ...], *, groups: bool = False) -> jax.Array:
    """The row max logits ``rows`` of the heads this device holds after
    :func:`~jax_seqpar.strategies.head_pipeline.seq_to_heads` (:func:`local_heads`' slice)
    as rows of its sequence shard ``q [B, L, H, .]`` (``shape``: ``q.shape[:3]``).

    Args:
      rows: float32 ``[B, S_j, h_j]`` each: query pieces of its ``h = H/P`` heads, or with
        ``groups`` its consecutive head groups in order (``h_j = h/G``).
    Returns:
      ``float32[B, L, H]``, every row the heads' maxima at those heads and ``-inf`` at the
      others: the max over every row of every device is each head's max logit, and no
      byte travels for it (the Ulysses pipelines send the output back, not these rows).
    """
    by_head = [x.max(axis=(0, 1)) for x in rows]  # [h] each (pieces) or [h/G] (groups)
    local = jnp.concatenate(by_head) if groups else jnp.max(jnp.stack(by_head), axis=0)
    full = jnp.full(shape[2:3], -jnp.inf, jnp.float32)
    start = jax.lax.axis_index(axis_name) * local.shape[0]
    return jnp.broadcast_to(jax.lax.dynamic_update_slice_in_dim(full, local, start, 0),
                            shape[:3])


def piece_sizes(local_len: int, pieces: int) -> tuple[int, ...]:
    """Local tokens of each query piece of the sequence-chunk pipeline
    (:mod:`jax_seqpar.strategies.seq_pipeline`) with ``pieces = c``: ``u = L/2^(c-1)``
    first (it meets the K/V pieces, ``2^(c-1)`` of ``u`` tokens each, while they arrive),
    then halving, ``L/2, L/4, ..., 2u, u``, with any piece over ``L/4`` cut into
    ``floor(piece / (L/4))`` near-equal pieces (each piece attends to every key in one
    kernel call while the next comes in and the previous output leaves: the largest
    piece's float32 result is about a quarter of the sequence's). The first query and K/V
    pieces and the last output piece are exposed: ``1/2^(c-1)`` of the bytes. The sizes
    sum to ``L`` for every count of :func:`piece_counts` (``L/4`` need not be whole).

    >>> piece_sizes(2048, 5)
    (128, 512, 512, 512, 256, 128)
    >>> piece_sizes(126, 2)
    (63, 32, 31)
    """
    if pieces == 1:
        return (local_len,)
    unit, cap = local_len // 2 ** (pieces - 1), max(local_len // 4, 1)
    halving = [unit * 2 ** i for i in reversed(range(pieces - 1))]
    return (unit, *(piece for s in halving for piece in _near_equal(s, max(s // cap, 1))))


def _near_equal(total: int, count: int) -> tuple[int, ...]:
    """``total`` cut into ``count`` whole pieces, the larger first, differing by at most 1."""
    return tuple(total // count + (i < total % count) for i in range(count))


def piece_counts(local_len: int) -> tuple[int, ...]:
    """Every chunk count ``c`` a device's ``local_len`` tokens allow: ``2^(c-1)`` divides
    them, up to :data:`MAX_PIECES`.

    >>> piece_counts(24)
    (1, 2, 3, 4)
    """
    return tuple(c for c in range(1, MAX_PIECES + 1) if local_len % 2 ** (c - 1) == 0)


def default_pieces(local_len: int, num_shards: int) -> int:
    """What ``pieces="auto"`` takes: the most pieces of :func:`piece_counts` up to
    :data:`MAX_AUTO_PIECES` whose smallest chunk brings :data:`MIN_PIECE_TOKENS` tokens
    or more (1 on a single device: nothing to exchange)."""
    if num_shards == 1:
        return 1
    return max(c for c in piece_counts(local_len) if c <= MAX_AUTO_PIECES and (
        c == 1 or num_shards * piece_sizes(local_len, c)[0] >= MIN_PIECE_TOKENS))


def resolve_pieces(overlap: bool | Literal['auto'], pieces: int | Literal['auto'],
                   head_groups: int | Literal['auto'], num_heads: int, num_kv_heads: int,
                   num_shards: int, local_len: int, *, shared_kv: bool = True
                   ) -> tuple[int, int]:
    """``(pieces, head_groups)`` of one Ulysses exchange from the call's keywords.

    ``overlap=False``: ``(1, 1)``, each exchange whole (then ``pieces`` and
    ``head_groups`` must be 1 or ``"auto"``). ``overlap="auto"`` or True:
    ``pieces="auto"`` is :func:`default_pieces` (1 with forced head groups), and
    ``head_groups="auto"`` is 1 when the sequence is cut into pieces, else
    :func:`default_head_groups`. Pieces and head groups do not combine (one of them is 1).
    Raises ``ValueError`` listing the counts that work.
    """
    if overlap not in (True, False, "auto"):
        raise ValueError(f"overlap={overlap!r} takes True, False or 'auto'.")
    if overlap is False:
        for name, value in (("pieces", pieces), ("head_groups", head_groups)):
            if value not in ("auto", 1) or isinstance(value, bool):
                raise ValueError(f"overlap=False sends each exchange whole; {name}={value!r} "
                                 f"asks for pieces: drop it or pass overlap=True.")
        return 1, 1
    allowed = piece_counts(local_len)
    if pieces == "auto":
        pieces = default_pieces(local_len, num_shards)
        if head_groups not in ("auto", 1):
            pieces = 1
    elif isinstance(pieces, bool) or pieces not in allowed:
        raise ValueError(
            f"pieces={pieces!r} does not cut the {local_len} tokens a device holds into "
            f"pieces (2^(pieces-1) must divide them); it takes one of {allowed} "
            f"or 'auto'.")
    if pieces > 1:
        if head_groups not in ("auto", 1) or isinstance(head_groups, bool):
            raise ValueError(f"pieces={pieces} with head_groups={head_groups!r}: pieces and "
                             "head groups do not combine; pass head_groups=1 (or 'auto') "
                             "or pieces=1.")
        return pieces, 1
    groups = resolve_head_groups(head_groups, num_heads, num_kv_heads, num_shards,
                                 shared_kv=shared_kv)
    return 1, groups
