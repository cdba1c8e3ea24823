"""Pallas flash attention (FlashAttention-2): the GPU kernel, with the contract of ``xla.py``.

Same functions, arguments and results as :mod:`jax_seqpar.kernels.xla`:
:func:`forward` -> ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])``,
:func:`backward` (given the final ``lse`` and ``delta = sum(dout * out, -1) - dlse``)
-> float32 ``(dq, dk, dv)``, and :func:`attention`, a ``custom_vjp`` of both that
takes cotangents for ``out`` AND ``lse``.

How the work is cut:

* forward: one program per (query tile, batch, head) loops over key tiles with an
  online softmax (scores, statistics and accumulator in float32, ``exp2`` domain);
* backward: one kernel per (query tile, batch, head) accumulates ``dq`` over key
  tiles, one per (key tile, batch, kv head) accumulates ``dk, dv`` over the query
  tiles of every head of its GQA group (:mod:`._pallas_bwd`);
* every (query tile, key tile) pair is classified outside the kernel
  (:func:`jax_seqpar.masks.classify`); each program loops only over its first..last
  non-``EMPTY`` tile, branches over ``EMPTY`` tiles inside that range, and applies
  the elementwise mask (:func:`jax_seqpar.masks.visible` on the position / segment
  tiles) only on ``PARTIAL`` tiles;
* GQA/MQA read K/V head ``h // group`` through the BlockSpec index map, never a
  repeated copy; ragged lengths are padded to whole tiles with segment sentinels
  (padded queries see nothing, padded keys are seen by nobody), head dims to a
  power of two >= 16 with zeros (exact; Triton needs power-of-two tensors).

Lowering: Triton through ``pl.pallas_call`` on GPU; elsewhere the same kernels run
with ``interpret=True`` (chosen per call from ``jax.default_backend()``). A TPU
(Mosaic) variant would sit beside this module with its own grid and BlockSpecs.
Paper: FlashAttention-2, arXiv:2307.08691.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_seqpar import _compat, masks
from jax_seqpar.kernels.tiling import Tiling, pad_seq, schedule
from jax_seqpar.masks import MaskSpec, Tokens

_F32 = jnp.float32
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
#: Smallest tile / head dim Triton's ``tl.dot`` takes; tiles are clipped to no less.
_MIN_DIM = 16
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (clipped to the padded sequence length; ragged tails are padded).

    On GPU every size must be a power of two >= 16 (Triton); the CPU interpreter
    takes any positive size.

    Attributes:
      block_q: query tokens per forward program.
      block_k: key tokens per forward loop step.
      block_q_bwd: query tokens per tile in both backward kernels.
      block_k_bwd: key tokens per tile in both backward kernels.
    """

    block_q: int = 128
    block_k: int = 128
    block_q_bwd: int = 64
    block_k_bwd: int = 64

    def __post_init__(self):
        for name, size in dataclasses.asdict(self).items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}={size!r} must be a positive int.")

    def check_gpu(self):
        """Raise unless every size suits the Triton lowering."""
        for name, size in dataclasses.asdict(self).items():
            if size < _MIN_DIM or size & (size - 1):
                raise ValueError(
                    f"{name}={size} must be a power of two >= {_MIN_DIM} for the Triton "
                    f"(GPU) lowering; use e.g. {max(_MIN_DIM, pl.next_power_of_2(size))}.")


def _interpret(interpret: Optional[bool]) -> bool:
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def _tiling(q, k, block_q: int, block_k: int) -> Tiling:
    def clip(block, length):
        return min(block, max(_MIN_DIM, pl.next_power_of_2(length)))

    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    return Tiling(batch, kv_heads, heads // kv_heads, q_len, kv_len,
                       clip(block_q, q_len), clip(block_k, kv_len))


def _padded_dim(dim: int) -> int:
    return max(_MIN_DIM, pl.next_power_of_2(dim))


def _bounds(classes):
    """``int32[n, 2]``: first and one-past-last non-``EMPTY`` column of every row."""
    nonempty = classes != masks.EMPTY
    first = jnp.argmax(nonempty, axis=1)
    end = classes.shape[1] - jnp.argmax(nonempty[:, ::-1], axis=1)
    seen = nonempty.any(axis=1)
    return jnp.stack([jnp.where(seen, first, 0), jnp.where(seen, end, 0)], 1).astype(jnp.int32)


