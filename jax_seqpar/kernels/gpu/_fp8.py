"""The Triton kernels' FP8 bodies (:mod:`.pallas`, :mod:`._bwd`): FlashAttention-3's
scaled FP8 products on H100/H200 (sm_90a; Triton's FP8 ``tl.dot``, float32 accumulation).

The operands arrive quantized (:func:`jax_seqpar.kernels.fp8_inputs.inputs`, outside the
``pallas_call``): q, k, v values in the FP8 format ``[.., tile, D]`` and their per-token
scales float32 ``[B, H, S]`` (one row per head, loaded as ``[tile]``). Per tile:

* forward: ``s = (q8 · k8ᵀ) * q_scale[:, None] * k_scale[None, :]`` (FP8 x FP8, float32
  accumulation, the scales applied to the float32 scores), the online softmax in float32
  (``exp2`` domain); V's per-token scale folded into ``P`` (it varies along the
  contracted keys), ``P`` rounded to FP8 with its own amax scale per (head, tile)
  (:func:`rounded`), ``P8 · v8`` times that scale;
* backward (:func:`dq_kernel`, :func:`dkv_kernel`): the scores recomputed from the same
  q8 and k8 (the forward's probabilities); ``dP = dO · Vᵀ`` with dO's and V's scales on
  the float32 product; ``dQ = dS · K``, ``dK = dSᵀ · Q``, ``dV = Pᵀ · dO`` with the
  contracted operand's per-token scale folded into ``dS`` / ``P`` and those rounded
  per (head, tile) like ``P``. In an FP8 backward dO arrives quantized per token and
  every product is FP8 x FP8; in a bfloat16 backward dO arrives in bfloat16 with no
  scale, q8, k8 and v8 are widened to bfloat16 in registers (exact) and ``P``, ``dS``
  rounded to bfloat16: bfloat16 products on the dequantized operands. dQ, dK, dV
  accumulate in float32.

No rotation here: the Hadamard rotation is the caller's (:mod:`jax_seqpar.kernels.fp8_inputs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_seqpar.core import quant
from jax_seqpar.kernels.gpu import _core as core

__all__ = ["dkv_kernel", "dq_kernel", "forward_kernel", "rounded"]


def rounded(x, dtype):
    """A float32 tile ``x [m, n]`` as a product's operand in ``dtype``: ``(values, scale)``,
    ``x ≈ values * scale``. FP8: one scale for the tile, ``amax / finfo.max`` of its
    finite entries (1 where all are zero; non-finite entries stay non-finite and reach no
    scale); other dtypes: ``x`` rounded, scale None."""
    if not quant.is_fp8(jnp.dtype(dtype).name):
        return x.astype(dtype), None
    largest = float(jnp.finfo(dtype).max)
    magnitude = jnp.abs(x)
    amax = jnp.max(jnp.max(jnp.where(magnitude < jnp.inf, magnitude, 0.0), axis=1), axis=0)
    scale = jnp.where(amax > 0, amax * (1.0 / largest), 1.0)
    values = jnp.clip(x * (1.0 / scale), -largest, largest)
    return values.astype(dtype), scale


def _times(x, factor):
    """``x * factor`` (None: ``x``)."""
    return x if factor is None else x * factor


def _operand(x, dtype):
    """An FP8 operand tile in the product's ``dtype`` (bfloat16 holds every FP8 value)."""
    return x if x.dtype == dtype else x.astype(dtype)


