"""Pieces shared by the Pallas forward and backward kernels (:mod:`.pallas`, :mod:`._pallas_bwd`).

* :class:`HeadDim`: how a head dim is cut into power-of-two column parts (Triton
  tensors are powers of two): one part up to 256 columns, masked loads for the
  columns past the real dim, a loop of parts beyond (MLA's 576 is 256+256+64);
* the loop schedule: per row of tiles, the first..last non-``EMPTY`` tile with the
  run of ``FULL`` tiles inside, so each kernel runs a masked loop, an unmasked loop
  and a masked loop whose loads all sit at the loop's top level (Triton's software
  pipeliner only pipelines those);
* the forward's tile step and loop (:func:`visible_scores`, :func:`online_softmax`),
  shared by the bfloat16 / float32 and FP8 bodies (decode's folds and split-K:
  :mod:`._decode`);
* :func:`call`: ``pallas_call`` lowered by the platform the program is lowered for
  (Triton for CUDA/ROCm, the interpreter elsewhere), not by the default backend.
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

from jax_seqpar.core import blocks, masks
from jax_seqpar.kernels import tiling as _tiling
from jax_seqpar.kernels.tiling import Tiling
from jax_seqpar.core.masks import MaskSpec, Tokens

F32 = jnp.float32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
#: Smallest tile / head-dim part Triton's ``tl.dot`` takes.
MIN_DIM = 16
#: Widest head-dim part kept as one tensor; wider dims are cut into parts.
MAX_PART = 256
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def tiling(q, k, block_q: int, block_k: int) -> Tiling:
    """Geometry of one call, tiles clipped to the (power-of-two padded) lengths."""
    def clip(block, length):
        return min(block, max(MIN_DIM, pl.next_power_of_2(length)))

    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    return Tiling(batch, kv_heads, heads // kv_heads, q_len, kv_len,
                  clip(block_q, q_len), clip(block_k, kv_len))


def query_row_specs(t: Tiling, q_tokens, kv_tokens, d_qk: "HeadDim", d_v: "HeadDim"):
    """BlockSpecs of a (query tile, batch, head) grid's inputs: the row's loop bounds,
    the query tile, the whole K/V of the head's group (``h // group``), the tokens."""
    kv_pad, group = t.num_k * t.block_k, t.group
    return [
        pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0)),
        pl.BlockSpec((None, t.block_q, None, d_qk.padded), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, kv_pad, None, d_qk.padded), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, kv_pad, None, d_v.padded), lambda i, b, h: (b, 0, h // group, 0)),
        token_specs(q_tokens, t.block_q, lambda i, b, h: (b, i)),
        token_specs(kv_tokens, kv_pad, lambda i, b, h: (b, 0)),
    ]


@dataclasses.dataclass(frozen=True)
class HeadDim:
    """A head dim cut into power-of-two column parts (Triton tensors are powers of two).

    Up to :data:`MAX_PART` columns: one part of the next power of two, the columns
    past the real dim masked in loads and stores (no padding in memory). Wider:
    the largest powers of two that fit, so MLA's 576 is 256 + 256 + 64 and 512 is
    256 + 256 (a last piece under 16 columns is masked).

    Attributes:
      size: the real head dim.
      widths: the parts' widths, in column order.
    """

    size: int
    widths: tuple

    @classmethod
    def of(cls, size: int) -> "HeadDim":
        whole = max(MIN_DIM, pl.next_power_of_2(size))
        if whole <= MAX_PART:
            return cls(size, (whole,))
        widths, left = [], size
        while left > 0:
            width = MIN_DIM if left < MIN_DIM else min(MAX_PART, 1 << (left.bit_length() - 1))
            widths.append(width)
            left -= width
        return cls(size, tuple(widths))

    @property
    def count(self) -> int:
        return len(self.widths)

    @property
    def padded(self) -> int:
        return sum(self.widths)

    def _columns(self, part: int):
        """``(slice, mask|None)`` of part ``part``'s columns."""
        start, width = sum(self.widths[:part]), self.widths[part]
        if start + width <= self.size:
            return pl.ds(start, width), None
        return pl.ds(start, width), (start + jnp.arange(width) < self.size)[None, :]

    def zeros(self, rows: int):
        """float32 accumulators ``[rows, width]``, one per part."""
        return tuple(jnp.zeros((rows, width), F32) for width in self.widths)

    def load(self, ref, index: tuple, part: int):
        """Part ``part`` of ``ref[*index, :]`` (``[rows, width]``), zeros past ``size``."""
        cols, mask = self._columns(part)
        if mask is None:
            return ref[index + (cols,)]
        return plgpu.load(ref.at[index + (cols,)], mask=mask, other=0)

    def load_all(self, ref, *index):
        """Every part of ``ref[*index, :]`` (a list)."""
        return [self.load(ref, index, c) for c in range(self.count)]

    def store(self, ref, part: int, value):
        """Write part ``part`` of ``ref[:, :]`` (columns past ``size`` left alone)."""
        cols, mask = self._columns(part)
        if mask is None:
            ref[:, cols] = value
        else:
            plgpu.store(ref.at[:, cols], value, mask=mask)


