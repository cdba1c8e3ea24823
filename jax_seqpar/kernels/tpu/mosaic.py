"""Mosaic flash attention: the TPU kernel, with the contract of ``xla.py``.

The kernel contract (:mod:`jax_seqpar.kernels.contract`), like
:mod:`jax_seqpar.kernels.xla`: :func:`forward` -> ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])``
(and ``max_logit float32[B, Sq, H]`` with ``options.return_max_logit``),
:func:`backward` (given the final ``lse`` and ``delta = sum(dout * out, -1) - dlse``)
-> float32 ``(dq, dk, dv)``, and :func:`attention`, a ``custom_vjp`` of both that
takes cotangents for ``out`` AND ``lse``. Every function takes the call's
:class:`~jax_seqpar.kernels.options.Options` (mask, scale, tiles, ``softcap``: scores
``s = scale * q.k`` become ``softcap * tanh(s / softcap)`` before masking).

How the work is cut (FlashAttention-2):

* forward: grid ``(batch, head, query tile, key tile)``; the key axis is the
  sequential (``"arbitrary"``) one and carries the online softmax in VMEM scratch
  (statistics and accumulator in float32; MXU inputs in the input dtype);
* backward: a ``dq`` kernel on the same grid, and a ``dk, dv`` kernel on
  ``(batch, kv head, key tile, head of the group, query tile)`` that computes the
  transposed scores ``k @ q.T`` (no in-kernel transposes) and sums its GQA group
  in VMEM, without atomics (``_mosaic_bwd``);
* every (query tile, key tile) pair of every batch row is classified outside the
  kernel (:func:`jax_seqpar.core.blocks.classify`) into a scalar-prefetched plan
  ``[B, nq, nk]`` (packed rows skip what their own documents do not share): ``EMPTY``
  tiles are neither computed nor copied in, ``FULL`` tiles are not masked, and
  ``PARTIAL`` tiles apply :func:`jax_seqpar.core.masks.visible` to the tokens' positions,
  segment and bidirectional ids (chunks and ``mask_fn`` included);
* GQA/MQA read K/V head ``h // group`` through the BlockSpec index map, never a
  repeated copy; the head dim is any size (64 .. 576, ``Dv != Dqk`` for MLA);
* tiles are multiples of 128 tokens (``BlockSizes.check_tpu``), by default
  :func:`default_block_sizes`;
* FP8 (``options.compute``: an FP8 forward, an FP8 or bfloat16 backward): FP8 storage.
  q, k, v (and dout in an FP8 backward) are quantized per token and head outside the
  kernel (:func:`jax_seqpar.kernels.fp8_inputs.inputs`) and enter it as FP8 values
  ``[B, H, S, D]`` with float32 scales as lane-dense rows ``[B, H, 1, S]``; TPU v5p has
  no FP8 matrix unit, so each tile is widened to bfloat16 in VMEM (exactly) for the MXU,
  the scales multiply the float32 scores and are folded into P (v's) and dS (k's, q's)
  before those enter the MXU in bfloat16. No rotation in the kernel (the caller's).

Lowering: Mosaic when the program is lowered for TPU; the Pallas interpreter on any
other platform (chosen with ``lax.platform_dependent``, not the host's backend).
Paper: FlashAttention-2, arXiv:2307.08691.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_seqpar.core import blocks, compat as _compat, masks
from jax_seqpar.kernels.tpu import _bwd as _mosaic_bwd
from jax_seqpar.kernels import contract, fp8_inputs
from jax_seqpar.kernels.tpu import _common as mc
from jax_seqpar.kernels.contract import BlockSizes
from jax_seqpar.kernels.options import Options
from jax_seqpar.kernels.tiling import pad_seq, schedule
from jax_seqpar.core.masks import Tokens

#: The input dtypes the kernel takes (q, k and v share one), the MXU's; no float16.
DTYPES = mc.DTYPES

__all__ = ["DTYPES", "BlockSizes", "attention", "backward", "default_block_sizes", "forward"]


def default_block_sizes(d_qk: int, d_v: int, dtype: jax.typing.DTypeLike) -> BlockSizes:
    """512-token tiles, 256 queries per backward tile, whatever the head dims and dtype:
    the largest that fit VMEM on v5e, v5p and v6e up to MLA's 576/512 head dims
    (held by ``tests/test_mosaic_compile.py``)."""
    del d_qk, d_v, dtype
    return BlockSizes(512, 512, 256, 512)


def _checked(q, k, v, q_tokens, kv_tokens, options: Options) -> Options:
    """Validated operands; the options resolved (:meth:`~jax_seqpar.kernels.options.Options.resolved`)."""
    contract.check_operands(q, k, v, q_tokens, kv_tokens, dtypes=mc.DTYPES, kernel_name=__name__)
    options = options.resolved(default_block_sizes(q.shape[-1], v.shape[-1], q.dtype),
                               __name__)
    if options.block_sizes is not None:  # set by resolved
        options.block_sizes.check_tpu()
    return options


def _forward_kernel(plan_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, *refs, options,
                    precision, accumulate, scaled):
    """One (batch, head, query tile, key tile) step. ``refs``: the FP8 scales' rows
    (``scaled``), the running result ``(out, lse(, max_logit))`` (``accumulate``), the
    outputs ``out [bq, Dv], lse [1, bq]`` (and ``max_logit [1, bq]`` with
    ``options.return_max_logit``), the scratch ``m, l [bq, 128]``, ``acc [bq, Dv]`` (and
    ``high [bq, 128]``, the rows' running max logit before the soft-cap)."""
    track = options.return_max_logit
    results = 3 if track else 2
    scale_refs = None
    if scaled:  # FP8: the per-token scales of q, k, v, rows [1, tile] each
        scale_refs, refs = refs[:3], refs[3:]
    # The result so far, aliased to the outputs: continued in place.
    running, refs = (refs[:results], refs[results:]) if accumulate else ((), refs)
    (out_ref, lse_ref, *max_ref), (m_ref, l_ref, acc_ref, *high_ref) = (refs[:results],
                                                                       refs[results:])
    q_tile, kv_tile = pl.program_id(2), pl.program_id(3)

    @pl.when(kv_tile == 0)
    def _init():
        if accumulate:
            # A normalized (out, lse) is the online state m = lse, l = 1, acc = out: the
            # keys to come merge into it exactly (a row that saw no key so far has
            # lse = EMPTY_LSE and out = 0, and keeps them if it sees none here either).
            # The max logit continues from the running one too.
            out_in, lse_in, *max_in = running
            m_ref[...] = mc.row_to_column(lse_in[...])
            l_ref[...] = jnp.ones(l_ref.shape, mc.F32)
            acc_ref[...] = out_in[...]
            for high, earlier in zip(high_ref, max_in):
                high[...] = mc.row_to_column(earlier[...])
        else:
            m_ref[...] = jnp.full(m_ref.shape, masks.EMPTY_LSE, mc.F32)
            l_ref[...] = jnp.zeros(l_ref.shape, mc.F32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, mc.F32)
            for high in high_ref:
                high[...] = jnp.full(high.shape, -jnp.inf, mc.F32)

    def tile(is_partial):
        # A non-finite value: key NaN, value 0. FP8 tiles widened to bfloat16 first.
        k, v = contract.isolated_keys(mc.widened(k_ref[...]), mc.widened(v_ref[...]))
        scales = None
        if scale_refs is not None:  # q's as a column [bq, 1], k's a row [1, bk]
            scales = (mc.row_to_column(scale_refs[0][...])[:, :1], scale_refs[1][...])
        raw = mc.scaled_products(mc.widened(q_ref[...]), k, options, precision, scales)
        s, _ = mc.capped(raw, options)  # [bq, bk]
        mask = (mc.visible(options.spec, q_tok, kv_tok, rows_are_queries=True)
                if is_partial else None)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        for high in high_ref:  # the max logit: before the cap, over the visible pairs
            seen = raw if mask is None else jnp.where(mask, raw, -jnp.inf)
            high[...] = jnp.maximum(high[...], seen.max(axis=-1, keepdims=True))
        # Statistics are lane-replicated [bq, 128]. m starts at EMPTY_LSE (finite),
        # so a row masked so far gets exp(-inf) = 0, never NaN.
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        p = jnp.exp(s - m_next[:, :1])
        alpha = jnp.exp(m_prev - m_next)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=-1, keepdims=True)
        if scale_refs is not None:  # v's scales vary along the keys: folded into P
            p = p * scale_refs[2][...]
        acc_ref[...] = acc_ref[...] * alpha[:, :1] + mc.dot(p.astype(v.dtype), v,
                                                            precision=precision)
        m_ref[...] = m_next

    mc.run_tile(plan_ref, pl.program_id(0), q_tile, kv_tile, tile)

    @pl.when(kv_tile == pl.num_programs(3) - 1)
    def _finish():
        l = l_ref[...]  # [bq, 128]
        seen = l > 0
        l = jnp.where(seen, l, 1.0)
        out_ref[...] = acc_ref[...] / l[:, :1]
        lse = jnp.where(seen, m_ref[...] + jnp.log(l), masks.EMPTY_LSE)
        lse_ref[...] = mc.column_to_row(lse)
        for out, high in zip(max_ref, high_ref):
            out[...] = mc.column_to_row(high[...])


