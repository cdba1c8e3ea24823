"""Decoding against a KV cache sharded along the sequence.

Each device attends the new queries against its slice of the cache and returns
a partial ``(out, lse)``; the partials combine exactly with one ``pmax`` and two
``psum`` s (the tree-attention reduction, arXiv:2408.04093). Forward only.

The cache's slots may hold any positions in any order (contiguous, zigzag,
round-robin): with ``kv_positions`` every slot carries its token's global
position, the mask is computed on those, and empty slots hold
:data:`EMPTY_POSITION` (or any negative number), which no query sees.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_seqpar.core import layout, masks
from jax_seqpar.strategies.inputs import Options, check_ids, check_qkv
from jax_seqpar.core.merge import check_sinks, merge_across

#: The position of an empty cache slot: later than every query, so the causal
#: mask hides it and whole empty key blocks are skipped.
EMPTY_POSITION = 2**31 - 1


def _heads_as_tokens(options, q, k_cache, v_cache, q_positions, kv_positions):
    """The local attention with every (token, KV head) pair as a token of one KV head.

    ``[B, C/P, Hkv, D] -> [B, C/P * Hkv, 1, D]`` is a free reshape, and a pair
    sees only the pairs of its head (one segment per KV head). The kernel then
    reads the cache shard in place: with ``Hkv > 1`` heads-first tiles would make
    XLA relayout the whole shard first (a second cache-sized buffer); the cost is
    ``Hkv`` times the score arithmetic, small next to reading the cache once.

    Returns:
      ``(out float32[B, T, H, Dv], lse float32[B, T, H])``.
    """
    batch, new_tokens, heads, _ = q.shape
    slots, kv_heads = k_cache.shape[1:3]
    head = jnp.arange(kv_heads, dtype=jnp.int32)[None, None]  # [1, 1, Hkv]
    pairs = lambda positions: masks.Tokens(
        jnp.broadcast_to(positions[:, :, None], positions.shape + (kv_heads,)).reshape(
            batch, -1),
        jnp.broadcast_to(head, positions.shape + (kv_heads,)).reshape(batch, -1))
    q = q.reshape(batch, new_tokens * kv_heads, heads // kv_heads, q.shape[3])  # [B, T*Hkv, G, D]
    k_cache = k_cache.reshape(batch, slots * kv_heads, 1, k_cache.shape[3])  # [B, C/P*Hkv, 1, D]
    v_cache = v_cache.reshape(batch, slots * kv_heads, 1, v_cache.shape[3])
    out, lse = options.forward(q, k_cache, v_cache, pairs(q_positions), pairs(kv_positions))
    return out.reshape(batch, new_tokens, heads, -1), lse.reshape(batch, new_tokens, heads)


def decode_attention(q, k_cache, v_cache, *, seq_axes, kv_length, scale=None, kernel="auto",
                     kv_positions=None, window=None, block_sizes=None, softcap=None,
                     sinks=None):
    """Attend new queries to a sequence-sharded cache (call inside ``shard_map``).

    Args:
      q: ``[B, T, H, Dqk]`` the T newest tokens' queries, the same on every device;
        query ``t`` sits at global position ``kv_length - T + t`` and sees cache
        entries at positions ``<=`` its own (so ``T > 1`` is causal among them).
      k_cache: ``[B, C/P, Hkv, Dqk]``; v_cache: ``[B, C/P, Hkv, Dv]`` this device's
        slice of a cache of capacity ``C`` (any dtype; softmax in float32).
      seq_axes: the mesh axis (or tuple of axes) the cache is split over.
      kv_length: ``int32[B]`` tokens in the cache (positions ``0 .. kv_length-1``),
        including the T new tokens.
      scale: defaults to ``1/sqrt(Dqk)``; kernel: ``"auto"``, ``"xla"``, ``"pallas"``,
        ``"mosaic"``.
      kv_positions: ``int32[B, C/P]`` the global position held by each local slot
        (:data:`EMPTY_POSITION` or negative: empty). Default: the contiguous split,
        slot ``i`` of device ``r`` holds position ``r*C/P + i``.
      window: ``(left, right)`` or one int: query ``i`` sees keys ``i-left .. i``;
        key blocks wholly outside every query's window are skipped.
      block_sizes: the kernel's tile sizes, or None.
      softcap: logit soft-cap, or None; sinks: ``[H]`` sink logits (replicated), or None.

    Returns:
      ``[B, T, H, Dv]`` in ``q.dtype``, the same on every device.

    >>> f = lambda q, k, v, n: decode_attention(q, k, v, axis_name="sp", kv_length=n)
    >>> out = jax.shard_map(f, mesh=mesh, in_specs=(P(), P(None, "sp"), P(None, "sp"), P()),
    ...                     out_specs=P())(q, k_cache, v_cache, kv_length)
    """
    check_qkv(q, k_cache, v_cache)
    check_sinks(sinks, q.shape[2])
    batch, new_tokens = q.shape[:2]
    if tuple(kv_length.shape) != (batch,):
        raise ValueError(f"kv_length must have shape [batch]=({batch},). "
                         f"Got {tuple(kv_length.shape)}.")
    check_ids("kv_positions", kv_positions, batch, k_cache.shape[1])
    options = Options.make(q, causal=True, window=window, scale=scale, kernel=kernel,
                           block_sizes=block_sizes, softcap=softcap)
    kv_length = kv_length.astype(jnp.int32)
    if kv_positions is None:
        kv_positions = layout.shard_positions("contiguous", k_cache.shape[1],
                                              axis_name=seq_axes)
        kv_positions = jnp.broadcast_to(kv_positions, (batch, k_cache.shape[1]))
    kv_positions = kv_positions.astype(jnp.int32)
    # Slots at or past kv_length (stale or empty) are later than every query: the
    # causal mask hides them. Negative "empty" markers become EMPTY_POSITION too.
    hidden = (kv_positions < 0) | (kv_positions >= kv_length[:, None])
    kv_positions = jnp.where(hidden, EMPTY_POSITION, kv_positions)  # [B, C/P]
    q_positions = kv_length[:, None] - new_tokens + jnp.arange(new_tokens, dtype=jnp.int32)[None]
    if k_cache.shape[2] == 1:  # MQA / MLA: tiles are heads-first already
        out, lse = options.forward(q, k_cache, v_cache, masks.Tokens(q_positions),
                                   masks.Tokens(kv_positions))
    else:
        out, lse = _heads_as_tokens(options, q, k_cache, v_cache, q_positions, kv_positions)
    # out float32 [B, T, H, Dv], lse float32 [B, T, H]
    return merge_across(out, lse, seq_axes, sinks).astype(q.dtype)  # [B, T, H, Dv]
