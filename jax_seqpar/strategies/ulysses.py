"""Ulysses attention: all-to-all from sequence shards to head shards and back.

Paper: Jacobs et al., DeepSpeed Ulysses, arXiv:2309.14509.

``[B, S/P, H, D] -all_to_all-> [B, S, H/P, D]``: each device then attends over
the whole sequence for H/P heads, and a second all-to-all returns the output to
sequence shards. Balanced by construction (every device has the same work for
any mask). When ``Hkv`` is not a multiple of P, K/V heads are replicated just
enough (``P / gcd(Hkv, P)`` times) for every device to hold the K/V heads of its
query heads. The backward is JAX autodiff (an all-to-all transposes to one).
"""

from __future__ import annotations

import math

import jax

from jax_seqpar.strategies.inputs import axis_size, prepare
from jax_seqpar.core.merge import with_sinks


def kv_replication(num_heads: int, num_kv_heads: int, num_shards: int) -> int:
    """How many times Ulysses repeats each K/V head so ``num_shards`` devices split them.

    Raises ``ValueError`` when the query heads cannot be split over the shards.
    """
    if num_heads % num_shards:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by the ulysses axis size {num_shards}; "
            'use strategy="ring" or "hybrid" (Ulysses over a smaller inner axis).')
    return num_shards // math.gcd(num_kv_heads, num_shards)


def seq_to_heads(x, axis_name):
    """``[B, S/P, h, D] -> [B, S, h/P, D]`` (all-to-all over ``axis_name``)."""
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x, axis_name):
    """``[B, S, h/P, D] -> [B, S/P, h, D]`` (all-to-all over ``axis_name``)."""
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def gather_tokens(tokens, axis_name):
    """``[B, S/P]`` metadata of the local tokens (a :class:`~jax_seqpar.core.masks.Tokens` or a
    tree of them) -> ``[B, S]`` of the whole sequence; an array that appears more than
    once (query and key positions) is gathered once."""
    gathered = {}

    def gather(x):
        if id(x) not in gathered:
            gathered[id(x)] = jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
        return gathered[id(x)]

    return jax.tree.map(gather, tokens)


def local_heads(x, axis_name):
    """This device's slice of a per-head ``[H]`` array after :func:`seq_to_heads`: ``[H/P]``."""
    if x is None:
        return None
    size = x.shape[0] // axis_size(axis_name)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * size, size)


def ulysses_attention(q, k, v, *, seq_axes, causal=False, segment_ids=None, positions=None,
                      window=None, scale=None, kernel="auto", block_sizes=None, softcap=None,
                      sinks=None, kv_segment_ids=None, return_lse=False):
    """Exact attention of a sequence sharded over ``seq_axes`` (call inside ``shard_map``).

    Args:
      q: ``[B, S/P, H, Dqk]``; k: ``[B, S/P, Hkv, Dqk]``; v: ``[B, S/P, Hkv, Dv]``
        this device's shard. ``H`` must be divisible by P.
      seq_axes: mesh axis (or tuple of axes) along which the sequence is split.
      causal, window, segment_ids, positions, scale, kernel, block_sizes, softcap,
        sinks, kv_segment_ids, return_lse: as in :func:`jax_seqpar.strategies.ring.ring_attention`
        (``sinks`` replicated).

    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype`` (softmax statistics in float32).

    >>> out = jax.shard_map(functools.partial(ulysses_attention, seq_axes="sp"),
    ...                     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
    """
    q_tokens, kv_tokens, options = prepare(
        q, k, v, axis_name=seq_axes, causal=causal, segment_ids=segment_ids,
        positions=positions, window=window, scale=scale, kernel=kernel,
        block_sizes=block_sizes, softcap=softcap, sinks=sinks, kv_segment_ids=kv_segment_ids)
    repeats = kv_replication(q.shape[2], k.shape[2], axis_size(seq_axes))
    if repeats > 1:
        k, v = (x.repeat(repeats, axis=2) for x in (k, v))  # [B, S/P, Hkv*r, D]
    q, k, v = (seq_to_heads(x, seq_axes) for x in (q, k, v))  # [B, S, h/P, D]
    q_tokens, kv_tokens = gather_tokens((q_tokens, kv_tokens), seq_axes)  # [B, S]
    out, lse = options.attention(q, k, v, q_tokens, kv_tokens)  # [B, S, H/P, Dv] float32
    out, lse = with_sinks(out, lse, local_heads(sinks, seq_axes))
    out = heads_to_seq(out.astype(q.dtype), seq_axes)  # [B, S/P, H, Dv]
    return (out, heads_to_seq(lse[..., None], seq_axes)[..., 0]) if return_lse else out