def forward(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
            options: Options, accumulate: tuple[jax.Array, jax.Array] | None = None):
    """Attention of ``q`` against one run of keys (the contract of :func:`jax_seqpar.kernels.xla.forward`).

    Args:
      q: ``[B, Sq, H, Dqk]``; k: ``[B, Sk, Hkv, Dqk]``; v: ``[B, Sk, Hkv, Dv]``;
        one dtype, float32 or bfloat16 (the MXU inputs), ``H % Hkv == 0``.
      q_tokens, kv_tokens: metadata of the queries (``[B, Sq]``) and keys (``[B, Sk]``).
      options: the call's :class:`~jax_seqpar.kernels.options.Options`: ``spec`` (the
        mask), ``scale``, ``softcap`` (``s -> c * tanh(s / c)``, or None) and
        ``block_sizes`` (multiples of 128; None, or a size left None:
        :func:`default_block_sizes`).
      accumulate: optional ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])`` of
        earlier keys (with ``options.return_max_logit`` also their ``max_logit``:
        :func:`~jax_seqpar.kernels.contract.check_accumulated`); the kernel continues
        it (the online softmax, and the running max logit, start from it) and writes
        the result in its place: no float32 result per call and no merge pass.
    Returns:
      ``out float32[B, Sq, H, Dv]`` (normalized) and ``lse float32[B, Sq, H]``, over
      these keys and those of ``accumulate``; softmax statistics and accumulators in
      float32 whatever the input dtype. With ``options.return_max_logit`` also
      ``max_logit float32[B, Sq, H]``: each row's largest visible logit ``scale * q.k``
      before the soft-cap (``-inf``: none; FP8: of the quantized operands), a running
      max of its own in VMEM, written like ``lse``.

    .. code-block:: python

        q = k = v = jnp.ones((1, 32, 2, 64), jnp.bfloat16)
        tokens = Tokens(jnp.arange(32, dtype=jnp.int32)[None])
        options = make_options(q, MaskSpec.make(causal=True), scale=0.125, kernel="mosaic")
        out, lse = forward(q, k, v, tokens, tokens, options)
        out.shape, out.dtype, lse.shape
        # ((1, 32, 2, 64), dtype('float32'), (1, 32, 2))
    """
    options = _checked(q, k, v, q_tokens, kv_tokens, options)
    contract.check_accumulated(q, v, accumulate, options)
    return _forward(q, k, v, q_tokens, kv_tokens, options, accumulate)  # isolated per tile