#: float32 dots as three TF32 products (``hi*hi + hi*lo + lo*hi``), emulated in the
#: interpreter so CPU tests see the GPU's arithmetic.
TF32X3_EMULATED = "tf32x3-emulated"


def precision_for(dtype, triton: bool):
    """Dot precision. float32 inputs: TF32x3 (float32-level error, about 1e-6 relative,
    on tensor cores: no IEEE-FMA path with its register spills and long compiles),
    on GPU natively, in the interpreter emulated; 16-bit inputs: the default."""
    if dtype != jnp.float32:
        return None
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if triton else TF32X3_EMULATED


def _split_tf32(x):
    """``(hi, lo)`` with ``hi`` rounded to TF32 (10 mantissa bits), ``lo`` the rest."""
    hi = lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)
    return hi, lax.reduce_precision(x - hi, exponent_bits=8, mantissa_bits=10)


def dot(a, b, contract, precision):
    """Matmul of 2-D tiles contracting ``a`` axis ``contract[0]`` with ``b`` axis
    ``contract[1]``, accumulated in float32."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    if precision == TF32X3_EMULATED:
        (a_hi, a_lo), (b_hi, b_lo) = _split_tf32(a), _split_tf32(b)
        return sum(lax.dot_general(x, y, dims, precision=lax.Precision.HIGHEST,
                                   preferred_element_type=F32)
                   for x, y in ((a_lo, b_hi), (a_hi, b_lo), (a_hi, b_hi)))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def dot_cols(a_cols, b_cols, contract, precision):
    """Sum over head-dim parts of :func:`dot` (the split contraction)."""
    total = None
    for a, b in zip(a_cols, b_cols):
        part = dot(a, b, contract, precision)
        total = part if total is None else total + part
    return total


def products(q_cols, k_cols, precision, scales=None):
    """float32 ``q.k`` of a tile ``[bq, bk]`` (unscaled; FP8: times the operands'
    per-token ``scales`` ``(q float32[bq], k float32[bk])``)."""
    s = dot_cols(q_cols, k_cols, (1, 1), precision)
    if scales is not None:
        s = s * scales[0][:, None] * scales[1][None, :]
    return s


def capped(s, options):
    """``(s, tanh)`` of :func:`products` ``s``: scores in log2 units ``[bq, bk]`` and, with
    ``options.softcap``, the ``tanh`` the backward needs (else ``None``)."""
    cap = options.softcap
    if cap is None:
        return s * (options.scale * LOG2E), None
    t = jnp.tanh(s * (options.scale / cap))
    return t * (cap * LOG2E), t


def scores(q_cols, k_cols, options, precision, scales=None):
    """``(s, tanh)``: scores in log2 units ``[bq, bk]`` and, with ``options.softcap``,
    the ``tanh`` the backward needs (else ``None``). ``scales``: FP8 operands' per-token
    ``(q_scale float32[bq], k_scale float32[bk])``, applied to the float32 products."""
    return capped(products(q_cols, k_cols, precision, scales), options)


def visible_scores(q_cols, k_cols, options, precision, mask, high: tuple, scales=None):
    """The forward's scores of one tile and its running max logit.

    Returns ``(s, high)``: :func:`scores` ``s [bq, bk]`` (log2 units, soft-capped) with
    invisible pairs (``mask bool[bq, bk]`` False; None: every pair visible) at ``-inf``,
    and ``high``: ``()`` (``options.return_max_logit`` off: nothing more computed) or
    ``(max_logit float32[bq],)``, the row maxima so far of the logits ``scale * q.k``
    BEFORE the soft-cap (FP8: of the quantized operands, their scales applied) over the
    visible pairs, updated with this tile's. Its own running max, not the softmax's
    (that one is soft-capped and in log2 units)."""
    raw = products(q_cols, k_cols, precision, scales)
    s, _ = capped(raw, options)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    if high:
        logits = raw * options.scale
        if mask is not None:
            logits = jnp.where(mask, logits, -jnp.inf)
        high = (jnp.maximum(high[0], logits.max(axis=-1)),)
    return s, high


def tile_mask(spec: MaskSpec, q_tile: Tokens, kv_tile: Tokens):
    """``bool[bq, bk]`` (:func:`jax_seqpar.core.masks.visible`) of loaded metadata tiles
    ``[bq]`` and ``[bk]`` (:func:`token_tile`)."""
    return masks.visible(spec, masks.rows(q_tile), masks.cols(kv_tile))


def token_tile(tokens: Tokens, span) -> Tokens:
    """Load the ``span`` (an index or slice) of a Tokens-of-refs: every field present."""
    return _tiling.loaded(tokens, span)


def token_specs(tokens: Tokens, block: int, index_map) -> Tokens:
    """One ``[block]`` BlockSpec per metadata field ``tokens`` has."""
    return _tiling.per_field(tokens, pl.BlockSpec((None, block), index_map))


def masked(spec: MaskSpec, tokens: Tokens) -> bool:
    """Whether any tile can be ``PARTIAL`` (statically): else one unmasked loop. The
    static fields (:attr:`MaskSpec.bounded`: causal, window, chunks, ``mask_fn``) or
    document ids can mask; bidirectional ids only lift a causal mask."""
    return spec.bounded or tokens.segment_ids is not None


def run_tiles(bounds_ref, step, carry, *, has_mask: bool):
    """Run ``step(index, carry, masked)`` over a row's non-``EMPTY`` tiles.

    ``bounds_ref`` holds ``(first, full_first, full_end, end)``: tiles
    ``first..end-1`` may be visible, ``full_first..full_end-1`` are ``FULL``. Three
    plain loops (masked, unmasked, masked) instead of a branch per tile, so every
    load sits at a loop's top level.
    """
    first, full_first, full_end, end = (bounds_ref[i] for i in range(4))
    if not has_mask:
        return lax.fori_loop(first, end, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(first, full_first, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(full_first, full_end, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full_end, end, functools.partial(step, masked=True), carry)


def online_softmax(bounds_ref, step, d_v, out_ref, lse_ref, max_ref=None, *,
                   has_mask: bool) -> None:
    """The forward's loop over a row's tiles (:func:`run_tiles`; ``step(i, (acc, m, l,
    *high), masked)`` in the ``exp2`` domain) from an empty softmax, then its output
    ``acc / l`` and natural-log ``lse`` stored (a row that saw nothing: zeros,
    ``EMPTY_LSE``). ``max_ref float32[bq]`` (``options.return_max_logit``): the carry
    also holds ``high``, the rows' running max logit (:func:`visible_scores`) from
    ``-inf``, stored there; None: the carry is ``(acc, m, l)``."""
    block_q = out_ref.shape[0]
    init: tuple = (d_v.zeros(block_q),
                   jnp.full((block_q,), masks.EMPTY_LSE, F32), jnp.zeros((block_q,), F32))
    if max_ref is not None:
        init += (jnp.full((block_q,), -jnp.inf, F32),)
    acc, m, l, *high = run_tiles(bounds_ref, step, init, has_mask=has_mask)
    seen = l > 0
    l = jnp.where(seen, l, 1.0)
    for c, a in enumerate(acc):
        d_v.store(out_ref, c, a / l[:, None])
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(l)) * LN2, masks.EMPTY_LSE)
    if max_ref is not None:
        max_ref[...] = high[0]


def call(body, *, interpret: Optional[bool], precision_dtype, **kwargs):
    """``pallas_call`` of the kernel ``body(..., precision=...)``, lowered for the platform the
    program is lowered for when ``interpret`` is None (Triton on CUDA / ROCm, the
    interpreter elsewhere); ``True`` / ``False`` force one."""

    def build(triton: bool):
        run_body = functools.partial(body, precision=precision_for(precision_dtype, triton))
        return pl.pallas_call(run_body, interpret=not triton, **kwargs)

    if interpret is not None:
        return build(not interpret)

    def run(*args):
        return lax.platform_dependent(*args, cuda=build(True), rocm=build(True),
                                      default=build(False))

    return run


#: Rows of tiles whose class rows are built at once: the only ``[rows, n]`` temporary.
BOUNDS_CHUNK = 256


def tile_bounds(spec: MaskSpec, t: Tiling, q_tokens: Tokens, kv_tokens: Tokens, *,
                by_key: bool = False):
    """Loop bounds (:func:`row_bounds`) of every query tile (or key tile, ``by_key``)
    of every batch row from the tokens (padded to whole tiles), ``int32[B, n, 4]``:
    each batch row skips its own ``EMPTY`` tiles (packed rows hold different documents).

    The classes are built :data:`BOUNDS_CHUNK` rows at a time (``lax.map``), so
    memory is O(B * S) however long the sequence, never a ``[num_q, num_k]`` table.
    """
    q_summaries = blocks.summarize(q_tokens, t.block_q, per_row=True)  # [B, nq] fields
    kv_summaries = blocks.summarize(kv_tokens, t.block_k, per_row=True)  # [B, nk] fields

    def batch_row(q_summary, kv_summary):  # [nq], [nk] fields -> [n, 4]
        rows = kv_summary if by_key else q_summary

        def one_row(row):  # summaries of one tile -> its bounds [4]
            row = jax.tree.map(lambda x: x[None], row)
            classes = (blocks.classify(spec, q_summary, row).T if by_key
                       else blocks.classify(spec, row, kv_summary))
            return row_bounds(classes)[0]

        return lax.map(one_row, rows, batch_size=min(BOUNDS_CHUNK, rows.pos_min.shape[0]))

    return jax.vmap(batch_row)(q_summaries, kv_summaries)


def row_bounds(classes):
    """``int32[n_rows, 4]`` loop bounds ``(first, full_first, full_end, end)`` per row
    of a tile-class table ``[n_rows, n_cols]``.

    Only reductions consume the table, so XLA fuses its elementwise computation
    into them instead of storing it.
    """
    n_cols = classes.shape[1]
    cols = jnp.arange(n_cols, dtype=jnp.int32)[None, :]
    nonempty = classes != blocks.EMPTY
    full = classes == blocks.FULL
    first = jnp.min(jnp.where(nonempty, cols, n_cols), axis=1)
    end = jnp.max(jnp.where(nonempty, cols + 1, 0), axis=1)
    full_first = jnp.min(jnp.where(full, cols, n_cols), axis=1)
    after = jnp.min(jnp.where(~full & (cols > full_first[:, None]), cols, n_cols), axis=1)
    has_full = full_first < n_cols
    first = jnp.minimum(first, end)  # a row that sees nothing: 0, 0, 0, 0
    full_first = jnp.where(has_full, full_first, end)
    full_end = jnp.where(has_full, jnp.minimum(after, end), end)
    return jnp.stack([first, full_first, full_end, end], axis=1).astype(jnp.int32)
