"""Pieces shared by the Pallas forward and backward kernels (:mod:`.pallas`, :mod:`._pallas_bwd`).

* :class:`HeadDim`: how a head dim is cut into power-of-two column parts (Triton
  tensors are powers of two): one part up to 256 columns, masked loads for the
  columns past the real dim, a loop of parts beyond (MLA's 576 is 256+256+64);
* the loop schedule: per row of tiles, the first..last non-``EMPTY`` tile with the
  run of ``FULL`` tiles inside, so each kernel runs a masked loop, an unmasked loop
  and a masked loop whose loads all sit at the loop's top level (Triton's software
  pipeliner only pipelines those);
* split-K for short calls (decode): :func:`kv_splits`, :func:`split_kv`,
  :func:`merge_splits`;
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
from jax_seqpar.kernels.tiling import Tiling, pad_seq, padded_tokens
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


def folds_group(q_len: int, heads: int, kv_heads: int) -> bool:
    """Decode-sized queries (fewer than a 16-row tile) of a GQA/MQA group are folded
    into one row block per kv head: each K/V tile is read once for the whole group
    and a tile's rows are the group's heads, not 15 padding rows per head."""
    return q_len < MIN_DIM and heads > kv_heads


def fold(x, kv_heads: int):
    """``[B, Sq, Hkv * G, ...] -> [B, Sq * G, Hkv, ...]`` (rows ordered (token, head))."""
    b, s, h = x.shape[:3]
    x = x.reshape(b, s, kv_heads, h // kv_heads, *x.shape[3:])
    return jnp.swapaxes(x, 2, 3).reshape(b, s * (h // kv_heads), kv_heads, *x.shape[4:])


def unfold(x, group: int):
    """Inverse of :func:`fold`: ``[B, Sq * G, Hkv, ...] -> [B, Sq, Hkv * G, ...]``."""
    b, rows, kv_heads = x.shape[:3]
    x = x.reshape(b, rows // group, group, kv_heads, *x.shape[3:])
    return jnp.swapaxes(x, 2, 3).reshape(b, rows // group, kv_heads * group, *x.shape[4:])


def fold_tokens(tokens: Tokens, group: int) -> Tokens:
    """Each query token's metadata repeated for the ``group`` heads folded into rows."""
    return jax.tree.map(lambda x: jnp.repeat(x, group, axis=1), tokens)


#: Programs a call should launch to fill a GPU (132 SMs on H100, 108 on A100).
FILL_PROGRAMS = 128
#: Fewest keys one split of a decode call's cache gets.
MIN_SPLIT_KEYS = 256


def kv_splits(programs: int, num_q: int, kv_len: int, block_k: int) -> int:
    """Runs a short call's keys are split into (split-K, "flash decoding").

    A call with one query tile per (batch, head) launches ``programs`` programs,
    e.g. 8 for a decode step of one sequence with 8 K/V heads: a few SMs stream the
    whole cache. Doubling the splits while the programs stay under
    :data:`FILL_PROGRAMS` and every split keeps :data:`MIN_SPLIT_KEYS` keys (and a
    tile) gives each program its own run of the cache; the partial results are
    merged by :func:`merge_splits`. 1: the call already fills the GPU.
    """
    splits = 1
    while (num_q == 1 and programs * splits * 2 <= FILL_PROGRAMS
           and kv_len // (splits * 2) >= max(MIN_SPLIT_KEYS, block_k)):
        splits *= 2
    return splits


def split_kv(splits: int, q, k, v, q_tokens: Tokens, kv_tokens: Tokens, t: Tiling):
    """Each batch row's keys cut into ``splits`` equal runs (the last padded), each run
    a batch row of its own, the queries repeated for each: ``k [B, Sk, Hkv, D] ->
    [B * splits, Sk / splits, Hkv, D]``, ``q [B, Sq, H, D] -> [B * splits, Sq, H, D]``
    (rows ordered (batch, split), a free reshape of the cache)."""
    run = -(-t.kv_len // splits)
    q_tokens, kv_tokens = padded_tokens(
        dataclasses.replace(t, block_q=t.q_len, block_k=run), q_tokens, kv_tokens)

    def by_run(x):  # [B, Sk, ...] -> [B * splits, run, ...]
        x = pad_seq(x, splits * run)
        return x.reshape(x.shape[0] * splits, run, *x.shape[2:])

    def repeated(x):
        return jnp.repeat(x, splits, axis=0)

    return (repeated(q), by_run(k), by_run(v), jax.tree.map(repeated, q_tokens),
            jax.tree.map(by_run, kv_tokens))


def merge_splits(splits: int, out, lse):
    """Softmax-merge the partial results of :func:`split_kv`'s runs:
    ``out f32[B * splits, Sq, H, Dv], lse f32[B * splits, Sq, H] -> [B, ...]``.
    A row no run sees keeps zeros and ``EMPTY_LSE``."""
    out = out.reshape(-1, splits, *out.shape[1:])
    lse = lse.reshape(-1, splits, *lse.shape[1:])
    top = lse.max(axis=1)
    weights = jnp.exp(lse - top[:, None])  # [B, splits, Sq, H]
    total = weights.sum(axis=1)
    out = jnp.einsum("bnqh,bnqhd->bqhd", weights, out) / total[..., None]
    seen = top > masks.EMPTY_LSE / 2
    return out, jnp.where(seen, top + jnp.log(total), masks.EMPTY_LSE)


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


def scores(q_cols, k_cols, options, precision, scales=None):
    """``(s, tanh)``: scores in log2 units ``[bq, bk]`` and, with ``options.softcap``,
    the ``tanh`` the backward needs (else ``None``). ``scales``: FP8 operands' per-token
    ``(q_scale float32[bq], k_scale float32[bk])``, applied to the float32 products."""
    s = dot_cols(q_cols, k_cols, (1, 1), precision)
    if scales is not None:
        s = s * scales[0][:, None] * scales[1][None, :]
    cap = options.softcap
    if cap is None:
        return s * (options.scale * LOG2E), None
    t = jnp.tanh(s * (options.scale / cap))
    return t * (cap * LOG2E), t


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


def online_softmax(bounds_ref, step, d_v, out_ref, lse_ref, *, has_mask: bool) -> None:
    """The forward's loop over a row's tiles (:func:`run_tiles`; ``step(i, (acc, m, l),
    masked)`` in the ``exp2`` domain) from an empty softmax, then its output ``acc / l``
    and natural-log ``lse`` stored (a row that saw nothing: zeros, ``EMPTY_LSE``)."""
    block_q = out_ref.shape[0]
    init = (d_v.zeros(block_q),
            jnp.full((block_q,), masks.EMPTY_LSE, F32), jnp.zeros((block_q,), F32))
    acc, m, l = run_tiles(bounds_ref, step, init, has_mask=has_mask)
    seen = l > 0
    l = jnp.where(seen, l, 1.0)
    for c, a in enumerate(acc):
        d_v.store(out_ref, c, a / l[:, None])
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(l)) * LN2, masks.EMPTY_LSE)


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
