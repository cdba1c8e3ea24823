"""Backward kernels of :mod:`jax_seqpar.kernels.tpu.mosaic` (FlashAttention-2, arXiv:2307.08691).

Both recompute the probabilities from the saved ``lse`` instead of storing them.
``dq`` runs on the forward's grid ``(batch, head, query tile, key tile)``. ``dk, dv``
runs on ``(batch, kv head, key tile, head of the group, query tile)`` and works in
the transposed orientation ``[key, query]`` (scores ``k @ q.T``), so every matmul
is a plain or ``b``-transposed MXU product and the GQA group's gradients add up in
VMEM scratch without repeating K/V. Both follow the scalar-prefetched plan of the
forward: ``EMPTY`` tiles are skipped and not copied in, masks on ``PARTIAL`` only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_seqpar.core import compat as _compat
from jax_seqpar.kernels.tpu import _common as mc
from jax_seqpar.kernels import contract, fp8_inputs
from jax_seqpar.kernels.tiling import pad_seq, schedule


def _grad_scores(t, p, dp, delta):
    """``dS`` w.r.t. the raw scaled scores: ``p * (dp - delta)``, times the soft
    cap's derivative ``1 - tanh**2`` when there is one (``t``, the cap's tanh, or None)."""
    ds = p * (dp - delta)
    return ds if t is None else ds * (1.0 - t * t)


def _times(x, factor):
    """``x * factor`` (None: ``x``)."""
    return x if factor is None else x * factor


def _scales(refs, columns):
    """``(q, k, v, dout)`` FP8 scales of a tile from their row refs ``[1, tile]`` (None
    where absent: no FP8, or a bfloat16 dout), those at ``columns`` turned into columns
    ``[tile, 1]``."""
    loaded = [ref[...] for ref in refs] + [None] * (4 - len(refs))
    return tuple(x if x is None or i not in columns else mc.row_to_column(x)[:, :1]
                 for i, x in enumerate(loaded))


def _dq_kernel(plan_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, do_ref, lse_ref, delta_ref,
               *refs, options, precision, accumulate, scales):
    # FP8: the per-token scales of q, k, v (and dout), rows [1, tile] each
    scale_refs, refs = refs[:scales], refs[scales:]
    if accumulate:  # dq so far (aliased to dq_ref): this call's dq is added in place
        dq_in, dq_ref, dq_acc, lse_col, delta_col = refs
    else:
        dq_in, (dq_ref, dq_acc, lse_col, delta_col) = None, refs
    q_tile, kv_tile = pl.program_id(2), pl.program_id(3)

    @pl.when(kv_tile == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, mc.F32)
        lse, delta = contract.isolated_stats(lse_ref[...], delta_ref[...])  # [1, bq]
        lse_col[...] = mc.row_to_column(lse)  # [1, bq] -> [bq, 128]
        delta_col[...] = mc.row_to_column(delta)

    def tile(is_partial):
        # Non-finite numbers of k and v at zero; FP8 tiles widened to bfloat16.
        k = contract.finite(mc.widened(k_ref[...]))
        q_scale, k_scale, v_scale, do_scale = _scales(scale_refs, columns=(0, 3))
        s, t = mc.logits(mc.widened(q_ref[...]), k, options, precision,
                         None if q_scale is None else (q_scale, k_scale))  # [bq, bk]
        s = s - lse_col[:, :1]
        if is_partial:  # after the lse: a NaN one stays off invisible pairs
            s = mc.masked(s, options.spec, q_tok, kv_tok, rows_are_queries=True)
        p = jnp.exp(s)
        dp = mc.dot(mc.widened(do_ref[...]), contract.finite(mc.widened(v_ref[...])),
                    transpose_b=True, precision=precision)
        ds = _grad_scores(t, p, _times(_times(dp, v_scale), do_scale), delta_col[:, :1])
        dq_acc[...] += mc.dot(_times(ds, k_scale).astype(k.dtype), k, precision=precision)

    mc.run_tile(plan_ref, pl.program_id(0), q_tile, kv_tile, tile)

    @pl.when(kv_tile == pl.num_programs(3) - 1)
    def _finish():
        dq = dq_acc[...] * options.scale
        dq_ref[...] = dq if dq_in is None else dq_in[...] + dq


def _dkv_kernel(plan_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, do_ref, lse_ref, delta_ref,
                *refs, options, precision, scales):
    scale_refs, (dk_ref, dv_ref, dk_acc, dv_acc) = refs[:scales], refs[scales:]
    kv_tile, head, q_tile = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first = (head == 0) & (q_tile == 0)
    last = (head == pl.num_programs(3) - 1) & (q_tile == pl.num_programs(4) - 1)

    @pl.when(first)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, mc.F32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, mc.F32)

    def tile(is_partial):
        q, do = mc.widened(q_ref[...]), mc.widened(do_ref[...])
        lse, delta = contract.isolated_stats(lse_ref[...], delta_ref[...])  # [1, bq]
        # Transposed: q's and dout's scales are rows [1, bq], k's and v's columns [bk, 1].
        q_scale, k_scale, v_scale, do_scale = _scales(scale_refs, columns=(1, 2))
        s, t = mc.logits(contract.finite(mc.widened(k_ref[...])), q, options, precision,
                         None if q_scale is None else (k_scale, q_scale))  # [bk, bq]
        s = s - lse
        if is_partial:  # after the lse: a NaN one stays off invisible pairs
            s = mc.masked(s, options.spec, kv_tok, q_tok, rows_are_queries=False)
        p = jnp.exp(s)
        dv_acc[...] += mc.dot(_times(p, do_scale).astype(do.dtype), do, precision=precision)
        dp = mc.dot(contract.finite(mc.widened(v_ref[...])), do, transpose_b=True,
                    precision=precision)
        ds = _grad_scores(t, p, _times(_times(dp, v_scale), do_scale), delta)  # [bk, bq]
        dk_acc[...] += mc.dot(_times(ds, q_scale).astype(q.dtype), q, precision=precision)

    mc.run_tile(plan_ref, pl.program_id(0), kv_tile, q_tile, tile)

    @pl.when(last)
    def _finish():
        dk_ref[...] = dk_acc[...] * options.scale
        dv_ref[...] = dv_acc[...]


def _scale_specs(count: int, by_query, by_key) -> list:
    """BlockSpecs of ``count`` FP8 scale rows ``(q, k, v(, dout))``: ``by_query`` for q's
    and dout's, ``by_key`` for k's and v's (none without FP8)."""
    return ([by_query, by_key, by_key] + [by_query] * (count - 3)) if count else []


