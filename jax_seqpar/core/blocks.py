"""Masks classified a block of tokens at a time: what every kernel and ring step skips.

:func:`summarize` reduces the metadata of a block of tokens
(:class:`jax_seqpar.core.masks.Tokens`) to its ranges and a segment signature, and
:func:`classify` tells, for every (query block, key block) pair, whether it is ``EMPTY``
(nothing visible: skip it), ``FULL`` (everything visible: no mask needed) or
``PARTIAL``. The classification is conservative: ``EMPTY`` and ``FULL`` are only claimed
when they hold for every token pair (and every batch row a summary covers). Padding
(:data:`~jax_seqpar.core.masks.PAD_SEGMENT`) sees nothing and nothing sees it, so
summaries leave it out: a tile of padding is ``EMPTY``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from jax_seqpar.core.masks import PAD_SEGMENT, MaskSpec, Tokens, array_namespace, shifted

__all__ = ["BlockSummary", "classify", "EMPTY", "FULL", "PARTIAL", "SIGNATURE_BITS",
           "summarize"]

EMPTY, PARTIAL, FULL = 0, 1, 2

#: Bits of a tile's segment signature (bit ``id % 32`` is set for every document in it).
SIGNATURE_BITS = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockSummary:
    """The metadata of each block of tokens, ``[num_blocks]`` (one decision for every
    batch row) or ``[batch, num_blocks]`` (per row), padding left out.

    Attributes:
      pos_min, pos_max: ``int32`` position range of the block's real tokens.
      seg_min, seg_max: ``int32`` segment id range, or None (no segment ids).
      seg_bits: ``uint32`` signature: bit ``id % 32`` set for each document in the
        block (0: padding only); two blocks whose signatures share no bit share no
        document, whatever their ranges. None without segment ids.
      padded: ``bool``, the block holds padding (never ``FULL``). None without ids.
      bid_min, bid_max: ``int32`` range of the block's non-zero bidirectional ids
        (an empty range, min > max, when it has none). None without bidirectional ids.
      bid_zero: ``bool``, the block holds a real token of bidirectional id 0.
    """

    pos_min: jax.Array
    pos_max: jax.Array
    seg_min: Optional[jax.Array] = None
    seg_max: Optional[jax.Array] = None
    seg_bits: Optional[jax.Array] = None
    padded: Optional[jax.Array] = None
    bid_min: Optional[jax.Array] = None
    bid_max: Optional[jax.Array] = None
    bid_zero: Optional[jax.Array] = None


def summarize(tokens: Tokens, block: int, *, per_row: bool = False) -> BlockSummary:
    """Summarize ``tokens`` (seq a multiple of ``block``) block by block: over the whole
    batch (``[num_blocks]`` fields), or for each batch row with ``per_row``. Numpy
    tokens give numpy summaries (the same rule on host)."""
    xp = array_namespace(tokens.positions)
    batch, seq = tokens.positions.shape
    if seq % block:
        raise ValueError(f"{seq=} must be a multiple of {block=}.")
    shape = (batch, seq // block, block)
    axes = (2,) if per_row else (0, 2)
    positions = tokens.positions.reshape(shape)
    top, bottom = np.iinfo(np.int32).max, np.iinfo(np.int32).min
    segments = None if tokens.segment_ids is None else tokens.segment_ids.reshape(shape)
    pad = None if segments is None else segments == PAD_SEGMENT

    def ranges(x, leave_out):
        if leave_out is None:
            return x.min(axis=axes), x.max(axis=axes)
        return (xp.where(leave_out, top, x).min(axis=axes),
                xp.where(leave_out, bottom, x).max(axis=axes))

    summary = BlockSummary(*ranges(positions, pad))
    if segments is not None and pad is not None:  # both or neither
        bit = xp.left_shift(np.uint32(1), xp.bitwise_and(segments, SIGNATURE_BITS - 1)
                            .astype(np.uint32))
        bits = xp.bitwise_or.reduce(xp.where(pad, np.uint32(0), bit), axis=axes)
        summary.seg_min, summary.seg_max = ranges(segments, pad)
        summary.seg_bits, summary.padded = bits, pad.any(axis=axes)
    if tokens.bidirectional_ids is not None:
        bids = tokens.bidirectional_ids.reshape(shape)
        real = xp.ones(shape, bool) if pad is None else ~pad
        summary.bid_min, summary.bid_max = ranges(bids, ~real | (bids == 0))
        summary.bid_zero = (real & (bids == 0)).any(axis=axes)
    return summary


def classify(spec: MaskSpec, q: BlockSummary, kv: BlockSummary) -> jax.Array:
    """``int8[..., num_q_blocks, num_kv_blocks]`` of ``EMPTY`` / ``PARTIAL`` / ``FULL``.

    Leading dims broadcast: batch-wide summaries give ``[nq, nk]``, per-row ones
    ``[B, nq, nk]``. int8 keeps the table a quarter of int32's size; the Pallas kernels
    only reduce it to per-row loop bounds (fused, never stored).
    """
    xp = array_namespace(q.pos_min)

    def rows(x):
        return x[..., :, None]

    def cols(x):
        return x[..., None, :]
    q_lo, q_hi, k_lo, k_hi = rows(q.pos_min), rows(q.pos_max), cols(kv.pos_min), cols(kv.pos_max)
    empty = xp.zeros(np.broadcast_shapes(q_lo.shape, k_lo.shape), bool)
    full = xp.ones_like(empty)
    if spec.causal:
        after, before = k_lo > q_hi, k_hi <= q_lo
        if q.bid_min is not None:  # a shared non-zero id lifts causality
            qb_lo, qb_hi, kb_lo, kb_hi = (rows(q.bid_min), rows(q.bid_max), cols(kv.bid_min),
                                          cols(kv.bid_max))
            after &= (kb_lo > qb_hi) | (kb_hi < qb_lo)  # no id in common
            one_id = ((qb_lo == qb_hi) & (kb_lo == kb_hi) & (qb_lo == kb_lo)
                      & ~rows(q.bid_zero) & ~cols(kv.bid_zero))
            before |= one_id
        empty |= after
        full &= before
    if spec.window is not None:
        left, right = spec.window
        empty |= (k_lo > shifted(q_hi, right)) | (k_hi < shifted(q_lo, -left))
        full &= (k_hi <= shifted(q_lo, right)) & (k_lo >= shifted(q_hi, -left))
    if spec.chunk_size is not None:  # floor division is monotone: chunk ranges
        c = spec.chunk_size
        empty |= (k_lo // c > q_hi // c) | (k_hi // c < q_lo // c)
        full &= (q_lo // c == q_hi // c) & (k_lo // c == k_hi // c) & (q_lo // c == k_lo // c)
    if spec.mask_fn is not None:  # per element: never claimed FULL
        full &= False
    if q.seg_min is not None:
        qs_lo, qs_hi, ks_lo, ks_hi = (rows(q.seg_min), rows(q.seg_max), cols(kv.seg_min),
                                      cols(kv.seg_max))
        empty |= (ks_lo > qs_hi) | (ks_hi < qs_lo) | ((rows(q.seg_bits) & cols(kv.seg_bits)) == 0)
        full &= (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
        full &= ~rows(q.padded) & ~cols(kv.padded)
    return xp.where(empty, EMPTY, xp.where(full, FULL, PARTIAL)).astype(np.int8)
