"""Plain-jnp exact attention: the oracle every test compares against.

It materializes the full ``[B, H, Sq, Sk]`` score matrix in float32, so use it
for small shapes only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jax_seqpar.core import masks

__all__ = ["attention", "max_logit"]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    segment_ids: Optional[jax.Array] = None,
    positions: Optional[jax.Array] = None,
    kv_segment_ids: Optional[jax.Array] = None,
    kv_positions: Optional[jax.Array] = None,
    window: int | tuple[int, int] | None = None,
    chunk_size: Optional[int] = None,
    bidirectional_ids: Optional[jax.Array] = None,
    kv_bidirectional_ids: Optional[jax.Array] = None,
    mask_fn: Callable | None = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[jax.Array] = None,
    return_lse: bool = False,
    return_max_logit: bool = False,
):
    """Exact softmax attention.

    Args:
      q: ``[batch, q_seq, heads, d_qk]``.
      k: ``[batch, kv_seq, kv_heads, d_qk]``; ``heads % kv_heads == 0`` (GQA/MQA).
      v: ``[batch, kv_seq, kv_heads, d_v]``.
      causal, window, chunk_size, mask_fn: see :class:`jax_seqpar.core.masks.MaskSpec`.
      bidirectional_ids: ``int32[batch, q_seq]`` (see :class:`jax_seqpar.core.masks.Tokens`);
        ``kv_bidirectional_ids`` the keys', defaulting to the queries' (self-attention).
      segment_ids, positions: ``int32[batch, q_seq]`` for the queries; positions
        default to ``arange(q_seq)``. The ``kv_`` variants default to the query
        ones (self-attention).
      scale: defaults to ``1/sqrt(d_qk)``.
      softcap: logits ``s = scale * q.k`` become ``softcap * tanh(s / softcap)``
        before masking (Gemma 2), or None.
      sinks: ``float32[heads]`` logits of one extra virtual key per head whose
        value is zero (gpt-oss): it joins every row's softmax denominator and is
        never masked. None: no sink.
      return_lse: also return the log-sum-exp ``float32[batch, q_seq, heads]``
        (including the sink).
      return_max_logit: also return ``float32[heads]``, per head the largest scaled
        logit ``scale * q.k`` (before ``softcap``) over every pair the mask lets
        through, over the batch and both sequences (sinks are no pairs); ``-inf`` for a
        head with no visible pair (QK-Clip).

    Returns:
      ``out: [batch, q_seq, heads, d_v]`` in ``q.dtype`` (then ``lse``, then the max
      logit, each when asked for). A query
      that sees no key gets zeros and ``lse = EMPTY_LSE`` (or the sink's logit).
      A query that sees a key whose value holds a non-finite number gets a NaN
      output row (its ``lse``, of q and k only, is kept); a value a query cannot
      see never reaches its row, whatever it holds (other documents' values stay out).
    """
    batch, q_seq, heads, d_qk = q.shape
    kv_seq, kv_heads = k.shape[1], k.shape[2]
    scale = d_qk**-0.5 if scale is None else scale
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(q_seq, dtype=jnp.int32), (batch, q_seq))
    if kv_positions is None:
        kv_positions = positions if kv_seq == q_seq else jnp.broadcast_to(
            jnp.arange(kv_seq, dtype=jnp.int32), (batch, kv_seq))
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    if kv_bidirectional_ids is None:
        kv_bidirectional_ids = bidirectional_ids
    if (bidirectional_ids is None) != (kv_bidirectional_ids is None):
        zeros = lambda ids, n: jnp.zeros((batch, n), jnp.int32) if ids is None else ids  # noqa
        bidirectional_ids = zeros(bidirectional_ids, q_seq)
        kv_bidirectional_ids = zeros(kv_bidirectional_ids, kv_seq)
    spec = masks.MaskSpec.make(causal, window, chunk_size, mask_fn)
    mask = masks.visible_tokens(
        spec, masks.Tokens(positions, segment_ids, bidirectional_ids),
        masks.Tokens(kv_positions, kv_segment_ids, kv_bidirectional_ids))

    # Values a query cannot see stay out of its row: P @ V would add 0 * NaN.
    bad = ~jnp.isfinite(v).all(axis=-1)  # [B, Sk, Hkv]
    v = jnp.where(bad[..., None], jnp.zeros((), v.dtype), v)
    seen = jnp.ones((batch, q_seq, kv_seq), bool) if mask is None else jnp.broadcast_to(
        mask, (batch, q_seq, kv_seq))
    sees_bad = jnp.einsum("bqk,bkh->bqh", seen.astype(jnp.float32),
                          bad.astype(jnp.float32)) > 0  # [B, Sq, Hkv]

    group = heads // kv_heads
    qg = q.astype(jnp.float32).reshape(batch, q_seq, kv_heads, group, d_qk)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) * scale
    high = s if mask is None else jnp.where(mask[:, None, None], s, -jnp.inf)
    high = high.max(axis=(0, 3, 4)).reshape(heads)  # [H]: before the cap, no sink
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if sinks is not None:  # one more key per head, always visible, value zero
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kv_heads, group, 1, 1),
                                s.shape[:-1] + (1,))
        s = jnp.concatenate([s, sink], axis=-1)
        v = jnp.concatenate([v, jnp.zeros((batch, 1) + v.shape[2:], v.dtype)], axis=1)
        if mask is not None:
            mask = jnp.concatenate([mask, jnp.ones(mask.shape[:-1] + (1,), bool)], axis=-1)
    if mask is not None:
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / jnp.where(l == 0, 1.0, l), v.astype(jnp.float32))
    o = jnp.where(sees_bad[:, :, :, None, None], jnp.nan, o)
    out = o.reshape(batch, q_seq, heads, v.shape[-1]).astype(q.dtype)
    lse = jnp.where(l == 0, masks.EMPTY_LSE, m + jnp.log(jnp.where(l == 0, 1.0, l)))
    lse = lse[..., 0].transpose(0, 3, 1, 2).reshape(batch, q_seq, heads)
    result = (out,) + ((lse,) if return_lse else ()) + ((high,) if return_max_logit else ())
    return result[0] if len(result) == 1 else result


def max_logit(q: jax.Array, k: jax.Array, v: jax.Array, **mask: Any) -> jax.Array:
    """The reference max logit: ``float32[heads]``, per head the largest ``scale * q.k``
    (before any ``softcap``) of a visible pair, ``-inf`` where a head has none
    (:func:`attention` with ``return_max_logit=True``; ``mask``: its keywords)."""
    return attention(q, k, v, return_max_logit=True, **mask)[-1]