def _precision(dtype):
    # Triton's default for float32 dots is TF32; the contract promises float32.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _dot(a, b, contract, precision):
    """Matmul of 2-D tiles contracting ``a`` axis ``contract[0]`` with ``b`` axis
    ``contract[1]``, accumulated in float32."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=precision, preferred_element_type=_F32)


def _tile_mask(spec: MaskSpec, q_pos, q_seg, kv_pos, kv_seg):
    """``bool[bq, bk]`` from position / segment tiles ``[bq]`` and ``[bk]`` (or None)."""
    return masks.visible(spec, q_pos[:, None], kv_pos[None, :],
                         None if q_seg is None else q_seg[:, None],
                         None if kv_seg is None else kv_seg[None, :])


def _token_tile(tokens: Tokens, window):
    """Load the ``window`` (an index or slice) of a Tokens-of-refs: ``(pos, seg|None)``."""
    seg = tokens.segment_ids
    return tokens.positions[window], None if seg is None else seg[window]


def _token_specs(tokens: Tokens, block: int, index_map) -> Tokens:
    spec = pl.BlockSpec((None, block), index_map)
    return Tokens(spec, None if tokens.segment_ids is None else spec)


def _switch_classes(tile_class, tile_fn, carry):
    """Skip ``EMPTY``, run ``tile_fn(carry, masked)`` on ``PARTIAL`` / ``FULL``."""
    return lax.switch(tile_class, [lambda c: c, functools.partial(tile_fn, masked=True),
                                   functools.partial(tile_fn, masked=False)], carry)


def _compiler_params(head_dim: int):
    return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _forward_kernel(bounds_ref, classes_ref, q_ref, k_ref, v_ref, q_tok, kv_tok,
                    out_ref, lse_ref, *, spec, scale, block_k, precision):
    q = q_ref[...]  # [bq, Dqk]
    q_pos, q_seg = _token_tile(q_tok, slice(None))

    def tile(carry, masked, start):
        acc, m, l = carry  # [bq, Dv], [bq], [bq]; scores in log2 units
        window = pl.ds(start, block_k)
        s = _dot(q, k_ref[window, :], (1, 1), precision) * (scale * _LOG2E)  # [bq, bk]
        if masked:
            mask = _tile_mask(spec, q_pos, q_seg, *_token_tile(kv_tok, window))
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        # m starts at EMPTY_LSE (finite), so fully masked rows give exp2(-inf) = 0.
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp2(s - m_new[:, None])
        alpha = jnp.exp2(m - m_new)
        v = v_ref[window, :]
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, (1, 0), precision)
        return acc, m_new, l * alpha + p.sum(axis=-1)

    def body(j, carry):
        return _switch_classes(classes_ref[j], functools.partial(tile, start=j * block_k), carry)

    block_q, d_v = q.shape[0], out_ref.shape[-1]
    init = (jnp.zeros((block_q, d_v), _F32), jnp.full((block_q,), masks.EMPTY_LSE, _F32),
            jnp.zeros((block_q,), _F32))
    acc, m, l = lax.fori_loop(bounds_ref[0], bounds_ref[1], body, init)
    seen = l > 0
    l = jnp.where(seen, l, 1.0)
    out_ref[...] = acc / l[:, None]
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(l)) * _LN2, masks.EMPTY_LSE)


def _validate(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, block_sizes: BlockSizes,
              interpret: bool):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, dim]. Got {q.shape=}, "
                         f"{k.shape=}, {v.shape=}.")
    (batch, q_len, heads, d_qk), (kv_len, kv_heads) = q.shape, k.shape[1:3]
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != d_qk:
        raise ValueError(f"k must be [{batch}, kv_seq, kv_heads, {d_qk}] and v "
                         f"[{batch}, kv_seq, kv_heads, d_v]. Got {k.shape=}, {v.shape=}.")
    if heads % kv_heads:
        raise ValueError(f"{heads=} must be a multiple of {kv_heads=} (GQA/MQA).")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in _DTYPES:
        raise ValueError(f"q, k, v must share one of {[str(d) for d in _DTYPES]}. Got "
                         f"{q.dtype=}, {k.dtype=}, {v.dtype=}; cast them first.")
    for name, tokens, shape in (("q", q_tokens, (batch, q_len)),
                                ("kv", kv_tokens, (batch, kv_len))):
        for field in ("positions", "segment_ids"):
            x = getattr(tokens, field)
            if x is not None and x.shape != shape:
                raise ValueError(f"{name}_tokens.{field} must have shape {shape}. Got {x.shape}.")
    if not interpret:
        block_sizes.check_gpu()


def _query_row_specs(t: Tiling, q_tokens, kv_tokens, d_qk_pad: int, d_v_pad: int):
    """BlockSpecs of a (query tile, batch, head) grid's inputs: tile bounds and classes,
    the query tile, the whole K/V of the head's group (``h // group``), and the tokens."""
    kv_pad, group = t.num_k * t.block_k, t.group
    return [
        pl.BlockSpec((None, 2), lambda i, b, h: (i, 0)),
        pl.BlockSpec((None, t.num_k), lambda i, b, h: (i, 0)),
        pl.BlockSpec((None, t.block_q, None, d_qk_pad), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, kv_pad, None, d_qk_pad), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, kv_pad, None, d_v_pad), lambda i, b, h: (b, 0, h // group, 0)),
        _token_specs(q_tokens, t.block_q, lambda i, b, h: (b, i)),
        _token_specs(kv_tokens, kv_pad, lambda i, b, h: (b, 0)),
    ]


