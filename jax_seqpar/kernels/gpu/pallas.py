"""Pallas flash attention (FlashAttention-2): the GPU kernel, with the contract of ``xla.py``.

The kernel contract (:mod:`jax_seqpar.kernels.contract`), like
:mod:`jax_seqpar.kernels.xla`: :func:`forward` -> ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])``
(and ``max_logit float32[B, Sq, H]`` with ``options.return_max_logit``),
:func:`backward` (given the final ``lse`` and ``delta = sum(dout * out, -1) - dlse``)
-> float32 ``(dq, dk, dv)``, and :func:`attention`, a ``custom_vjp`` of both that
takes cotangents for ``out`` AND ``lse``.

How the work is cut:

* forward: one program per (query tile, batch, head) loops over key tiles with an
  online softmax (scores, statistics and accumulator in float32, ``exp2`` domain);
* backward: one kernel per (query tile, batch, head) accumulates ``dq`` over key
  tiles, one per (key tile, batch, kv head, head split) accumulates ``dk, dv`` over
  the query tiles of its share of the GQA group (``_pallas_bwd``);
* the tile classes of :func:`jax_seqpar.core.blocks.classify` are reduced, outside the
  kernels and a few hundred rows at a time (O(B * S) memory, no ``[nq, nk]`` table),
  to loop bounds per batch row and row of tiles (``[B, n, 4]``: packed rows skip what
  their own documents do not share): the first..last non-``EMPTY`` tile and the run
  of ``FULL`` tiles inside it. Each program runs three plain loops (masked,
  unmasked, masked) with every load at a loop's top level, so Triton pipelines
  them; the elementwise mask (:func:`jax_seqpar.core.masks.visible` on the position /
  segment tiles) is computed only outside the ``FULL`` run, and an ``EMPTY`` tile
  between visible ones is computed fully masked;
* GQA/MQA read K/V head ``h // group`` through the BlockSpec index map, never a
  repeated copy; ragged lengths are padded to whole tiles with segment sentinels
  (padded queries see nothing, padded keys are seen by nobody); head dims are
  never padded in memory: a dim up to 256 is one power-of-two part with masked
  loads and stores past the real dim, a wider one (MLA's 576 / 512) a loop of
  few power-of-two parts (``_pallas_core.HeadDim``);
* tiles, warps and pipeline stages default per head dim and dtype
  (:func:`default_block_sizes`, ``_pallas_config``) to sizes that compile
  without register spills and within shared memory on A100 (sm_80) and H100/H200
  (sm_90);
* float32 inputs: every dot is TF32x3 (three TF32 tensor-core products, about
  3e-7 relative error on the output against float64, like float32's 5e-7), never
  the IEEE-FMA path; the interpreter emulates the same split, so CPU tests hold
  the GPU's arithmetic to the float32 tolerance. Head dims over 128 in float32
  still spill in the backward (bf16 / fp16 do not; :func:`compiles_clean`), so
  ``kernel="auto"`` runs the XLA kernel for them on GPU: cast to run this one;
* FP8 (``options.compute``: an FP8 forward with an FP8 or bfloat16 backward, H100/H200,
  sm_90a): q, k, v (and dout) quantized per token and head outside the ``pallas_call``
  (:func:`jax_seqpar.kernels.fp8_inputs.inputs`), FP8 x FP8 dots with float32
  accumulation, P (and dS) rounded to FP8 per (head, tile) with the other operand's
  per-token scale folded in (FlashAttention-3; the bodies in ``_fp8``), tiles of their
  own (:func:`default_block_sizes` for the FP8 dtype); ``kernel="auto"`` runs them on
  GPUs with FP8 matrix units (compute capability 8.9+) at head dims 64, 128, 256
  (:func:`compiles_clean`), the XLA kernel's FP8 GEMMs otherwise;
* decode-sized queries (under 16 tokens) of a GQA/MQA group are folded into the
  rows of one program per kv head: each K/V tile is read once per group; a call
  with one query tile per (batch, head) and too few programs to fill the GPU
  splits the keys into runs, one program each, merged by their softmax statistics
  (split-K, ``_decode.kv_splits``).

Lowering: by the platform the program is lowered for (``jax.lax.platform_dependent``):
Triton when lowering for CUDA / ROCm, the Pallas interpreter elsewhere, so AOT
compilation and ``jax.export`` for a GPU from a CPU host produce the real kernel.
Paper: FlashAttention-2, arXiv:2307.08691.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_seqpar.core import blocks, compat as _compat, masks
from jax_seqpar.kernels.gpu import _bwd as _pallas_bwd
from jax_seqpar.kernels import contract, fp8_inputs
from jax_seqpar.kernels.gpu import _fp8
from jax_seqpar.kernels.gpu import _config as config
from jax_seqpar.kernels.gpu import _core as core
from jax_seqpar.kernels.gpu import _decode as decode
from jax_seqpar.kernels.gpu._config import compiles_clean, default_block_sizes, gpu_capability
from jax_seqpar.kernels.contract import BlockSizes
from jax_seqpar.kernels.options import Options
from jax_seqpar.kernels.gpu._core import HeadDim
from jax_seqpar.kernels.tiling import pad_seq, padded_tokens
from jax_seqpar.core.masks import Tokens

#: The input dtypes the kernel takes (q, k and v share one).
DTYPES = core.DTYPES

__all__ = ["DTYPES", "BlockSizes", "attention", "backward", "compiles_clean",
           "default_block_sizes", "forward"]

_F32 = core.F32


def _forward_kernel(bounds_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, out_ref, lse_ref,
                    max_ref=None, *, options, block_k, d_qk, d_v, has_mask, precision):
    """One (query tile, batch, head) program: ``q_ref [bq, Dqk]``, ``k_ref, v_ref [Sk_pad,
    D]`` -> ``out_ref float32[bq, Dv]``, ``lse_ref float32[bq]`` and, with
    ``options.return_max_logit``, ``max_ref float32[bq]`` (:func:`_core.visible_scores`)."""
    rows = slice(None)
    q_tile = core.token_tile(q_tok, rows)
    # Wide (split) queries are re-read per step (L2 hits) rather than held in
    # registers next to a wide accumulator.
    q_cols = None if d_qk.count > 1 else d_qk.load_all(q_ref, rows)

    def step(j, carry, masked):
        acc, m, l, *high = carry  # parts of [bq, Dv], [bq], [bq] (, [bq]); log2 units
        window = pl.ds(j * block_k, block_k)
        k_cols = d_qk.load_all(k_ref, window)
        v_cols = d_v.load_all(v_ref, window)
        q_now = d_qk.load_all(q_ref, rows) if q_cols is None else q_cols
        mask = (core.tile_mask(options.spec, q_tile, core.token_tile(kv_tok, window))
                if masked else None)
        s, high = core.visible_scores(q_now, k_cols, options, precision, mask, high)
        # m starts at EMPTY_LSE (finite), so fully masked rows give exp2(-inf) = 0.
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp2(s - m_new[:, None])
        alpha = jnp.exp2(m - m_new)
        acc = tuple(a * alpha[:, None] + core.dot(p.astype(v.dtype), v, (1, 0), precision)
                    for a, v in zip(acc, v_cols))
        return (acc, m_new, l * alpha + p.sum(axis=-1), *high)

    core.online_softmax(bounds_ref, step, d_v, out_ref, lse_ref, max_ref, has_mask=has_mask)


def _validate(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, options: Options,
              interpret: Optional[bool]) -> Options:
    """Checked operands; the options resolved (:meth:`~jax_seqpar.kernels.options.Options.resolved`, tiles from
    :func:`default_block_sizes`). Tiles must suit Triton unless ``interpret=True``."""
    contract.check_operands(q, k, v, q_tokens, kv_tokens, dtypes=core.DTYPES,
                            kernel_name=__name__)
    spec = options.spec
    rich = (spec.chunk_size is not None or spec.mask_fn is not None
            or q_tokens.bidirectional_ids is not None)
    # FP8 (fp8_inputs.in_kernel): the tiles of its products' dtype.
    compute = options.compute
    dtype, fp8 = options.products_dtype(q.dtype), fp8_inputs.in_kernel(options)
    options = options.resolved(
        default_block_sizes(q.shape[-1], v.shape[-1], dtype, rich_mask=rich), __name__)
    capability = gpu_capability()  # on a GPU host: the call runs there
    if (fp8 and interpret is not True and capability
            and not compiles_clean(q.shape[-1], v.shape[-1], dtype)):
        raise ValueError(
            f"compute_dtype={compute} with kernel='pallas' runs the FP8 Triton kernel, which "
            f"needs FP8 matrix units (compute capability 8.9 or later: H100/H200, Ada; this "
            f"GPU's is {'.'.join(map(str, capability))}) and head dims in "
            f"{config.FP8_HEAD_DIMS} (q/k and v alike; got {q.shape[-1]} and {v.shape[-1]}). "
            "Pass kernel='auto' or kernel='xla' (the XLA kernel's FP8 products), or "
            "compute_dtype=jnp.bfloat16.")
    if interpret is not True and options.block_sizes is not None:  # may lower for a GPU
        options.block_sizes.check_gpu()
    return options


def forward(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
            options: Options, accumulate: tuple[jax.Array, jax.Array] | None = None, *,
            interpret: Optional[bool] = None):
    """Attention of ``q`` against one run of keys (the contract of :func:`jax_seqpar.kernels.xla.forward`).

    Args:
      q: ``[B, Sq, H, Dqk]``; k: ``[B, Sk, Hkv, Dqk]``; v: ``[B, Sk, Hkv, Dv]``;
        one dtype among float32 / bfloat16 / float16, ``H % Hkv == 0``.
      q_tokens, kv_tokens: metadata of the queries (``[B, Sq]``) and keys (``[B, Sk]``).
      options: the call's :class:`~jax_seqpar.kernels.options.Options`: ``spec`` (the
        mask), ``scale``, ``softcap`` (logits ``s = scale * q.k`` become
        ``softcap * tanh(s / softcap)`` before masking, Gemma 2; None: no cap) and
        ``block_sizes`` (powers of two >= 16 unless ``interpret=True``; None, or a size
        left None: :func:`default_block_sizes` for the head dims and dtype).
      interpret: None: Triton when the program is lowered for a GPU, the Pallas
        interpreter elsewhere; True / False force one.
      accumulate: optional ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])`` of
        earlier keys (with ``options.return_max_logit`` also their ``max_logit``),
        merged with this call's result after the kernel
        (:func:`jax_seqpar.kernels.contract.merge_accumulated`; the max logits by
        ``maximum``).
    Returns:
      ``out float32[B, Sq, H, Dv]`` (normalized) and ``lse float32[B, Sq, H]``;
      softmax statistics and accumulators in float32 whatever the input dtype.
      float32 inputs take TF32x3 dots on GPU (float32-level error on tensor cores).
      With ``options.return_max_logit`` also ``max_logit float32[B, Sq, H]``: each row's
      largest visible logit ``scale * q.k`` before the soft-cap (``-inf``: none; FP8: of
      the quantized operands), a running max of its own in the kernel, written like
      ``lse``.

    .. code-block:: python

        q = k = v = jnp.ones((1, 32, 2, 16), jnp.bfloat16)
        tokens = Tokens(jnp.arange(32, dtype=jnp.int32)[None])
        options = make_options(q, MaskSpec.make(causal=True), scale=0.25, kernel="pallas")
        out, lse = forward(q, k, v, tokens, tokens, options)
        out.shape, out.dtype, lse.shape
        # ((1, 32, 2, 16), dtype('float32'), (1, 32, 2))
    """
    options = _validate(q, k, v, q_tokens, kv_tokens, options, interpret)
    contract.check_accumulated(q, v, accumulate, options)
    return contract.merge_accumulated(
        _forward(*contract.isolated(q, k, v), q_tokens, kv_tokens, options, interpret),
        accumulate)


@contract.folds_vmap
def _forward(q, k, v, q_tokens, kv_tokens, options: Options, interpret: Optional[bool]):
    if not fp8_inputs.in_kernel(options):
        return _attend(q, k, v, q_tokens, kv_tokens, options, interpret)
    # FP8 (FlashAttention-3): quantized per token and head outside the kernel (_fp8).
    (q, k, v), scales = fp8_inputs.inputs(options, q, k, v)
    return _attend(q, k, v, q_tokens, kv_tokens, options, interpret, scales)


def _attend(q, k, v, q_tokens, kv_tokens, options: Options, interpret: Optional[bool],
            scales=None, may_split=True):
    """The forward's ``pallas_call``: ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])``,
    and ``max_logit float32[B, Sq, H]`` last with ``options.return_max_logit``.
    ``scales``: FP8 operands' per-token ``(q [B, Sq, H], k [B, Sk, Hkv], v [B, Sk, Hkv])``
    float32 scales (:mod:`._fp8`'s kernel), or None."""
    # Inside shard_map every operand must vary over the same axes (e.g. replicated
    # decode queries against a sharded cache).
    q, k, v, q_tokens, kv_tokens, scales = _compat.match_varying(
        (q, k, v, q_tokens, kv_tokens, scales), (q, k, v, q_tokens, kv_tokens))
    (q_len, heads), kv_heads = q.shape[1:3], k.shape[2]
    if decode.folds_group(q_len, heads, kv_heads):
        group = heads // kv_heads
        folded = None if scales is None else (decode.fold(scales[0], kv_heads), *scales[1:])
        results = _attend(decode.fold(q, kv_heads), k, v, decode.fold_tokens(q_tokens, group),
                          kv_tokens, options, interpret, folded)
        return tuple(decode.unfold(x, group) for x in results)
    spec = options.spec
    t = core.tiling(q, k, *options.tiles())
    splits = decode.kv_splits(t.batch * heads, t.num_q, t.kv_len, t.block_k) if may_split else 1
    if splits > 1:  # a decode step: split-K over the cache, then merge
        if scales is not None:
            qs, ks, vs = scales
            scales = decode.split_kv(splits, qs, ks, vs, q_tokens, kv_tokens, t)[:3]
        q, k, v, q_tokens, kv_tokens = decode.split_kv(splits, q, k, v, q_tokens, kv_tokens, t)
        return decode.merge_splits(splits, *_attend(q, k, v, q_tokens, kv_tokens, options,
                                                    interpret, scales, may_split=False))
    q_tokens, kv_tokens = padded_tokens(t, q_tokens, kv_tokens)
    d_qk, d_v = HeadDim.of(q.shape[-1]), HeadDim.of(v.shape[-1])
    q_pad, kv_pad = t.num_q * t.block_q, t.num_k * t.block_k
    kernel: Callable = _forward_kernel
    in_specs: list = []
    extra: list = []
    name = "seqpar_flash_forward"
    if scales is not None:  # FP8 values and their per-token scales, [B, H, S_pad] each
        kernel, name = _fp8.forward_kernel, name + "_fp8"
        in_specs = [pl.BlockSpec((None, None, t.block_q), lambda i, b, h: (b, h, i))] + [
            pl.BlockSpec((None, None, kv_pad), lambda i, b, h: (b, h // t.group, 0))] * 2
        extra = [jnp.swapaxes(pad_seq(x, n), 1, 2) for x, n in zip(scales, (q_pad, kv_pad, kv_pad))]
    body = functools.partial(kernel, options=options, block_k=t.block_k, d_qk=d_qk,
                             d_v=d_v, has_mask=core.masked(spec, q_tokens))
    # Per-row results: the lse and (options.return_max_logit) the max logit, [B, H, Sq_pad].
    rows = 2 if options.return_max_logit else 1
    out, *stats = core.call(
        body, interpret=interpret, precision_dtype=q.dtype,
        grid=(t.num_q, t.batch, heads),
        in_specs=core.query_row_specs(t, q_tokens, kv_tokens, d_qk, d_v) + in_specs,
        out_specs=[
            pl.BlockSpec((None, t.block_q, None, d_v.padded), lambda i, b, h: (b, i, h, 0)),
        ] + [pl.BlockSpec((None, None, t.block_q), lambda i, b, h: (b, h, i))] * rows,
        out_shape=[_compat.shape_struct((t.batch, q_pad, heads, d_v.size), _F32, q)]
        + [_compat.shape_struct((t.batch, heads, q_pad), _F32, q)] * rows,
        compiler_params=config.launch("fwd", t.block_q, d_qk.size, d_v.size, q.dtype),
        name=name,
    )(core.tile_bounds(spec, t, q_tokens, kv_tokens), pad_seq(q, q_pad), pad_seq(k, kv_pad), pad_seq(v, kv_pad),
      q_tokens, kv_tokens, *extra)
    return (out[:, :t.q_len], *(jnp.swapaxes(x, 1, 2)[:, :t.q_len] for x in stats))


def backward(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
             lse: jax.Array, delta: jax.Array, dout: jax.Array, options: Options,
             accumulate: tuple[jax.Array, jax.Array] | None = None, *,
             interpret: Optional[bool] = None):
    """Gradients of attention given the softmax statistics of the full result.

    Args:
      q, k, v, q_tokens, kv_tokens, options, interpret: as in :func:`forward`.
      lse: ``float32[B, Sq, H]`` log-sum-exp of the (possibly merged) result.
      delta: ``float32[B, Sq, H]`` = ``sum(dout * out, -1) - dlse``.
      dout: ``[B, Sq, H, Dv]`` cotangent of the (merged) output; it enters the
        matmuls in ``v.dtype``.
      accumulate: optional float32 ``(dq, dk, dv)`` the gradients are added to.
    Returns:
      float32 ``dq [B, Sq, H, Dqk]``, ``dk [B, Sk, Hkv, Dqk]``, ``dv [B, Sk, Hkv, Dv]``
      (plus ``accumulate``).
    """
    options = _validate(q, k, v, q_tokens, kv_tokens, options, interpret)
    contract.check_backward_operands(q, v, lse, delta, dout)
    k, v, lse, delta = contract.isolated_grads(k, v, lse, delta)
    grads = _pallas_bwd.backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options,
                                 interpret)
    return contract.add_accumulated(grads, accumulate)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
              options: Options, *, interpret: Optional[bool] = None):
    """Differentiable :func:`forward`: ``(out float32, lse float32)`` (and the max logit
    with ``options.return_max_logit``: no gradient, its cotangent ignored).

    The backward (:func:`backward`) accepts cotangents for both ``out`` and ``lse``,
    so merged partial results (ring attention) differentiate exactly. The residual
    ``out`` is kept in the input dtype (``lse`` in float32).

    .. code-block:: python

        q = k = v = jnp.ones((1, 32, 2, 16), jnp.float32)
        tokens = Tokens(jnp.arange(32, dtype=jnp.int32)[None])
        options = make_options(q, MaskSpec(), scale=0.25, kernel="pallas")
        loss = lambda q: attention(q, k, v, tokens, tokens, options)[0].sum()
        jax.grad(loss)(q).shape
        # (1, 32, 2, 16)
    """
    options = _validate(q, k, v, q_tokens, kv_tokens, options, interpret)
    return _attention(q, k, v, q_tokens, kv_tokens, options, interpret)


_attention = contract.differentiable(_forward, _pallas_bwd.backward)