def forward_kernel(bounds_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, qs_ref, ks_ref, vs_ref,
                   out_ref, lse_ref, max_ref=None, *, options, block_k, d_qk, d_v, has_mask,
                   precision):
    """One (query tile, batch, head) program: ``q_ref [bq, Dqk]``, ``k_ref, v_ref [Sk_pad,
    D]`` FP8, ``qs_ref float32[bq]``, ``ks_ref, vs_ref float32[Sk_pad]`` -> ``out_ref
    float32[bq, Dv]``, ``lse_ref float32[bq]`` and, with ``options.return_max_logit``,
    ``max_ref float32[bq]``: the max logit of the quantized operands, their scales
    applied (:func:`._core.visible_scores`)."""
    dtype = jnp.dtype(options.compute.dtype)
    rows = slice(None)
    q_tile = core.token_tile(q_tok, rows)
    q_cols = None if d_qk.count > 1 else d_qk.load_all(q_ref, rows)
    q_scale = qs_ref[...]

    def step(j, carry, masked):
        acc, m, l, *high = carry  # parts of [bq, Dv], [bq], [bq] (, [bq]); log2 units
        window = pl.ds(j * block_k, block_k)
        k_cols = d_qk.load_all(k_ref, window)
        v_cols = d_v.load_all(v_ref, window)
        k_scale, v_scale = ks_ref[window], vs_ref[window]
        q_now = d_qk.load_all(q_ref, rows) if q_cols is None else q_cols
        mask = (core.tile_mask(options.spec, q_tile, core.token_tile(kv_tok, window))
                if masked else None)
        s, high = core.visible_scores(q_now, k_cols, options, precision, mask, high,
                                      (q_scale, k_scale))
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp2(s - m_new[:, None])
        alpha = jnp.exp2(m - m_new)
        p_values, p_scale = rounded(p * v_scale[None, :], dtype)
        acc = tuple(a * alpha[:, None] + _times(core.dot(p_values, v, (1, 0), precision), p_scale)
                    for a, v in zip(acc, v_cols))
        return (acc, m_new, l * alpha + p.sum(axis=-1), *high)

    core.online_softmax(bounds_ref, step, d_v, out_ref, lse_ref, max_ref, has_mask=has_mask)


def _grad_tile(q_cols, k_cols, v_cols, do_cols, lse2, delta, mask, options, precision,
               scales, dtype):
    """``(p, ds)`` of one tile ``[bq, bk]`` (float32): the forward's probabilities from
    q8, k8 and their scales, and the gradient of the raw scores (unscaled).
    ``scales``: ``(q [bq], k [bk], v [bk], dout [bq] | None)``."""
    q_scale, k_scale, v_scale, do_scale = scales
    s, tanh = core.scores(q_cols, k_cols, options, precision, (q_scale, k_scale))
    p = jnp.exp2(s - lse2[:, None])
    if mask is not None:  # after the lse: a NaN one stays off invisible pairs
        p = jnp.where(mask, p, 0.0)
    dp = core.dot_cols(do_cols, [_operand(v, dtype) for v in v_cols], (1, 1), precision)
    dp = dp * v_scale[None, :]
    if do_scale is not None:
        dp = dp * do_scale[:, None]
    ds = p * (dp - delta[:, None])
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    return p, ds


def _split_refs(rest, outputs: int):
    """``(dout scales ref | None, *outputs)`` of a backward kernel's trailing refs."""
    return tuple(rest) if len(rest) > outputs else (None, *rest)


def dq_kernel(bounds_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, do_ref, lse_ref, delta_ref,
              qs_ref, ks_ref, vs_ref, *rest, options, block_k, d_qk, d_v, has_mask,
              precision):
    """One (query tile, batch, head) program of dq: the operands of :func:`forward_kernel`,
    ``do_ref [bq, Dv]`` (FP8 or bfloat16), ``lse_ref, delta_ref float32[bq]``, then
    ``dos_ref float32[bq]`` in an FP8 backward -> ``dq_ref float32[bq, Dqk]``."""
    dos_ref, dq_ref = _split_refs(rest, 1)
    dtype = jnp.dtype(options.compute.backward)
    rows = slice(None)
    q_tile = core.token_tile(q_tok, rows)
    q_cols = None if d_qk.count > 1 else d_qk.load_all(q_ref, rows)
    do_cols = d_v.load_all(do_ref, rows)
    lse2, delta = lse_ref[...] * core.LOG2E, delta_ref[...]  # [bq]
    q_scale = qs_ref[...]
    do_scale = None if dos_ref is None else dos_ref[...]

    def step(j, dq, masked):
        window = pl.ds(j * block_k, block_k)
        k_cols = d_qk.load_all(k_ref, window)
        v_cols = d_v.load_all(v_ref, window)
        k_scale = ks_ref[window]
        q_now = d_qk.load_all(q_ref, rows) if q_cols is None else q_cols
        mask = (core.tile_mask(options.spec, q_tile, core.token_tile(kv_tok, window))
                if masked else None)
        _, ds = _grad_tile(q_now, k_cols, v_cols, do_cols, lse2, delta, mask, options,
                           precision, (q_scale, k_scale, vs_ref[window], do_scale), dtype)
        ds_values, ds_scale = rounded(ds * k_scale[None, :], dtype)
        return tuple(a + _times(core.dot(ds_values, _operand(k, dtype), (1, 0), precision),
                                ds_scale) for a, k in zip(dq, k_cols))

    dq = core.run_tiles(bounds_ref, step, d_qk.zeros(q_ref.shape[0]), has_mask=has_mask)
    for c, a in enumerate(dq):
        d_qk.store(dq_ref, c, a * options.scale)


