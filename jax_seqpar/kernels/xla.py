"""Blockwise flash attention in plain jnp: the portable (CPU default) kernel.

Queries are cut into blocks of ``block_q`` tokens and keys into blocks of
``block_k``; every (query block, key block) pair is classified from the token
metadata (:func:`jax_seqpar.masks.classify`) and is skipped when ``EMPTY``,
computed without a mask when ``FULL``, and masked when ``PARTIAL``. Scores,
softmax statistics and accumulators are float32 whatever the input dtype.

The kernel contract, shared with :mod:`jax_seqpar.kernels.pallas`:

* :func:`forward` -> ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])``;
* :func:`backward` takes the (final) ``lse`` and ``delta = sum(dout * out, -1)
  - dlse`` and returns float32 ``(dq, dk, dv)``; strategies that merge partial
  results (the ring) call it with the statistics of the merged result;
* :func:`attention` is both, wired as a ``custom_vjp`` that accepts cotangents
  for ``out`` AND ``lse``, so any composition of merges differentiates exactly.

GQA/MQA (``H % Hkv == 0``) are computed group-wise without repeating K/V.
A query row that sees no key gets zeros and ``lse = EMPTY_LSE``.
Paper: FlashAttention-2, arXiv:2307.08691.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_seqpar import _compat, masks
from jax_seqpar.kernels.tiling import Tiling, pad_seq, padded_tokens
from jax_seqpar.masks import MaskSpec, Tokens

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (clipped to the sequence length; ragged tails are padded).

    Attributes:
      block_q: query tokens per tile.
      block_k: key/value tokens per tile.
    """

    block_q: int = 256
    block_k: int = 256

    def __post_init__(self):
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"block sizes must be positive. Got {self}.")


def _tiling(q, k, block_sizes: BlockSizes) -> Tiling:
    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    return Tiling(batch, kv_heads, heads // kv_heads, q_len, kv_len,
                   min(block_sizes.block_q, q_len), min(block_sizes.block_k, kv_len))