def forward(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, spec: MaskSpec, scale: float,
            block_sizes: BlockSizes = BlockSizes(), interpret: Optional[bool] = None):
    """Attention of ``q`` against one run of keys (the contract of :func:`xla.forward`).

    Args:
      q: ``[B, Sq, H, Dqk]``; k: ``[B, Sk, Hkv, Dqk]``; v: ``[B, Sk, Hkv, Dv]``;
        one dtype among float32 / bfloat16 / float16, ``H % Hkv == 0``.
      q_tokens, kv_tokens: metadata of the queries (``[B, Sq]``) and keys (``[B, Sk]``).
      spec: causal / window; scale: score multiplier.
      block_sizes: tile sizes.
      interpret: run the Pallas interpreter; ``None``: unless the backend is GPU.
    Returns:
      ``out float32[B, Sq, H, Dv]`` (normalized) and ``lse float32[B, Sq, H]``;
      softmax statistics and accumulators in float32 whatever the input dtype.

    >>> q = k = v = jnp.ones((1, 32, 2, 16), jnp.bfloat16)
    >>> tokens = Tokens(jnp.arange(32, dtype=jnp.int32)[None])
    >>> out, lse = forward(q, k, v, tokens, tokens, spec=MaskSpec.make(causal=True), scale=0.25)
    >>> out.shape, out.dtype, lse.shape
    ((1, 32, 2, 16), dtype('float32'), (1, 32, 2))
    """
    interpret = _interpret(interpret)
    _validate(q, k, v, q_tokens, kv_tokens, block_sizes, interpret)
    # Inside shard_map every operand must vary over the same axes (e.g. replicated
    # decode queries against a sharded cache).
    q, k, v, q_tokens, kv_tokens = _compat.match_varying(
        (q, k, v, q_tokens, kv_tokens), (q, k, v, q_tokens, kv_tokens))
    t = _tiling(q, k, block_sizes.block_q, block_sizes.block_k)
    q_tokens, kv_tokens, classes = schedule(spec, t, q_tokens, kv_tokens)
    heads, d_v = q.shape[2], v.shape[-1]
    q_pad, kv_pad = t.num_q * t.block_q, t.num_k * t.block_k
    d_qk_pad, d_v_pad = _padded_dim(q.shape[-1]), _padded_dim(d_v)
    kernel = functools.partial(_forward_kernel, spec=spec, scale=scale, block_k=t.block_k,
                               precision=_precision(q.dtype))
    out, lse = pl.pallas_call(
        kernel,
        grid=(t.num_q, t.batch, heads),
        in_specs=_query_row_specs(t, q_tokens, kv_tokens, d_qk_pad, d_v_pad),
        out_specs=[
            pl.BlockSpec((None, t.block_q, None, d_v_pad), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, t.block_q), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[_compat.shape_struct((t.batch, q_pad, heads, d_v_pad), _F32, q),
                   _compat.shape_struct((t.batch, heads, q_pad), _F32, q)],
        compiler_params=_compiler_params(max(d_qk_pad, d_v_pad)),
        interpret=interpret,
        name="seqpar_flash_forward",
    )(_bounds(classes), classes, pad_seq(q, q_pad, dim=d_qk_pad),
      pad_seq(k, kv_pad, dim=d_qk_pad), pad_seq(v, kv_pad, dim=d_v_pad), q_tokens, kv_tokens)
    return out[:, :t.q_len, :, :d_v], jnp.swapaxes(lse, 1, 2)[:, :t.q_len]


def backward(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, lse, delta, dout, *,
             spec: MaskSpec, scale: float, block_sizes: BlockSizes = BlockSizes(),
             interpret: Optional[bool] = None, accumulate=None):
    """Gradients of attention given the softmax statistics of the full result.

    Args:
      q, k, v, q_tokens, kv_tokens, spec, scale, block_sizes, interpret: as in
        :func:`forward`.
      lse: ``float32[B, Sq, H]`` log-sum-exp of the (possibly merged) result.
      delta: ``float32[B, Sq, H]`` = ``sum(dout * out, -1) - dlse``.
      dout: ``[B, Sq, H, Dv]`` cotangent of the (merged) output; it enters the
        matmuls in ``v.dtype``.
      accumulate: optional float32 ``(dq, dk, dv)`` the gradients are added to.
    Returns:
      float32 ``dq [B, Sq, H, Dqk]``, ``dk [B, Sk, Hkv, Dqk]``, ``dv [B, Sk, Hkv, Dv]``
      (plus ``accumulate``).
    """
    from jax_seqpar.kernels import _pallas_bwd  # it imports this module's helpers

    interpret = _interpret(interpret)
    _validate(q, k, v, q_tokens, kv_tokens, block_sizes, interpret)
    rows, dout_shape = q.shape[:3], q.shape[:3] + v.shape[3:]
    if lse.shape != rows or delta.shape != rows or dout.shape != dout_shape:
        raise ValueError(f"lse and delta must be {rows} and dout {dout_shape}. Got "
                         f"{lse.shape=}, {delta.shape=}, {dout.shape=}.")
    grads = _pallas_bwd.backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, spec=spec,
                                 scale=scale, block_sizes=block_sizes, interpret=interpret)
    if accumulate is None:
        return grads
    return tuple(total + g for total, g in zip(accumulate, grads))


