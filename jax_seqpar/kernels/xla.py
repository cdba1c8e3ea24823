"""Blockwise flash attention in plain jnp: the portable (CPU default) kernel.

Queries are cut into blocks of ``block_q`` tokens and keys into blocks of
``block_k``; every (query block, key block) pair of every batch row is classified
from the token metadata (:func:`jax_seqpar.core.blocks.classify`: ranges and segment
signatures, so packed rows skip what their own documents do not share) and is
skipped when ``EMPTY``,
computed without a mask when ``FULL``, and masked when ``PARTIAL``. Scores,
softmax statistics and accumulators are float32 whatever the input dtype.

It has the kernel contract (:mod:`jax_seqpar.kernels.contract`), shared with
:mod:`jax_seqpar.kernels.gpu.pallas` and :mod:`jax_seqpar.kernels.tpu.mosaic`:
:func:`forward` -> ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])``,
:func:`backward` (given the final ``lse`` and ``delta = sum(dout * out, -1) - dlse``)
-> float32 ``(dq, dk, dv)``, and :func:`attention`, a ``custom_vjp`` of both that
takes cotangents for ``out`` AND ``lse``. Every function takes the call's
:class:`~jax_seqpar.kernels.options.Options`: the mask, the scale, the soft-cap
(logits ``s = scale * q.k`` become ``softcap * tanh(s / softcap)`` before masking) and
any positive tile sizes (:class:`~jax_seqpar.kernels.options.BlockSizes`).

GQA/MQA (``H % Hkv == 0``) are computed group-wise without repeating K/V.
A query row that sees no key gets zeros and ``lse = EMPTY_LSE``.
Paper: FlashAttention-2, arXiv:2307.08691.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_seqpar.core import blocks, compat as _compat, masks
from jax_seqpar.kernels import contract
from jax_seqpar.kernels.contract import BlockSizes, check_softcap
from jax_seqpar.kernels.operands import (group_scale, product, products, products_dtype,
                                         scored, times)
from jax_seqpar.kernels.operands import tile as _tile
from jax_seqpar.kernels.options import Options
from jax_seqpar.kernels.tiling import Tiling, pad_seq, schedule
from jax_seqpar.core.masks import Tokens

#: The input dtypes the kernel takes, None for any float (q, k and v share one).
DTYPES = None

__all__ = ["DTYPES", "BlockSizes", "attention", "backward", "check_softcap", "default_block_sizes",
           "forward"]

_F32 = jnp.float32


def default_block_sizes(d_qk: int, d_v: int, dtype: jax.typing.DTypeLike) -> BlockSizes:
    """256 tokens everywhere, whatever the head dims and dtype.

    256 tokens keep a tile's float32 scores ([B, H, 256, 256]) in cache-sized
    pieces on CPU and skip masked work finely; the backward may use other sizes
    (it holds four score-sized temporaries per tile to the forward's two).
    """
    del d_qk, d_v, dtype
    return BlockSizes(256, 256, 256, 256)


def _checked(q, k, v, q_tokens, kv_tokens, options: Options) -> Options:
    """Validated operands; the options resolved (:meth:`~jax_seqpar.kernels.options.Options.resolved`)."""
    contract.check_operands(q, k, v, q_tokens, kv_tokens, kernel_name=__name__)
    return options.resolved(default_block_sizes(q.shape[-1], v.shape[-1], q.dtype), __name__)


def _tiling(q, k, block_q: int, block_k: int) -> Tiling:
    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    return Tiling(batch, kv_heads, heads // kv_heads, q_len, kv_len,
                  min(block_q, q_len), min(block_k, kv_len))


def _put(buffer, row, index, tile):
    """Write ``tile [1, block, ...]`` as tile ``index`` of row ``row`` of ``buffer`` (in
    place in a loop)."""
    start = (row, index * tile.shape[1]) + (0,) * (buffer.ndim - 2)
    return jax.lax.dynamic_update_slice(buffer, tile, start)


def _heads_first(x):
    """``[B, block, *heads, F] -> [B, *heads, block, F]``: tile products become batched matmuls."""
    return jnp.moveaxis(x, 1, -2).astype(_F32)


def _tokens_first(x):
    """Inverse of :func:`_heads_first`."""
    return jnp.moveaxis(x, -2, 1)


def _token_tile(tokens: Tokens, b, i, block) -> Tokens:
    """Tile ``i`` of batch row ``b`` of every metadata field: ``[1, block]`` each."""
    return jax.tree.map(lambda x: _tile(x, b, i, block), tokens)


def _varying_like(branch, like):
    """``branch`` with its result varying over the mesh axes ``like`` varies over, as
    every branch of one ``lax.switch`` must."""
    return lambda carry: _compat.match_varying(branch(carry), like)


def _tile_mask(spec, q_tile: Tokens, kv_tile: Tokens):
    """``bool[B, 1, 1, bq, bk]`` for one tile pair (broadcasts over heads)."""
    mask = masks.visible(spec, masks.rows(q_tile), masks.cols(kv_tile))
    return None if mask is None else mask[:, None, None]


def _tile_step(row, tile_class, spec, q_tile: Tokens, kv_tile: Tokens, update, carry):
    """One key tile of a query tile of batch ``row``, by its class: skipped (EMPTY),
    ``update(carry, mask)`` with its mask (PARTIAL) or without (FULL)."""
    return jax.lax.switch(tile_class, [
        lambda c: c,
        lambda c: update(c, _tile_mask(spec, q_tile, kv_tile)),
        lambda c: update(c, None),
    ], carry)


def _logits(q_tile, k_tile, options: Options, q_scale=None, k_scale=None):
    """Scaled logits ``scale * q.k`` (before any soft-cap), float32 ``[B, Hkv, G, bq, bk]``;
    ``q_scale [B, Hkv, G, bq]`` and ``k_scale [B, Hkv, bk]``: the tiles' per-token FP8
    scales (:mod:`jax_seqpar.core.quant`), or None."""
    # [B, Hkv, G, bq, D] x [B, Hkv, bk, D] -> [B, Hkv, G, bq, bk]
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_tile, k_tile,
                   preferred_element_type=_F32) * options.scale
    if q_scale is not None:
        s = s * q_scale[..., None] * k_scale[:, :, None, None, :]
    return s


def _capped(s, options: Options):
    """Logits ``s`` soft-capped, and the cap's derivative ``1 - tanh**2`` (or None)."""
    cap = options.softcap
    if cap is None:
        return s, None
    capped = jnp.tanh(s / cap)
    return cap * capped, 1.0 - capped * capped


def _scores(q_tile, k_tile, options: Options, q_scale=None, k_scale=None):
    """Scaled (and soft-capped) logits, and the cap's derivative (:func:`_logits`,
    :func:`_capped`)."""
    return _capped(_logits(q_tile, k_tile, options, q_scale, k_scale), options)


def forward(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
            options: Options, accumulate: tuple[jax.Array, jax.Array] | None = None):
    """Attention of ``q`` against one run of keys.

    Args:
      q: ``[B, Sq, H, Dqk]``; k: ``[B, Sk, Hkv, Dqk]``; v: ``[B, Sk, Hkv, Dv]``.
      q_tokens, kv_tokens: metadata of the queries (``[B, Sq]``) and keys (``[B, Sk]``).
      options: the call's :class:`~jax_seqpar.kernels.options.Options`: ``spec`` (the
        mask), ``scale``, ``softcap`` (``softcap * tanh(s / softcap)`` of the logits, or
        None) and ``block_sizes`` (any positive ints; None, or a size left None:
        :func:`default_block_sizes`).
      accumulate: optional ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])`` of
        earlier keys, merged with this call's result
        (:func:`jax_seqpar.kernels.contract.merge_accumulated`).
    Returns:
      ``out float32[B, Sq, H, Dv]`` (normalized) and ``lse float32[B, Sq, H]``; with
      ``options.return_max_logit`` also ``max_logit float32[B, Sq, H]``, each row's
      largest visible logit before the soft-cap (``-inf``: none), taken from the
      scores the kernel forms (``accumulate`` is then that triple).
    """
    options = _checked(q, k, v, q_tokens, kv_tokens, options)
    contract.check_accumulated(q, v, accumulate, options)
    return contract.merge_accumulated(
        _forward(*contract.isolated(q, k, v), q_tokens, kv_tokens, options), accumulate)


@contract.folds_vmap
def _forward(q, k, v, q_tokens, kv_tokens, options: Options):
    spec = options.spec
    t = _tiling(q, k, *options.tiles())
    q_tokens, kv_tokens, classes = schedule(spec, t, q_tokens, kv_tokens)  # [B, nq, nk]
    d_v = v.shape[-1]
    hg = (t.kv_heads, t.group)
    q_len = q.shape[1]
    q, k, v = scored(options, q, k, v)
    pv_dtype = products_dtype(options, backward=False)
    q = q.map(lambda x: pad_seq(x, t.num_q * t.block_q).reshape(
        t.batch, -1, *hg, *x.shape[3:]))  # [B, Sq, Hkv, G, D]
    k, v = (x.map(lambda a: pad_seq(a, t.num_k * t.block_k)) for x in (k, v))  # [B, Sk, Hkv, D]

    # One batch row at a time: each row skips its own EMPTY tiles (packed rows differ).
    def q_block(index, buffers):
        b, i = index // t.num_q, index % t.num_q
        q_tile, q_scale = q.tile(b, i, t.block_q)  # [1, Hkv, G, bq, D]
        qt = _token_tile(q_tokens, b, i, t.block_q)  # [1, bq] fields

        def update(k_tile, v_tile, carry, mask):
            (k_tile, k_scale), (v_tile, v_scale) = k_tile, v_tile
            m, l, acc = carry[:3]  # [1, Hkv, G, bq], same, [1, Hkv, G, bq, Dv]
            raw = _logits(q_tile, k_tile, options, q_scale, k_scale)
            s, _ = _capped(raw, options)
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
            if track:  # the max logit: before the cap, over the visible pairs
                seen = raw if mask is None else jnp.where(mask, raw, -jnp.inf)
                high = (jnp.maximum(carry[3], seen.max(axis=-1)),)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            fold = None if v_scale is None else v_scale[:, :, None, None, :]
            p_values, p_scale = product(p, pv_dtype, fold)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p_values, v_tile, preferred_element_type=_F32)
            acc = acc * alpha[..., None] + times(pv, p_scale)
            return (m_new, l * alpha + p.sum(axis=-1), acc) + (high if track else ())

        def kv_block(j, carry):
            k_tile, v_tile = (x.tile(b, j, t.block_k) for x in (k, v))
            kt = _token_tile(kv_tokens, b, j, t.block_k)
            return _tile_step(b, classes[b, i, j], spec, qt, kt,
                              functools.partial(update, k_tile, v_tile), carry)

        stats_shape = (1, *hg, t.block_q)
        init: tuple = (jnp.full(stats_shape, masks.EMPTY_LSE, _F32),
                       jnp.zeros(stats_shape, _F32), jnp.zeros(stats_shape + (d_v,), _F32))
        init += (jnp.full(stats_shape, -jnp.inf, _F32),) if track else ()
        init = _compat.match_varying(init, (q, k))
        m, l, acc, *high = jax.lax.fori_loop(0, t.num_k, kv_block, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), masks.EMPTY_LSE)
        out_buffer, *row_buffers = buffers
        return (_put(out_buffer, b, i, _tokens_first(out)),
                *(_put(x, b, i, jnp.moveaxis(y, -1, 1)) for x, y in zip(row_buffers,
                                                                         (lse, *high))))

    track = options.return_max_logit
    shape = q.values.shape[:-1]
    buffers: tuple = (jnp.zeros(shape + (d_v,), _F32), jnp.zeros(shape, _F32))
    buffers += (jnp.full(shape, -jnp.inf, _F32),) if track else ()
    out, *rows = jax.lax.fori_loop(0, t.batch * t.num_q, q_block,
                                   _compat.match_varying(buffers, (q, k)))
    heads = t.kv_heads * t.group
    out = out[:, :q_len].reshape(t.batch, q_len, heads, d_v)
    return (out, *(x[:, :q_len].reshape(t.batch, q_len, heads) for x in rows))