def _tiles(x, length, block, head_shape):
    """``[B, S, *heads, *F] -> [S/block, B, *heads, block, *F]`` (padded to ``length``).

    Heads lead and tokens come right before the features, so every tile product
    is a plain batched matrix product over ``(B, *heads)``.
    """
    x = pad_seq(x, length)
    x = x.reshape(x.shape[0], length // block, block, *x.shape[2:])
    n = len(head_shape)
    perm = (1, 0, *range(3, 3 + n), 2, *range(3 + n, x.ndim))
    return x.transpose(perm)


def _untile(x, length, head_shape):
    """Inverse of :func:`_tiles`: ``[n, B, *heads, block, *F] -> [B, length, *heads, *F]``."""
    n = len(head_shape)
    perm = (1, 0, 2 + n, *range(2, 2 + n), *range(3 + n, x.ndim))
    x = x.transpose(perm)
    x = x.reshape(x.shape[0], -1, *x.shape[3:])
    return x[:, :length]


def _token_tiles(tokens: Tokens, block):
    def tile(x):
        return None if x is None else jnp.moveaxis(
            x.reshape(x.shape[0], -1, block), 1, 0)  # [n, B, block]

    return tile(tokens.positions), tile(tokens.segment_ids)


def _tile_mask(spec, q_pos, q_seg, kv_pos, kv_seg):
    """``bool[B, 1, 1, bq, bk]`` for one tile pair (broadcasts over heads)."""
    mask = masks.visible(
        spec, q_pos[:, :, None], kv_pos[:, None, :],
        None if q_seg is None else q_seg[:, :, None],
        None if kv_seg is None else kv_seg[:, None, :])
    return None if mask is None else mask[:, None, None]


def _scores(q_tile, k_tile, scale):
    # [B, Hkv, G, bq, D] x [B, Hkv, bk, D] -> [B, Hkv, G, bq, bk]
    return jnp.einsum("bhgqd,bhkd->bhgqk", q_tile, k_tile, preferred_element_type=_F32) * scale


def forward(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, spec: MaskSpec, scale: float,
            block_sizes: BlockSizes = BlockSizes()):
    """Attention of ``q`` against one run of keys.

    Args:
      q: ``[B, Sq, H, Dqk]``; k: ``[B, Sk, Hkv, Dqk]``; v: ``[B, Sk, Hkv, Dv]``.
      q_tokens, kv_tokens: metadata of the queries (``[B, Sq]``) and keys (``[B, Sk]``).
      spec: causal / window; scale: score multiplier.
    Returns:
      ``out float32[B, Sq, H, Dv]`` (normalized) and ``lse float32[B, Sq, H]``.
    """
    t = _tiling(q, k, block_sizes)
    q_tokens, kv_tokens = padded_tokens(t, q_tokens, kv_tokens)
    classes = masks.classify(spec, masks.summarize(q_tokens, t.block_q),
                             masks.summarize(kv_tokens, t.block_k))  # [nq, nk]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    q_len_pad, kv_len_pad = t.num_q * t.block_q, t.num_k * t.block_k
    hg = (t.kv_heads, t.group)
    q_tiles = _tiles(q.astype(_F32).reshape(*q.shape[:2], *hg, d_qk), q_len_pad, t.block_q, hg)
    k_tiles = _tiles(k.astype(_F32), kv_len_pad, t.block_k, hg[:1])
    v_tiles = _tiles(v.astype(_F32), kv_len_pad, t.block_k, hg[:1])
    q_pos, q_seg = _token_tiles(q_tokens, t.block_q)
    kv_pos, kv_seg = _token_tiles(kv_tokens, t.block_k)

    def q_block(args):
        q_tile, qp, qs, class_row = args

        def update(carry, k_tile, v_tile, mask):
            m, l, acc = carry  # [B, Hkv, G, bq], same, [B, Hkv, G, bq, Dv]
            s = _scores(q_tile, k_tile, scale)
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p, v_tile)
            return m_new, l * alpha + p.sum(axis=-1), acc

        def kv_block(carry, xs):
            k_tile, v_tile, kp, ks, tile_class = xs
            branches = [
                lambda c: c,
                lambda c: update(c, k_tile, v_tile, _tile_mask(spec, qp, qs, kp, ks)),
                lambda c: update(c, k_tile, v_tile, None),
            ]
            return jax.lax.switch(tile_class, branches, carry), None

        stats_shape = (t.batch, t.kv_heads, t.group, t.block_q)
        init = (jnp.full(stats_shape, masks.EMPTY_LSE, _F32), jnp.zeros(stats_shape, _F32),
                jnp.zeros(stats_shape + (d_v,), _F32))
        init = _compat.match_varying(init, (q_tile, k_tiles))
        (m, l, acc), _ = jax.lax.scan(kv_block, init, (k_tiles, v_tiles, kv_pos, kv_seg, class_row))
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), masks.EMPTY_LSE)
        return out, lse  # [B, Hkv, G, bq, Dv], [B, Hkv, G, bq]

    out, lse = jax.lax.map(q_block, (q_tiles, q_pos, q_seg, classes))
    heads = t.kv_heads * t.group
    out = _untile(out, t.q_len, hg).reshape(t.batch, t.q_len, heads, d_v)
    lse = _untile(lse, t.q_len, hg).reshape(t.batch, t.q_len, heads)
    return out, lse


