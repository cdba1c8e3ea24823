"""Decoding against a KV cache sharded along the sequence.

Each device attends its new queries against its slice of the cache and returns
a partial ``(out, lse)``; the partials combine exactly with one ``pmax`` and two
``psum`` s (the tree-attention reduction, arXiv:2408.04093). Forward only.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_seqpar import layout, masks
from jax_seqpar._inputs import Options, check_qkv
from jax_seqpar.merge import check_sinks, merge_across


def decode_attention(q, k_cache, v_cache, *, axis_name, kv_length, scale=None, kernel="auto",
                     softcap=None, sinks=None):
    """Attend new queries to a sequence-sharded cache (call inside ``shard_map``).

    Args:
      q: ``[B, T, H, Dqk]`` the T newest tokens' queries, the same on every device;
        query ``t`` sits at global position ``kv_length - T + t`` and sees cache
        entries at positions ``<=`` its own (so ``T > 1`` is causal among them).
      k_cache: ``[B, C/P, Hkv, Dqk]``; v_cache: ``[B, C/P, Hkv, Dv]`` this device's
        contiguous slice of a cache of capacity ``C``.
      axis_name: the mesh axis the cache is split over.
      kv_length: ``int32[B]`` valid cache entries (from global position 0),
        including the T new tokens.
      scale: defaults to ``1/sqrt(Dqk)``; kernel: ``"auto"``, ``"xla"``, ``"pallas"``.
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
    options = Options.make(q, causal=True, window=None, scale=scale, kernel=kernel,
                           softcap=softcap)
    kv_length = kv_length.astype(jnp.int32)
    cache_positions = layout.shard_positions("contiguous", k_cache.shape[1], axis_name=axis_name)
    cache_positions = jnp.broadcast_to(cache_positions, (batch, k_cache.shape[1]))
    valid = cache_positions < kv_length[:, None]
    q_positions = kv_length[:, None] - new_tokens + jnp.arange(new_tokens, dtype=jnp.int32)[None]
    # Empty cache slots get a segment no query has.
    q_tokens = masks.Tokens(q_positions, jnp.zeros((batch, new_tokens), jnp.int32))
    kv_tokens = masks.Tokens(cache_positions, jnp.where(valid, 0, -1).astype(jnp.int32))
    out, lse = options.forward(q, k_cache, v_cache, q_tokens, kv_tokens)  # float32
    return merge_across(out, lse, axis_name, sinks).astype(q.dtype)  # [B, T, H, Dv]
