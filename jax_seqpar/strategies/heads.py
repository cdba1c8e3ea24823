"""How Ulysses splits heads over devices and into pipelined groups.

The all-to-all gives each of P devices ``H/P`` query heads; K/V heads are replicated
just enough (:func:`kv_replication`) for every device to hold the K/V heads of its
query heads. :func:`head_group_counts` lists the head-group counts the heads allow for
:func:`jax_seqpar.strategies.head_pipeline.head_pipeline`, ``"auto"`` picks
:func:`default_head_groups`.
"""

from __future__ import annotations

import math

import jax

from jax_seqpar.strategies.inputs import axis_size

#: ``head_groups="auto"`` takes at most this many groups: 4 hide three quarters of the
#: groups' traffic; every further group is one more kernel call and two more collectives
#: (latency) for less and less.
MAX_AUTO_HEAD_GROUPS = 4


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
    """``(query heads, K/V heads)`` a device holds after :func:`seq_to_heads` (K/V heads
    replicated by :func:`kv_replication`)."""
    repeats = kv_replication(num_heads, num_kv_heads, num_shards)
    return num_heads // num_shards, num_kv_heads * repeats // num_shards


def head_group_counts(num_heads: int, num_kv_heads: int, num_shards: int) -> tuple[int, ...]:
    """Every head-group count :func:`ulysses_attention` takes for these heads.

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


def resolve_head_groups(head_groups, num_heads: int, num_kv_heads: int, num_shards: int, *,
                        shared_kv: bool = True) -> int:
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


def local_heads(x, axis_name):
    """This device's slice of a per-head ``[H]`` array after :func:`seq_to_heads`: ``[H/P]``."""
    if x is None:
        return None
    size = x.shape[0] // axis_size(axis_name)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * size, size)
