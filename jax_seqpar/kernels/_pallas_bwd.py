"""Backward kernels of :mod:`jax_seqpar.kernels.pallas` (FlashAttention-2, arXiv:2307.08691).

Two kernels recompute the probabilities from the saved ``lse`` instead of storing
them: ``dq`` per (query tile, batch, head) looping over key tiles, and ``dk, dv``
per (key tile, batch, kv head) looping over every head of the GQA group and the
query tiles, so K/V gradients are summed over the group without atomics and
without repeating K/V. Both use the forward's schedule: loop bounds of the
non-``EMPTY`` tiles, ``EMPTY`` tiles inside them skipped, masks on ``PARTIAL`` only.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_seqpar import _compat
from jax_seqpar.kernels import pallas as _p
from jax_seqpar.kernels.tiling import pad_seq, schedule

_F32 = jnp.float32


def _probabilities(q, k, lse2, spec, scale, precision, masked, q_tok, kv_tok):
    """``p float32[bq, bk]`` of one tile from the row log-sum-exp (log2 units)."""
    s = _p._dot(q, k, (1, 1), precision) * (scale * _p._LOG2E)
    if masked:
        mask = _p._tile_mask(spec, *q_tok, *kv_tok)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
    return jnp.exp2(s - lse2[:, None])


def _dq_kernel(bounds_ref, classes_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, do_ref,
               lse_ref, delta_ref, dq_ref, *, spec, scale, block_k, precision):
    q, do = q_ref[...], do_ref[...]  # [bq, Dqk], [bq, Dv]
    lse2, delta = lse_ref[...] * _p._LOG2E, delta_ref[...]  # [bq]
    q_tile = _p._token_tile(q_tok, slice(None))

    def tile(dq, masked, start):
        window = pl.ds(start, block_k)
        k, v = k_ref[window, :], v_ref[window, :]
        p = _probabilities(q, k, lse2, spec, scale, precision, masked, q_tile,
                           _p._token_tile(kv_tok, window))
        ds = p * (_p._dot(do, v, (1, 1), precision) - delta[:, None])
        return dq + _p._dot(ds.astype(k.dtype), k, (1, 0), precision)

    def body(j, dq):
        return _p._switch_classes(classes_ref[j], functools.partial(tile, start=j * block_k), dq)

    dq = lax.fori_loop(bounds_ref[0], bounds_ref[1], body, jnp.zeros(q.shape, _F32))
    dq_ref[...] = dq * scale


def _dkv_kernel(bounds_ref, classes_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, spec, scale, block_q, precision):
    k, v = k_ref[...], v_ref[...]  # [bk, Dqk], [bk, Dv]
    kv_tile = _p._token_tile(kv_tok, slice(None))
    group = q_ref.shape[1]  # q_ref: [Sq, group, Dqk]

    def tile(carry, masked, head, start):
        dk, dv = carry
        window = pl.ds(start, block_q)
        q, do = q_ref[window, head, :], do_ref[window, head, :]
        lse2 = lse_ref[head, window] * _p._LOG2E
        p = _probabilities(q, k, lse2, spec, scale, precision, masked,
                           _p._token_tile(q_tok, window), kv_tile)
        dv = dv + _p._dot(p.astype(do.dtype), do, (0, 0), precision)
        ds = p * (_p._dot(do, v, (1, 1), precision) - delta_ref[head, window][:, None])
        return dk + _p._dot(ds.astype(q.dtype), q, (0, 0), precision), dv

    def head_body(head, carry):
        def body(i, carry):
            step = functools.partial(tile, head=head, start=i * block_q)
            return _p._switch_classes(classes_ref[i], step, carry)

        return lax.fori_loop(bounds_ref[0], bounds_ref[1], body, carry)

    init = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    dk, dv = lax.fori_loop(0, group, head_body, init)
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, *, spec, scale, block_sizes,
             interpret):
    """:func:`jax_seqpar.kernels.pallas.backward` after validation."""
    operands = (q, k, v, q_tokens, kv_tokens, lse, delta, dout)
    q, k, v, q_tokens, kv_tokens, lse, delta, dout = _compat.match_varying(operands, operands)
    t = _p._tiling(q, k, block_sizes.block_q_bwd, block_sizes.block_k_bwd)
    q_tokens, kv_tokens, classes = schedule(spec, t, q_tokens, kv_tokens)
    heads, d_qk, d_v = q.shape[2], q.shape[-1], v.shape[-1]
    q_pad, kv_pad = t.num_q * t.block_q, t.num_k * t.block_k
    d_qk_pad, d_v_pad = _p._padded_dim(d_qk), _p._padded_dim(d_v)
    group, precision = t.group, _p._precision(q.dtype)
    inputs = (
        pad_seq(q, q_pad, dim=d_qk_pad), pad_seq(k, kv_pad, dim=d_qk_pad),
        pad_seq(v, kv_pad, dim=d_v_pad),
        q_tokens, kv_tokens, pad_seq(dout.astype(v.dtype), q_pad, dim=d_v_pad),
        jnp.swapaxes(pad_seq(lse, q_pad), 1, 2), jnp.swapaxes(pad_seq(delta, q_pad), 1, 2),
    )  # statistics as [B, H, Sq_pad]: contiguous rows per head
    params = _p._compiler_params(max(d_qk_pad, d_v_pad))

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec, scale=scale, block_k=t.block_k,
                          precision=precision),
        grid=(t.num_q, t.batch, heads),
        in_specs=_p._query_row_specs(t, q_tokens, kv_tokens, d_qk_pad, d_v_pad) + [
            pl.BlockSpec((None, t.block_q, None, d_v_pad), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, t.block_q), lambda i, b, h: (b, h, i)),
            pl.BlockSpec((None, None, t.block_q), lambda i, b, h: (b, h, i)),
        ],
        out_specs=pl.BlockSpec((None, t.block_q, None, d_qk_pad), lambda i, b, h: (b, i, h, 0)),
        out_shape=_compat.shape_struct((t.batch, q_pad, heads, d_qk_pad), _F32, q),
        compiler_params=params,
        interpret=interpret,
        name="seqpar_flash_dq",
    )(_p._bounds(classes), classes, *inputs)

    classes_t = classes.T  # [nk, nq]: one row per key tile
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, spec=spec, scale=scale, block_q=t.block_q,
                          precision=precision),
        grid=(t.num_k, t.batch, t.kv_heads),
        in_specs=[
            pl.BlockSpec((None, 2), lambda j, b, g: (j, 0)),
            pl.BlockSpec((None, t.num_q), lambda j, b, g: (j, 0)),
            pl.BlockSpec((None, q_pad, group, d_qk_pad), lambda j, b, g: (b, 0, g, 0)),
            pl.BlockSpec((None, t.block_k, None, d_qk_pad), lambda j, b, g: (b, j, g, 0)),
            pl.BlockSpec((None, t.block_k, None, d_v_pad), lambda j, b, g: (b, j, g, 0)),
            _p._token_specs(q_tokens, q_pad, lambda j, b, g: (b, 0)),
            _p._token_specs(kv_tokens, t.block_k, lambda j, b, g: (b, j)),
            pl.BlockSpec((None, q_pad, group, d_v_pad), lambda j, b, g: (b, 0, g, 0)),
            pl.BlockSpec((None, group, q_pad), lambda j, b, g: (b, g, 0)),
            pl.BlockSpec((None, group, q_pad), lambda j, b, g: (b, g, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, t.block_k, None, d_qk_pad), lambda j, b, g: (b, j, g, 0)),
            pl.BlockSpec((None, t.block_k, None, d_v_pad), lambda j, b, g: (b, j, g, 0)),
        ],
        out_shape=[_compat.shape_struct((t.batch, kv_pad, t.kv_heads, d_qk_pad), _F32, q),
                   _compat.shape_struct((t.batch, kv_pad, t.kv_heads, d_v_pad), _F32, q)],
        compiler_params=params,
        interpret=interpret,
        name="seqpar_flash_dkv",
    )(_p._bounds(classes_t), classes_t, *inputs)
    return (dq[:, :t.q_len, :, :d_qk], dk[:, :t.kv_len, :, :d_qk], dv[:, :t.kv_len, :, :d_v])