def backward(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
             lse: jax.Array, delta: jax.Array, dout: jax.Array, options: Options,
             accumulate: tuple[jax.Array, jax.Array] | None = None):
    """Gradients of attention given the softmax statistics of the full result.

    Args:
      q, k, v, q_tokens, kv_tokens, options: as in :func:`forward`.
      lse: ``float32[B, Sq, H]`` log-sum-exp of the (possibly merged) result.
      delta: ``float32[B, Sq, H]`` = ``sum(dout * out, -1) - dlse``.
      dout: ``[B, Sq, H, Dv]`` cotangent of the (merged) output.
      accumulate: optional float32 ``(dq, dk, dv)`` the gradients are added to,
        in place (the ring sums P steps without another gradient-sized buffer).
    Returns:
      float32 ``dq [B, Sq, H, Dqk]``, ``dk [B, Sk, Hkv, Dqk]``, ``dv [B, Sk, Hkv, Dv]``
      (plus ``accumulate``).
    """
    options = _checked(q, k, v, q_tokens, kv_tokens, options)
    contract.check_backward_operands(q, v, lse, delta, dout)
    k, v, lse, delta = contract.isolated_grads(k, v, lse, delta)
    return _backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, accumulate)


@contract.folds_vmap
def _backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options: Options,
              accumulate=None):
    spec, scale = options.spec, options.scale
    t = _tiling(q, k, *options.tiles(backward=True))
    q_tokens, kv_tokens, classes = schedule(spec, t, q_tokens, kv_tokens)  # [B, nq, nk]
    hg = (t.kv_heads, t.group)
    q_len_pad, kv_len_pad = t.num_q * t.block_q, t.num_k * t.block_k
    # The forward's scores (its tiles' scales), and the backward's products' operands.
    q_s, k_s, _ = scored(options, q, k, v)
    q, k, v, dout = products(options, q, k, v, dout, (q_s, k_s))
    product_dtype = products_dtype(options, backward=True)

    def by_group(x):  # [B, Sq, H, ...] -> [B, Sq_pad, Hkv, G, ...]
        return pad_seq(x, q_len_pad).reshape(t.batch, q_len_pad, *hg, *x.shape[3:])

    q, dout, q_s = (x.map(by_group) for x in (q, dout, q_s))
    lse, delta = by_group(lse), by_group(delta)
    k, v, k_s = (x.map(lambda a: pad_seq(a, kv_len_pad)) for x in (k, v, k_s))

    # One batch row at a time, as the forward: each row skips its own EMPTY tiles.
    def kv_block(index, buffers):
        b, j = index // t.num_k, index % t.num_k
        # [1, Hkv, bk, D] each
        (k_tile, k_scale), (v_tile, v_scale), (ks_tile, ks_scale) = (
            x.tile(b, j, t.block_k) for x in (k, v, k_s))
        kt = _token_tile(kv_tokens, b, j, t.block_k)

        def grads(carry, tiles, lse_tile, delta_tile, mask):
            dk, dv = carry
            (q_tile, q_scale), (do_tile, do_scale), (qs_tile, qs_scale) = tiles
            s, cap_slope = _scores(qs_tile, ks_tile, options, qs_scale, ks_scale)
            s = s - lse_tile[..., None]
            # Before exp: rows with EMPTY_LSE must not overflow, and a NaN lse (a row that
            # saw a non-finite value, contract.isolated_grads) stays off invisible pairs.
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
            p = jnp.exp(s)
            by_query = None if do_scale is None else do_scale[..., None]
            p_values, p_scale = product(p, product_dtype, by_query, over_group=True)
            dv = dv + times(jnp.einsum("bhgqk,bhgqd->bhkd", p_values, do_tile, preferred_element_type=_F32),
                             group_scale(p_scale))
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_tile, v_tile, preferred_element_type=_F32)
            if do_scale is not None:
                dp = dp * do_scale[..., None] * v_scale[:, :, None, None, :]
            ds = p * (dp - delta_tile[..., None])
            ds = (ds if cap_slope is None else ds * cap_slope) * scale
            by_query = None if q_scale is None else q_scale[..., None]
            ds_values, ds_scale = product(ds, product_dtype, by_query, over_group=True)
            dk = dk + times(jnp.einsum("bhgqk,bhgqd->bhkd", ds_values, q_tile, preferred_element_type=_F32),
                             group_scale(ds_scale))
            by_key = None if k_scale is None else k_scale[:, :, None, None, :]
            ds_values, ds_scale = product(ds, product_dtype, by_key)
            return (dk, dv), times(jnp.einsum("bhgqk,bhkd->bhgqd", ds_values, k_tile, preferred_element_type=_F32),
                                    ds_scale)

        def q_block(i, carry):
            dq, dkv = carry
            tiles = tuple(x.tile(b, i, t.block_q) for x in (q, dout, q_s))
            lse_tile, delta_tile = (jnp.moveaxis(_tile(x, b, i, t.block_q), 1, -1)
                                    for x in (lse, delta))  # [1, Hkv, G, bq]
            qt = _token_tile(q_tokens, b, i, t.block_q)
            zeros = jnp.zeros(tiles[0][0].shape, _F32)
            branches = [
                lambda c: (c, zeros),
                lambda c: grads(c, tiles, lse_tile, delta_tile, _tile_mask(spec, qt, kt)),
                lambda c: grads(c, tiles, lse_tile, delta_tile, None),
            ]
            branches = [_varying_like(f, (q, k)) for f in branches]
            dkv, dq_tile = jax.lax.switch(classes[b, i, j], branches, dkv)
            return _put(dq, b, i, _tile(dq, b, i, t.block_q) + _tokens_first(dq_tile)), dkv

        dq, dk, dv = buffers
        init = tuple(_heads_first(_tile(x, b, j, t.block_k)) for x in (dk, dv))  # [1, Hkv, bk, D]
        dq, (dk_tile, dv_tile) = jax.lax.fori_loop(0, t.num_q, q_block, (dq, init))
        return (dq, _put(dk, b, j, _tokens_first(dk_tile)),
                _put(dv, b, j, _tokens_first(dv_tile)))

    shapes = (q.values.shape, k.values.shape, v.values.shape)
    if accumulate is None:
        buffers = tuple(jnp.zeros(shape, _F32) for shape in shapes)
    else:
        buffers = (by_group(accumulate[0]), *(pad_seq(x, kv_len_pad) for x in accumulate[1:]))
    dq, dk, dv = jax.lax.fori_loop(0, t.batch * t.num_k, kv_block,
                                   _compat.match_varying(buffers, (q, k)))
    heads = t.kv_heads * t.group
    dq = dq[:, :t.q_len].reshape(t.batch, t.q_len, heads, shapes[0][-1])
    return dq, dk[:, :t.kv_len], dv[:, :t.kv_len]


_attention = contract.differentiable(_forward, _backward)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
              options: Options):
    """Differentiable :func:`forward`: ``(out float32, lse float32)``, through
    :func:`jax_seqpar.kernels.contract.differentiable`.

    The backward accepts cotangents for both ``out`` and ``lse``; the residual
    ``out`` is kept in the input dtype (``lse`` in float32).
    """
    return _attention(q, k, v, q_tokens, kv_tokens, _checked(q, k, v, q_tokens, kv_tokens,
                                                                options))
