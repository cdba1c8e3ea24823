"""Backward kernels of :mod:`jax_seqpar.kernels.gpu.pallas` (FlashAttention-2, arXiv:2307.08691).

Two kernels recompute the probabilities from the saved ``lse`` instead of storing
them: ``dq`` per (query tile, batch, head) looping over key tiles, and ``dk, dv``
per (key tile, batch, kv head, head split) looping over its share of the GQA
group's heads and over the query tiles. With few kv heads (MQA, MLA) the group is
split across programs (:func:`_head_splits`) so a GPU has enough programs; the
splits' partial ``dk, dv`` are summed afterwards. Both kernels use the forward's
schedule (:func:`._pallas_core.run_tiles`): only non-``EMPTY`` tiles, masks only
outside the row's run of ``FULL`` tiles, loads at the loops' top level.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_seqpar.core import compat as _compat
from jax_seqpar.kernels.gpu import _config as config
from jax_seqpar.kernels import contract, fp8_inputs
from jax_seqpar.kernels.gpu import _fp8
from jax_seqpar.kernels.gpu import _core as core
from jax_seqpar.kernels.gpu import _decode as decode
from jax_seqpar.kernels.gpu._core import HeadDim
from jax_seqpar.kernels.tiling import pad_seq, padded_tokens

_F32 = core.F32
#: Enough dk/dv programs to fill a GPU (about twice the SMs of an H100).
_MIN_PROGRAMS = 256


def _grad_tile(q_cols, k_cols, v_cols, do_cols, lse2, delta, mask, options,
               precision):
    """``(p, ds)`` of one tile ``[bq, bk]``: probabilities from the row log-sum-exp
    (log2 units) and the gradient of the raw (pre-softcap) scores, unscaled."""
    s, tanh = core.scores(q_cols, k_cols, options, precision)
    p = jnp.exp2(s - lse2[:, None])
    if mask is not None:  # after the lse: a NaN one (contract.isolated_grads) stays off
        p = jnp.where(mask, p, 0.0)  # invisible pairs; an EMPTY_LSE row's inf too
    ds = p * (core.dot_cols(do_cols, v_cols, (1, 1), precision) - delta[:, None])
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    return p, ds


def _dq_kernel(bounds_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, do_ref, lse_ref, delta_ref,
               dq_ref, *, options, block_k, d_qk, d_v, has_mask, precision):
    rows = slice(None)
    q_tile = core.token_tile(q_tok, rows)
    q_cols = None if d_qk.count > 1 else d_qk.load_all(q_ref, rows)
    do_cols = d_v.load_all(do_ref, rows)
    lse2, delta = lse_ref[...] * core.LOG2E, delta_ref[...]  # [bq]

    def step(j, dq, masked):
        window = pl.ds(j * block_k, block_k)
        k_cols = d_qk.load_all(k_ref, window)
        v_cols = d_v.load_all(v_ref, window)
        q_now = d_qk.load_all(q_ref, rows) if q_cols is None else q_cols
        mask = (core.tile_mask(options.spec, q_tile, core.token_tile(kv_tok, window))
                if masked else None)
        _, ds = _grad_tile(q_now, k_cols, v_cols, do_cols, lse2, delta, mask, options,
                           precision)
        ds = ds.astype(k_cols[0].dtype)
        return tuple(a + core.dot(ds, k, (1, 0), precision) for a, k in zip(dq, k_cols))

    init = d_qk.zeros(q_ref.shape[0])
    dq = core.run_tiles(bounds_ref, step, init, has_mask=has_mask)
    for c, a in enumerate(dq):
        d_qk.store(dq_ref, c, a * options.scale)


def _dkv_kernel(bounds_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, options, block_q, d_qk, d_v, has_mask, precision):
    cols = slice(None)
    kv_tile = core.token_tile(kv_tok, cols)
    k_cols = d_qk.load_all(k_ref, cols)
    v_cols = d_v.load_all(v_ref, cols)
    heads = q_ref.shape[1]  # q_ref: [Sq, heads of this split, Dqk]

    def head_body(head, carry):
        def step(i, carry, masked):
            dk, dv = carry
            window = pl.ds(i * block_q, block_q)
            q_cols = d_qk.load_all(q_ref, window, head)
            do_cols = d_v.load_all(do_ref, window, head)
            lse2 = lse_ref[head, window] * core.LOG2E
            mask = (core.tile_mask(options.spec, core.token_tile(q_tok, window), kv_tile)
                    if masked else None)
            p, ds = _grad_tile(q_cols, k_cols, v_cols, do_cols, lse2,
                               delta_ref[head, window], mask, options, precision)
            p, ds = p.astype(do_cols[0].dtype), ds.astype(q_cols[0].dtype)
            dv = tuple(a + core.dot(p, do, (0, 0), precision) for a, do in zip(dv, do_cols))
            dk = tuple(a + core.dot(ds, q, (0, 0), precision) for a, q in zip(dk, q_cols))
            return dk, dv

        return core.run_tiles(bounds_ref, step, carry, has_mask=has_mask)

    block_k = k_ref.shape[0]
    init = (d_qk.zeros(block_k), d_v.zeros(block_k))
    dk, dv = (head_body(jnp.int32(0), init) if heads == 1
              else lax.fori_loop(0, heads, head_body, init))
    for c, a in enumerate(dk):
        d_qk.store(dk_ref, c, a * options.scale)
    for c, a in enumerate(dv):
        d_v.store(dv_ref, c, a)


def _scale_specs(scales, by_query, by_key) -> list:
    """BlockSpecs of the FP8 scales ``(q, k, v, dout | None)`` (none without FP8):
    ``by_query`` for q's and dout's, ``by_key`` for k's and v's."""
    if scales is None:
        return []
    return [by_query, by_key, by_key] + ([by_query] if scales[3] is not None else [])


def _head_splits(programs: int, group: int) -> int:
    """Smallest divisor of ``group`` that gives at least ``_MIN_PROGRAMS`` programs."""
    for splits in range(1, group + 1):
        if group % splits == 0 and programs * splits >= _MIN_PROGRAMS:
            return splits
    return group


@contract.folds_vmap
def backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, interpret):
    """:func:`jax_seqpar.kernels.gpu.pallas.backward` after validation (``options``
    resolved: :meth:`jax_seqpar.kernels.options.Options.resolved`). In FP8
    (:func:`jax_seqpar.kernels.fp8_inputs.in_kernel`) q, k, v are quantized as the
    forward's (the same scores) and dout in the backward's dtype, outside the kernels
    (:mod:`._fp8`'s bodies)."""
    if not fp8_inputs.in_kernel(options):
        return _backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, interpret)
    (q, k, v), scales = fp8_inputs.inputs(options, q, k, v)
    dout, dout_scales = fp8_inputs.cotangent(options, dout)
    dq, dk, dv = _backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, interpret,
                           (*scales, dout_scales))
    return dq, dk, dv