def attention(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, spec: MaskSpec, scale: float,
              block_sizes: BlockSizes = BlockSizes(), interpret: Optional[bool] = None):
    """Differentiable :func:`forward`: ``(out float32, lse float32)``.

    The backward (:func:`backward`) accepts cotangents for both ``out`` and ``lse``,
    so merged partial results (ring attention) differentiate exactly.

    >>> q = k = v = jnp.ones((1, 32, 2, 16), jnp.float32)
    >>> tokens = Tokens(jnp.arange(32, dtype=jnp.int32)[None])
    >>> loss = lambda q: attention(q, k, v, tokens, tokens, spec=MaskSpec(), scale=0.25)[0].sum()
    >>> jax.grad(loss)(q).shape
    (1, 32, 2, 16)
    """
    interpret = _interpret(interpret)
    _validate(q, k, v, q_tokens, kv_tokens, block_sizes, interpret)
    return _attention(spec, float(scale), block_sizes, interpret, q, k, v, q_tokens, kv_tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(spec, scale, block_sizes, interpret, q, k, v, q_tokens, kv_tokens):
    return forward(q, k, v, q_tokens, kv_tokens, spec=spec, scale=scale,
                   block_sizes=block_sizes, interpret=interpret)


def _attention_fwd(spec, scale, block_sizes, interpret, q, k, v, q_tokens, kv_tokens):
    out, lse = _attention(spec, scale, block_sizes, interpret, q, k, v, q_tokens, kv_tokens)
    return (out, lse), (q, k, v, q_tokens, kv_tokens, out, lse)


def _attention_bwd(spec, scale, block_sizes, interpret, residuals, cotangents):
    q, k, v, q_tokens, kv_tokens, out, lse = residuals
    dout, dlse = cotangents
    delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(_F32), out) - dlse
    dq, dk, dv = backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, spec=spec,
                          scale=scale, block_sizes=block_sizes, interpret=interpret)
    no_grad = jax.tree.map(lambda _: None, (q_tokens, kv_tokens))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad)


_attention.defvjp(_attention_fwd, _attention_bwd)