def dkv_kernel(bounds_ref, q_ref, k_ref, v_ref, q_tok, kv_tok, do_ref, lse_ref, delta_ref,
               qs_ref, ks_ref, vs_ref, *rest, options, block_q, d_qk, d_v, has_mask,
               precision):
    """One (key tile, batch, kv head split) program of dk, dv: ``q_ref [Sq_pad, heads,
    Dqk]``, ``do_ref [Sq_pad, heads, Dv]``, ``k_ref, v_ref [bk, D]``, ``qs_ref, lse_ref,
    delta_ref (, dos_ref) float32[heads, Sq_pad]``, ``ks_ref, vs_ref float32[bk]`` ->
    ``dk_ref float32[bk, Dqk]``, ``dv_ref float32[bk, Dv]``."""
    dos_ref, dk_ref, dv_ref = _split_refs(rest, 2)
    dtype = jnp.dtype(options.compute.backward)
    cols = slice(None)
    kv_tile = core.token_tile(kv_tok, cols)
    k_cols = d_qk.load_all(k_ref, cols)
    v_cols = d_v.load_all(v_ref, cols)
    k_scale, v_scale = ks_ref[...], vs_ref[...]
    heads = q_ref.shape[1]

    def head_body(head, carry):
        def step(i, carry, masked):
            dk, dv = carry
            window = pl.ds(i * block_q, block_q)
            q_cols = d_qk.load_all(q_ref, window, head)
            do_cols = d_v.load_all(do_ref, window, head)
            q_scale = qs_ref[head, window]
            do_scale = None if dos_ref is None else dos_ref[head, window]
            mask = (core.tile_mask(options.spec, core.token_tile(q_tok, window), kv_tile)
                    if masked else None)
            p, ds = _grad_tile(q_cols, k_cols, v_cols, do_cols, lse_ref[head, window] * core.LOG2E,
                               delta_ref[head, window], mask, options, precision,
                               (q_scale, k_scale, v_scale, do_scale), dtype)
            p_values, p_scale = rounded(p if do_scale is None else p * do_scale[:, None], dtype)
            dv = tuple(a + _times(core.dot(p_values, do, (0, 0), precision), p_scale)
                       for a, do in zip(dv, do_cols))
            ds_values, ds_scale = rounded(ds * q_scale[:, None], dtype)
            dk = tuple(a + _times(core.dot(ds_values, _operand(q, dtype), (0, 0), precision),
                                  ds_scale) for a, q in zip(dk, q_cols))
            return dk, dv

        return core.run_tiles(bounds_ref, step, carry, has_mask=has_mask)

    block_k = k_ref.shape[0]
    init = (d_qk.zeros(block_k), d_v.zeros(block_k))
    dk, dv = (head_body(jnp.int32(0), init) if heads == 1
              else jax.lax.fori_loop(0, heads, head_body, init))
    for c, a in enumerate(dk):
        d_qk.store(dk_ref, c, a * options.scale)
    for c, a in enumerate(dv):
        d_v.store(dv_ref, c, a)