def _backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, interpret,
              scales=None):
    """The dq and dk/dv ``pallas_call`` s; ``scales``: FP8 operands' per-token float32
    ``(q [B, Sq, H], k [B, Sk, Hkv], v [B, Sk, Hkv], dout [B, Sq, H] | None)``, or None."""
    operands = (q, k, v, q_tokens, kv_tokens, lse, delta, dout, scales)
    q, k, v, q_tokens, kv_tokens, lse, delta, dout, scales = _compat.match_varying(
        operands, operands)
    (q_len, heads), kv_heads = q.shape[1:3], k.shape[2]
    if decode.folds_group(q_len, heads, kv_heads):
        group = heads // kv_heads
        q, lse, delta, dout = (decode.fold(x, kv_heads) for x in (q, lse, delta, dout))
        if scales is not None:
            qs, ks, vs, dos = scales
            scales = (decode.fold(qs, kv_heads), ks, vs,
                      None if dos is None else decode.fold(dos, kv_heads))
        dq, dk, dv = _backward(q, k, v, decode.fold_tokens(q_tokens, group), kv_tokens, lse,
                               delta, dout, options, interpret, scales)
        return decode.unfold(dq, group), dk, dv
    spec = options.spec
    t = core.tiling(q, k, *options.tiles(backward=True))
    q_tokens, kv_tokens = padded_tokens(t, q_tokens, kv_tokens)
    heads = q.shape[2]
    d_qk, d_v = HeadDim.of(q.shape[-1]), HeadDim.of(v.shape[-1])
    q_pad, kv_pad = t.num_q * t.block_q, t.num_k * t.block_k
    static = dict(options=options, d_qk=d_qk, d_v=d_v, has_mask=core.masked(spec, q_tokens))
    inputs = (
        pad_seq(q, q_pad), pad_seq(k, kv_pad), pad_seq(v, kv_pad), q_tokens, kv_tokens,
        pad_seq(dout if scales is not None else dout.astype(v.dtype), q_pad),
        jnp.swapaxes(pad_seq(lse, q_pad), 1, 2), jnp.swapaxes(pad_seq(delta, q_pad), 1, 2),
    )  # statistics as [B, H, Sq_pad]: contiguous rows per head
    dq_kernel: Callable = _dq_kernel
    dkv_kernel: Callable = _dkv_kernel
    suffix, scale_rows = "", []
    if scales is not None:  # FP8: per-token scales as [B, H, S_pad], after the statistics
        dq_kernel, dkv_kernel, suffix = _fp8.dq_kernel, _fp8.dkv_kernel, "_fp8"
        scale_rows = [jnp.swapaxes(pad_seq(x, n), 1, 2) for x, n in
                      zip(scales, (q_pad, kv_pad, kv_pad, q_pad)) if x is not None]

    dq = core.call(
        functools.partial(dq_kernel, block_k=t.block_k, **static),
        interpret=interpret, precision_dtype=q.dtype,
        grid=(t.num_q, t.batch, heads),
        in_specs=core.query_row_specs(t, q_tokens, kv_tokens, d_qk, d_v) + [
            pl.BlockSpec((None, t.block_q, None, d_v.padded), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, t.block_q), lambda i, b, h: (b, h, i)),
            pl.BlockSpec((None, None, t.block_q), lambda i, b, h: (b, h, i)),
        ] + _scale_specs(scales, pl.BlockSpec((None, None, t.block_q), lambda i, b, h: (b, h, i)),
                         pl.BlockSpec((None, None, kv_pad), lambda i, b, h: (b, h // t.group, 0))),
        out_specs=pl.BlockSpec((None, t.block_q, None, d_qk.padded),
                               lambda i, b, h: (b, i, h, 0)),
        out_shape=_compat.shape_struct((t.batch, q_pad, heads, d_qk.size), _F32, q),
        compiler_params=config.launch("dq", t.block_q, d_qk.size, d_v.size, q.dtype),
        name="seqpar_flash_dq" + suffix,
    )(core.tile_bounds(spec, t, q_tokens, kv_tokens), *inputs, *scale_rows)

    # Programs (key tile, batch, kv head * splits); split s of kv head g holds query
    # heads [(g * splits + s) * per_split, ...): one BlockSpec block of the H axis.
    splits = _head_splits(t.num_k * t.batch * t.kv_heads, t.group)
    per_split = t.group // splits
    dk, dv = core.call(
        functools.partial(dkv_kernel, block_q=t.block_q, **static),
        interpret=interpret, precision_dtype=q.dtype,
        grid=(t.num_k, t.batch, t.kv_heads * splits),
        in_specs=[
            pl.BlockSpec((None, None, 4), lambda j, b, g: (b, j, 0)),
            pl.BlockSpec((None, q_pad, per_split, d_qk.padded), lambda j, b, g: (b, 0, g, 0)),
            pl.BlockSpec((None, t.block_k, None, d_qk.padded),
                         lambda j, b, g: (b, j, g // splits, 0)),
            pl.BlockSpec((None, t.block_k, None, d_v.padded),
                         lambda j, b, g: (b, j, g // splits, 0)),
            core.token_specs(q_tokens, q_pad, lambda j, b, g: (b, 0)),
            core.token_specs(kv_tokens, t.block_k, lambda j, b, g: (b, j)),
            pl.BlockSpec((None, q_pad, per_split, d_v.padded), lambda j, b, g: (b, 0, g, 0)),
            pl.BlockSpec((None, per_split, q_pad), lambda j, b, g: (b, g, 0)),
            pl.BlockSpec((None, per_split, q_pad), lambda j, b, g: (b, g, 0)),
        ] + _scale_specs(scales, pl.BlockSpec((None, per_split, q_pad), lambda j, b, g: (b, g, 0)),
                         pl.BlockSpec((None, None, t.block_k),
                                      lambda j, b, g: (b, g // splits, j))),
        out_specs=[
            pl.BlockSpec((None, t.block_k, None, d_qk.padded), lambda j, b, g: (b, j, g, 0)),
            pl.BlockSpec((None, t.block_k, None, d_v.padded), lambda j, b, g: (b, j, g, 0)),
        ],
        out_shape=[
            _compat.shape_struct((t.batch, kv_pad, t.kv_heads * splits, d_qk.size), _F32, q),
            _compat.shape_struct((t.batch, kv_pad, t.kv_heads * splits, d_v.size), _F32, q)],
        compiler_params=config.launch("dkv", t.block_k, d_qk.size, d_v.size, q.dtype,
                                      segments=q_tokens.segment_ids is not None
                                      or q_tokens.bidirectional_ids is not None),
        name="seqpar_flash_dkv" + suffix,
    )(core.tile_bounds(spec, t, q_tokens, kv_tokens, by_key=True), *inputs, *scale_rows)
    if splits > 1:  # [B, Sk, Hkv * splits, D] -> [B, Sk, Hkv, D]
        dk, dv = (x.reshape(*x.shape[:2], t.kv_heads, splits, x.shape[-1]).sum(3)
                  for x in (dk, dv))
    return dq[:, :t.q_len], dk[:, :t.kv_len], dv[:, :t.kv_len]