@contract.folds_vmap
def _forward(q, k, v, q_tokens, kv_tokens, options: Options, accumulate=None):
    scales = None
    if fp8_inputs.in_kernel(options):  # FP8 storage: values and per-token scales
        (q, k, v), scales = fp8_inputs.inputs(options, q, k, v)
    # Inside shard_map every operand must vary over the same axes (e.g. replicated
    # decode queries against a sharded cache).
    inputs = (q, k, v, q_tokens, kv_tokens, accumulate, scales)
    q, k, v, q_tokens, kv_tokens, accumulate, scales = _compat.match_varying(inputs, inputs)
    t = mc.tiling(q, k, *options.tiles())
    q_tokens, kv_tokens, classes = schedule(options.spec, t, q_tokens, kv_tokens)  # [B, nq, nk]
    (batch, q_len, heads, d_qk), d_v = q.shape, v.shape[-1]
    q_pad, kv_pad, group = t.num_q * t.block_q, t.num_k * t.block_k, t.group

    def kv_map(b, h, i, j, plan_ref):
        # Grid indices are int32; a Python int would be int64 under jax_enable_x64.
        return b, lax.div(h, jnp.int32(group)), mc.fetched(plan_ref, b, i, j), 0

    out_spec = pl.BlockSpec((None, None, t.block_q, d_v), lambda b, h, i, j, _: (b, h, i, 0))
    lse_spec = pl.BlockSpec((None, None, 1, t.block_q), lambda b, h, i, j, _: (b, h, 0, i))
    rows = 2 if options.return_max_logit else 1  # lse (and the max logit), [B, H, 1, Sq_pad]
    out_shape = [jax.ShapeDtypeStruct((batch, heads, q_pad, d_v), mc.F32)] + [
        jax.ShapeDtypeStruct((batch, heads, 1, q_pad), mc.F32)] * rows
    operands = [mc.plan(classes), mc.heads_first(q, q_pad), mc.heads_first(k, kv_pad),
                mc.heads_first(v, kv_pad), mc.column(q_tokens), mc.row(kv_tokens)]
    scale_specs = []
    if scales is not None:  # rows [B, H, 1, S_pad]; k's and v's follow the fetched tile
        operands += mc.scale_rows(scales, (q_pad, kv_pad, kv_pad))
        scale_specs = [lse_spec] + [pl.BlockSpec(
            (None, None, 1, t.block_k),
            lambda b, h, i, j, plan_ref: (b, lax.div(h, jnp.int32(group)), 0,
                                          mc.fetched(plan_ref, b, i, j)))] * 2
    aliases = None
    if accumulate is not None:  # continued in place: its buffers become the outputs
        out_in, lse_in, *max_in = accumulate
        first = len(jax.tree.leaves(operands))
        aliases = {first + i: i for i in range(1 + rows)}
        operands += [mc.heads_first(out_in, q_pad)] + [
            jnp.swapaxes(pad_seq(x, q_pad, fill), 1, 2)[:, :, None]
            for x, fill in zip((lse_in, *max_in), (masks.EMPTY_LSE, -jnp.inf))]
    call = mc.pallas(
        functools.partial(_forward_kernel, options=options, precision=mc.precision(q.dtype),
                          accumulate=accumulate is not None, scaled=scales is not None),
        name="seqpar_mosaic_forward",
        grid=(batch, heads, t.num_q, t.num_k),
        in_specs=[
            pl.BlockSpec((None, None, t.block_q, d_qk), lambda b, h, i, j, _: (b, h, i, 0)),
            pl.BlockSpec((None, None, t.block_k, d_qk), kv_map),
            pl.BlockSpec((None, None, t.block_k, d_v), kv_map),
            mc.token_specs(q_tokens, (None, t.block_q, 1), lambda b, h, i, j, _: (b, i, 0)),
            mc.token_specs(kv_tokens, (None, 1, t.block_k),
                           lambda b, h, i, j, plan_ref: (b, 0, mc.fetched(plan_ref, b, i, j))),
        ] + scale_specs + ([out_spec] + [lse_spec] * rows if accumulate is not None else []),
        out_specs=[out_spec] + [lse_spec] * rows,
        out_shape=out_shape,
        scratch_shapes=[mc.vmem((t.block_q, mc.LANES)), mc.vmem((t.block_q, mc.LANES)),
                        mc.vmem((t.block_q, d_v))] + [mc.vmem((t.block_q, mc.LANES))] * (rows - 1),
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
        like=q,
        cost_estimate=mc.cost(flops=2 * batch * heads * q_pad * kv_pad * (d_qk + d_v),
                              transcendentals=batch * heads * q_pad * kv_pad,
                              arrays=(operands[1:4], out_shape, accumulate)),
        input_output_aliases=aliases,
    )
    out, *stats = call(*operands)
    return (mc.tokens_first(out, q_len), *(jnp.swapaxes(x[:, :, 0, :q_len], 1, 2) for x in stats))