def backward(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, lse, delta, dout, *,
             spec: MaskSpec, scale: float, block_sizes: BlockSizes = BlockSizes()):
    """Gradients of attention given the softmax statistics of the full result.

    Args:
      q, k, v, q_tokens, kv_tokens, spec, scale: as in :func:`forward`.
      lse: ``float32[B, Sq, H]`` log-sum-exp of the (possibly merged) result.
      delta: ``float32[B, Sq, H]`` = ``sum(dout * out, -1) - dlse``.
      dout: ``[B, Sq, H, Dv]`` cotangent of the (merged) output.
    Returns:
      float32 ``dq [B, Sq, H, Dqk]``, ``dk [B, Sk, Hkv, Dqk]``, ``dv [B, Sk, Hkv, Dv]``.
    """
    t = _tiling(q, k, block_sizes)
    q_tokens, kv_tokens = padded_tokens(t, q_tokens, kv_tokens)
    classes = masks.classify(spec, masks.summarize(q_tokens, t.block_q),
                             masks.summarize(kv_tokens, t.block_k))  # [nq, nk]
    d_qk = q.shape[-1]
    q_len_pad, kv_len_pad = t.num_q * t.block_q, t.num_k * t.block_k
    hg = (t.kv_heads, t.group)
    by_group = lambda x: x.reshape(*x.shape[:2], *hg, *x.shape[3:])  # noqa: E731
    q_tiles = _tiles(by_group(q.astype(_F32)), q_len_pad, t.block_q, hg)
    do_tiles = _tiles(by_group(dout.astype(_F32)), q_len_pad, t.block_q, hg)
    lse_tiles = _tiles(by_group(lse), q_len_pad, t.block_q, hg)  # [nq, B, Hkv, G, bq]
    delta_tiles = _tiles(by_group(delta), q_len_pad, t.block_q, hg)
    k_tiles = _tiles(k.astype(_F32), kv_len_pad, t.block_k, hg[:1])
    v_tiles = _tiles(v.astype(_F32), kv_len_pad, t.block_k, hg[:1])
    q_pos, q_seg = _token_tiles(q_tokens, t.block_q)
    kv_pos, kv_seg = _token_tiles(kv_tokens, t.block_k)

    def kv_block(dq, xs):
        k_tile, v_tile, kp, ks, class_col = xs

        def grads(carry, q_tile, do_tile, lse_tile, delta_tile, mask):
            dk, dv = carry
            s = _scores(q_tile, k_tile, scale)
            p = jnp.exp(s - lse_tile[..., None])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dv = dv + jnp.einsum("bhgqk,bhgqd->bhkd", p, do_tile)
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_tile, v_tile)
            ds = p * (dp - delta_tile[..., None]) * scale
            dk = dk + jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_tile)
            dq_tile = jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_tile)
            return (dk, dv), dq_tile

        def q_block(carry, xs):
            q_tile, do_tile, lse_tile, delta_tile, qp, qs, tile_class = xs
            branches = [
                lambda c: (c, _compat.match_varying(jnp.zeros_like(q_tile), (q_tile, k_tile))),
                lambda c: grads(c, q_tile, do_tile, lse_tile, delta_tile,
                                _tile_mask(spec, qp, qs, kp, ks)),
                lambda c: grads(c, q_tile, do_tile, lse_tile, delta_tile, None),
            ]
            return jax.lax.switch(tile_class, branches, carry)

        init = _compat.match_varying((jnp.zeros_like(k_tile), jnp.zeros_like(v_tile)),
                                     (q_tiles, k_tile))
        (dk, dv), dq_tiles = jax.lax.scan(
            q_block, init, (q_tiles, do_tiles, lse_tiles, delta_tiles, q_pos, q_seg, class_col))
        return dq + dq_tiles, (dk, dv)

    dq_init = _compat.match_varying(jnp.zeros_like(q_tiles), (q_tiles, k_tiles))
    dq, (dk, dv) = jax.lax.scan(kv_block, dq_init,
                                (k_tiles, v_tiles, kv_pos, kv_seg, classes.T))
    heads = t.kv_heads * t.group
    dq = _untile(dq, t.q_len, hg).reshape(t.batch, t.q_len, heads, d_qk)
    return dq, _untile(dk, t.kv_len, hg[:1]), _untile(dv, t.kv_len, hg[:1])


def attention(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, spec: MaskSpec, scale: float,
              block_sizes: BlockSizes = BlockSizes()):
    """Differentiable :func:`forward`: ``(out float32, lse float32)``.

    The backward accepts cotangents for both ``out`` and ``lse``.
    """
    return _attention(spec, float(scale), block_sizes, q, k, v, q_tokens, kv_tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(spec, scale, block_sizes, q, k, v, q_tokens, kv_tokens):
    return forward(q, k, v, q_tokens, kv_tokens, spec=spec, scale=scale, block_sizes=block_sizes)


def _attention_fwd(spec, scale, block_sizes, q, k, v, q_tokens, kv_tokens):
    out, lse = _attention(spec, scale, block_sizes, q, k, v, q_tokens, kv_tokens)
    return (out, lse), (q, k, v, q_tokens, kv_tokens, out, lse)


def _attention_bwd(spec, scale, block_sizes, residuals, cotangents):
    q, k, v, q_tokens, kv_tokens, out, lse = residuals
    dout, dlse = cotangents
    delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(_F32), out) - dlse
    dq, dk, dv = backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout,
                          spec=spec, scale=scale, block_sizes=block_sizes)
    no_grad = jax.tree.map(lambda _: None, (q_tokens, kv_tokens))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad)


_attention.defvjp(_attention_fwd, _attention_bwd)