@contract.folds_vmap
def backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, dq_in=None):
    """:func:`jax_seqpar.kernels.tpu.mosaic.backward` after validation (``options``
    resolved: :meth:`jax_seqpar.kernels.options.Options.resolved`).

    ``dq_in``: float32 ``[B, Sq, H, Dqk]`` gradient so far (a ring's running dq), added
    to dq in the dq kernel, in place: no float32 dq per call and no add after it.
    """
    if not fp8_inputs.in_kernel(options):
        return _backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, dq_in)
    # FP8 storage: q, k, v as the forward's (the same scores), dout in the backward's dtype.
    (q, k, v), scales = fp8_inputs.inputs(options, q, k, v)
    dout, dout_scales = fp8_inputs.cotangent(options, dout)
    scales += () if dout_scales is None else (dout_scales,)
    return _backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, dq_in, scales)


def _backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, dq_in=None,
              scales=()):
    """The dq and dk/dv ``pallas_call`` s; ``scales``: FP8 operands' per-token float32
    scales ``(q [B, Sq, H], k [B, Sk, Hkv], v [B, Sk, Hkv](, dout [B, Sq, H]))``, or ()."""
    operands = (q, k, v, q_tokens, kv_tokens, lse, delta, dout, dq_in, scales)
    q, k, v, q_tokens, kv_tokens, lse, delta, dout, dq_in, scales = _compat.match_varying(
        operands, operands)
    t = mc.tiling(q, k, *options.tiles(backward=True))
    q_tokens, kv_tokens, classes = schedule(options.spec, t, q_tokens, kv_tokens)  # [B, nq, nk]
    (batch, q_len, heads, d_qk), (kv_len, kv_heads), d_v = q.shape, k.shape[1:3], v.shape[-1]
    q_pad, kv_pad, group = t.num_q * t.block_q, t.num_k * t.block_k, t.group
    kernel_args = dict(options=options, precision=mc.precision(q.dtype), scales=len(scales))
    q_h = mc.heads_first(q, q_pad)
    do_h = mc.heads_first(dout if scales else dout.astype(v.dtype), q_pad)
    rows = mc.scale_rows(scales, (q_pad, kv_pad, kv_pad, q_pad))  # FP8: [B, H, 1, S_pad]
    k_h, v_h = mc.heads_first(k, kv_pad), mc.heads_first(v, kv_pad)
    # Statistics lane-dense, [B, H, 1, Sq_pad]: a trailing dim of 1 would be padded to
    # 128 lanes in HBM.
    lse_h, delta_h = (jnp.swapaxes(pad_seq(x, q_pad), 1, 2)[:, :, None] for x in (lse, delta))

    def kv_map(b, h, i, j, plan_ref):
        # Grid indices are int32; a Python int would be int64 under jax_enable_x64.
        return b, lax.div(h, jnp.int32(group)), mc.fetched(plan_ref, b, i, j), 0

    def q_map(b, h, i, j, _):
        return b, h, i, 0

    dq_operands = [mc.plan(classes), q_h, k_h, v_h, mc.column(q_tokens), mc.row(kv_tokens),
                   do_h, lse_h, delta_h, *rows]
    dq_spec = pl.BlockSpec((None, None, t.block_q, d_qk), q_map)
    dq_shape = jax.ShapeDtypeStruct((batch, heads, q_pad, d_qk), mc.F32)
    aliases = None
    if dq_in is not None:  # the running dq's buffer becomes the output
        aliases = {len(jax.tree.leaves(dq_operands)): 0}
        dq_operands.append(mc.heads_first(dq_in, q_pad))
    score_flops = batch * heads * q_pad * kv_pad
    dq_call = mc.pallas(
        functools.partial(_dq_kernel, **kernel_args, accumulate=dq_in is not None),
        name="seqpar_mosaic_dq",
        grid=(batch, heads, t.num_q, t.num_k),
        in_specs=[
            pl.BlockSpec((None, None, t.block_q, d_qk), q_map),
            pl.BlockSpec((None, None, t.block_k, d_qk), kv_map),
            pl.BlockSpec((None, None, t.block_k, d_v), kv_map),
            mc.token_specs(q_tokens, (None, t.block_q, 1), lambda b, h, i, j, _: (b, i, 0)),
            mc.token_specs(kv_tokens, (None, 1, t.block_k),
                           lambda b, h, i, j, plan_ref: (b, 0, mc.fetched(plan_ref, b, i, j))),
            pl.BlockSpec((None, None, t.block_q, d_v), q_map),
            pl.BlockSpec((None, None, 1, t.block_q), lambda b, h, i, j, _: (b, h, 0, i)),
            pl.BlockSpec((None, None, 1, t.block_q), lambda b, h, i, j, _: (b, h, 0, i)),
        ] + _scale_specs(
            len(scales), pl.BlockSpec((None, None, 1, t.block_q), lambda b, h, i, j, _: (b, h, 0, i)),
            pl.BlockSpec((None, None, 1, t.block_k), lambda b, h, i, j, plan_ref: (
                b, lax.div(h, jnp.int32(group)), 0, mc.fetched(plan_ref, b, i, j)))
        ) + ([dq_spec] if dq_in is not None else []),
        out_specs=dq_spec,
        out_shape=dq_shape,
        scratch_shapes=[mc.vmem((t.block_q, d_qk)), mc.vmem((t.block_q, mc.LANES)),
                        mc.vmem((t.block_q, mc.LANES))],
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
        like=q,
        # s = q k^T, dp = do v^T, dq = ds k
        cost_estimate=mc.cost(flops=2 * score_flops * (2 * d_qk + d_v),
                              transcendentals=score_flops,
                              arrays=(dq_operands[1:4], do_h, dq_shape, dq_in)),
        input_output_aliases=aliases,
    )
    dq = dq_call(*dq_operands)

    def q_row_map(b, g, j, r, i, plan_ref):  # query rows of head g * group + r
        return b, g * group + r, mc.fetched(plan_ref, b, j, i), 0

    def stats_map(b, g, j, r, i, plan_ref):
        return b, g * group + r, 0, mc.fetched(plan_ref, b, j, i)

    def kv_own_map(b, g, j, r, i, _):
        return b, g, j, 0

    out_shapes = [jax.ShapeDtypeStruct((batch, kv_heads, kv_pad, d_qk), mc.F32),
                  jax.ShapeDtypeStruct((batch, kv_heads, kv_pad, d_v), mc.F32)]
    dkv_call = mc.pallas(
        functools.partial(_dkv_kernel, **kernel_args),
        name="seqpar_mosaic_dkv",
        grid=(batch, kv_heads, t.num_k, group, t.num_q),
        in_specs=[
            pl.BlockSpec((None, None, t.block_q, d_qk), q_row_map),
            pl.BlockSpec((None, None, t.block_k, d_qk), kv_own_map),
            pl.BlockSpec((None, None, t.block_k, d_v), kv_own_map),
            mc.token_specs(q_tokens, (None, 1, t.block_q),
                           lambda b, g, j, r, i, plan_ref: (b, 0, mc.fetched(plan_ref, b, j, i))),
            mc.token_specs(kv_tokens, (None, t.block_k, 1), lambda b, g, j, r, i, _: (b, j, 0)),
            pl.BlockSpec((None, None, t.block_q, d_v), q_row_map),
            pl.BlockSpec((None, None, 1, t.block_q), stats_map),
            pl.BlockSpec((None, None, 1, t.block_q), stats_map),
        ] + _scale_specs(len(scales), pl.BlockSpec((None, None, 1, t.block_q), stats_map),
                         pl.BlockSpec((None, None, 1, t.block_k),
                                      lambda b, g, j, r, i, _: (b, g, 0, j))),
        out_specs=[pl.BlockSpec((None, None, t.block_k, d_qk), kv_own_map),
                   pl.BlockSpec((None, None, t.block_k, d_v), kv_own_map)],
        out_shape=out_shapes,
        scratch_shapes=[mc.vmem((t.block_k, d_qk)), mc.vmem((t.block_k, d_v))],
        semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        like=q,
        # s = k q^T, dv += p do, dp = v do^T, dk += ds q
        cost_estimate=mc.cost(flops=2 * score_flops * (2 * d_qk + 2 * d_v),
                              transcendentals=score_flops,
                              arrays=(q_h, k_h, v_h, do_h, out_shapes)),
    )
    dk, dv = dkv_call(mc.plan(jnp.swapaxes(classes, 1, 2)), q_h, k_h, v_h, mc.row(q_tokens),
                      mc.column(kv_tokens), do_h, lse_h, delta_h, *rows)
    return (mc.tokens_first(dq, q_len), mc.tokens_first(dk, kv_len),
            mc.tokens_first(dv, kv_len))