def backward(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
             lse: jax.Array, delta: jax.Array, dout: jax.Array, options: Options,
             accumulate: tuple[jax.Array, jax.Array] | None = None):
    """Gradients of attention given the softmax statistics of the full result.

    Args:
      q, k, v, q_tokens, kv_tokens, options: as in :func:`forward`.
      lse: ``float32[B, Sq, H]`` log-sum-exp of the (possibly merged) result.
      delta: ``float32[B, Sq, H]`` = ``sum(dout * out, -1) - dlse``.
      dout: ``[B, Sq, H, Dv]`` cotangent of the (merged) output; it enters the
        matmuls in ``v.dtype``.
      accumulate: optional float32 ``(dq, dk, dv)`` the gradients are added to (dq in
        the dq kernel, in place).
    Returns:
      float32 ``dq [B, Sq, H, Dqk]``, ``dk [B, Sk, Hkv, Dqk]``, ``dv [B, Sk, Hkv, Dv]``
      (plus ``accumulate``).
    """
    options = _checked(q, k, v, q_tokens, kv_tokens, options)
    contract.check_backward_operands(q, v, lse, delta, dout)
    # dq accumulates in the dq kernel, in place; dk, dv are added after (a ring's
    # overlapped backward computes them fresh while the accumulators travel).
    # Non-finite numbers isolated per tile, in VMEM (contract.isolated_grads' rules).
    dq, dk, dv = _mosaic_bwd.backward(
        q, k, v, q_tokens, kv_tokens, lse, delta, dout, options,
        dq_in=None if accumulate is None else accumulate[0])
    if accumulate is None:
        return dq, dk, dv
    return (dq, *contract.add_accumulated((dk, dv), accumulate[1:]))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
              options: Options):
    """Differentiable :func:`forward`: ``(out float32, lse float32)`` (and the max logit
    with ``options.return_max_logit``: no gradient), through
    :func:`jax_seqpar.kernels.contract.differentiable`.

    Its VJP runs the Mosaic ``dq`` and ``dk, dv`` kernels (:func:`backward`) and takes
    cotangents for ``out`` AND ``lse`` (merged ring results differentiate exactly);
    it saves ``out`` in the input dtype and ``lse`` in float32.

    .. code-block:: python

        q = k = v = jnp.ones((1, 32, 2, 64), jnp.float32)
        tokens = Tokens(jnp.arange(32, dtype=jnp.int32)[None])
        options = make_options(q, MaskSpec(), scale=0.125, kernel="mosaic")
        loss = lambda q: attention(q, k, v, tokens, tokens, options)[0].sum()
        jax.grad(loss)(q).shape
        # (1, 32, 2, 64)
    """
    return _attention(q, k, v, q_tokens, kv_tokens, _checked(q, k, v, q_tokens, kv_tokens,
                                                                options))


_attention = contract.differentiable(_forward, _mosaic_bwd.backward)
