"""Attention masks from per-token metadata, and their block classification.

A mask is never a dense ``[S, S]`` array. It is a static :class:`MaskSpec`
(``causal``, ``window``, ``chunk_size``, an optional ``mask_fn``) applied to per-token
metadata (:class:`Tokens`: global positions, optional segment ids and bidirectional
ids). The same predicate (:func:`visible`) serves every kernel and every strategy, so
a mask means the same thing whatever the token order or the sharding::

    query i sees key j  iff  same document (segment ids)
                        and  inside the window
                        and  in the same chunk (position // chunk_size)
                        and  (not causal, or pos_j <= pos_i, or both carry the same
                              non-zero bidirectional id)
                        and  mask_fn(q, kv) (when given).

Llama 4's chunked attention is ``causal`` with ``chunk_size``; prefix-LM is one
bidirectional id per document's prefix; a vision-language model gives each image's
tokens one bidirectional id.

For skipping work, :func:`summarize` reduces the metadata of a block of tokens to
its ranges and a segment signature, and :func:`classify` tells, for every (query
block, key block) pair, whether it is ``EMPTY`` (nothing visible: skip it), ``FULL``
(everything visible: no mask needed) or ``PARTIAL``. The classification is
conservative: ``EMPTY`` and ``FULL`` are only claimed when they hold for every token
pair (and every batch row a summary covers). Padding (:data:`PAD_SEGMENT`) sees
nothing and nothing sees it, so summaries leave it out: a tile of padding is ``EMPTY``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Generic, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BlockSummary", "classify", "cols", "EMPTY_LSE", "Leaf", "MaskSpec", "MAX_WINDOW",
           "normalize_window", "PAD_SEGMENT", "rows", "shifted", "summarize", "Tokens",
           "visible", "visible_tokens"]

EMPTY, PARTIAL, FULL = 0, 1, 2

#: The log-sum-exp given to a query row that sees no key. Finite, so merges and
#: gradients stay NaN-free, and so low that any real block outweighs it.
EMPTY_LSE = -1e30

#: The segment id of padding, reserved (never a real document). A padded token sees no
#: key and no query sees it; the global entry point and the kernels pad with it, and
#: layouts and work counts give it no work.
PAD_SEGMENT = -(2**31)

#: Bits of a tile's segment signature (bit ``id % 32`` is set for every document in it).
SIGNATURE_BITS = 32


#: A window side this large reaches every pair of int32 positions (their difference is
#: at most ``2**32 - 1``): larger sides are clamped to it, which changes nothing.
MAX_WINDOW = 2**32 - 1


def _whole(number) -> Optional[int]:
    """``number`` as a Python int if it is a whole number of tokens (ints, numpy ints,
    concrete integer 0-d arrays), else None: True is not a length, and 2.5 tokens are none."""
    if isinstance(number, (bool, np.bool_, float, np.floating)):
        return None
    try:
        return operator.index(number)
    except TypeError:
        return None


def normalize_window(window: Union[None, int, tuple[int, int]]) -> Optional[tuple[int, int]]:
    """``None``, one int (both sides) or ``(left, right)`` -> ``(left, right)`` or None.

    Sides are non-negative ints (floats and bools are refused with ``ValueError``);
    a side of :data:`MAX_WINDOW` or more reaches every int32 position and is clamped
    to it.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)):
        window = (window, window)
    elif len(window) != 2:
        raise ValueError(f"window must be an int or a (left, right) pair. Got {window!r}.")
    left, right = (_whole(side) for side in window)
    if left is None or right is None:
        raise ValueError(f"window sides must be whole numbers of tokens (ints): window=k or "
                         f"(left, right). Got window={window!r}.")
    if min(left, right) < 0:
        raise ValueError(f"window sides must be >= 0. Got window={window!r}.")
    return min(left, MAX_WINDOW), min(right, MAX_WINDOW)


def shifted(x: jax.Array, by: int):
    """``x + by`` for int32 positions ``x`` and a Python int ``by``, saturated to the
    int32 range instead of wrapping around: comparisons against it stay exact for every
    int32 key position (a window edge below ``-2**31`` admits every key, like ``-2**31``).

    Works on jax and numpy arrays (host work counts) alike."""
    xp = _namespace(x)
    low, high = -(2**31), 2**31 - 1
    if abs(by) >= MAX_WINDOW:  # past every int32 position whatever x is
        return xp.full_like(x, high if by > 0 else low)
    while by:  # steps of at most 2**31 - 1: each fits int32
        step = max(-high, min(high, by))
        if step > 0:
            x = xp.where(x > high - step, high, x + step)
        else:
            x = xp.where(x < low - step, low, x + step)
        by -= step
    return x


def normalize_chunk_size(chunk_size) -> Optional[int]:
    """``None`` or a positive int number of tokens (``ValueError`` otherwise)."""
    if chunk_size is None:
        return None
    value = _whole(chunk_size)
    if value is None or value <= 0:
        raise ValueError(f"chunk_size must be a positive int number of tokens (Llama 4 uses "
                         f"8192), or None for no chunks. Got {chunk_size=!r}.")
    return min(value, MAX_WINDOW)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of a mask (hashable, usable as a static argument).

    Attributes:
      causal: query position ``i`` sees key positions ``<= i`` (and, with
        bidirectional ids, every key that carries its non-zero id).
      window: ``(left, right)``: query position ``i`` sees key positions
        ``i - left .. i + right``; combines with ``causal``. ``None``: unbounded.
      chunk_size: query and key see each other only inside one chunk
        ``position // chunk_size`` (Llama 4's local layers). ``None``: one chunk.
      mask_fn: the escape hatch for a mask no family covers: a jittable
        elementwise predicate ``mask_fn(q: Tokens, kv: Tokens) -> bool`` on
        broadcastable metadata, ANDed with the rest. It is evaluated per element;
        tiles are skipped only where the other fields rule them out (a tile it
        alone empties is still computed, fully masked), and no tile runs unmasked.
        Compiled programs are keyed on the function object: define it once.
    """

    causal: bool = False
    window: Optional[tuple[int, int]] = None
    chunk_size: Optional[int] = None
    mask_fn: Optional[Callable] = None

    @classmethod
    def make(cls, causal: bool = False, window: int | tuple[int, int] | None = None,
             chunk_size: int | None = None, mask_fn: Callable | None = None) -> "MaskSpec":
        if mask_fn is not None and not callable(mask_fn):
            raise ValueError(f"mask_fn must be a callable mask_fn(q_tokens, kv_tokens) -> bool "
                             f"array, or None. Got {mask_fn!r}.")
        return cls(causal=bool(causal), window=normalize_window(window),
                   chunk_size=normalize_chunk_size(chunk_size), mask_fn=mask_fn)

    @property
    def bounded(self) -> bool:
        """Whether a tile may be ``PARTIAL`` by the static fields alone (else only the
        tokens' ids can mask)."""
        return (self.causal or self.window is not None or self.chunk_size is not None
                or self.mask_fn is not None)


#: What a :class:`Tokens` holds: ``jax.Array`` in the kernels, numpy arrays on host,
#: and, as a pytree, anything its leaves map to (shardings, ``ShapeDtypeStruct``, ints).
Leaf = TypeVar("Leaf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tokens(Generic[Leaf]):
    """Per-token metadata of a run of tokens.

    Attributes:
      positions: ``int32[batch, seq]`` global token positions.
      segment_ids: ``int32[batch, seq]`` document ids (tokens attend only within
        their document), or ``None`` for one document.
      bidirectional_ids: ``int32[batch, seq]``: tokens that carry the same non-zero
        id see each other in both directions under a causal mask (a prefix-LM
        prompt, an image's tokens); ``0`` is plain causal. ``None``: all zero.
    """

    positions: Leaf
    segment_ids: Optional[Leaf] = None
    bidirectional_ids: Optional[Leaf] = None


def visible(spec: MaskSpec, q: Tokens, kv: Tokens):
    """The mask predicate: may a query see a key? Broadcasts like its inputs.

    Args:
      spec: the static mask.
      q, kv: metadata whose fields broadcast against each other (e.g. ``[..., Sq, 1]``
        against ``[..., 1, Sk]``); ``kv``'s optional fields are None where ``q``'s are.
    Returns:
      bool array of the broadcast shape (or ``None`` when nothing is masked).
    """
    ok = None

    def both(a, b):
        return b if a is None else a & b

    q_pos, kv_pos = q.positions, kv.positions
    if spec.causal:
        causal = kv_pos <= q_pos
        if q.bidirectional_ids is not None:
            q_bid, kv_bid = q.bidirectional_ids, kv.bidirectional_ids
            causal = causal | ((q_bid == kv_bid) & (q_bid != 0))
        ok = both(ok, causal)
    if spec.window is not None:  # edges saturate at the int32 limits, never wrap
        left, right = spec.window
        ok = both(ok, (kv_pos >= shifted(q_pos, -left)) & (kv_pos <= shifted(q_pos, right)))
    if spec.chunk_size is not None:
        ok = both(ok, q_pos // spec.chunk_size == kv_pos // spec.chunk_size)
    if q.segment_ids is not None:
        ok = both(ok, (q.segment_ids == kv.segment_ids) & (q.segment_ids != PAD_SEGMENT))
    if spec.mask_fn is not None:
        ok = both(ok, spec.mask_fn(q, kv))
    return ok


def rows(tokens: Tokens) -> Tokens:
    """``[..., S]`` metadata as ``[..., S, 1]`` (the query side of :func:`visible`)."""
    return jax.tree.map(lambda x: x[..., :, None], tokens)


def cols(tokens: Tokens) -> Tokens:
    """``[..., S]`` metadata as ``[..., 1, S]`` (the key side of :func:`visible`)."""
    return jax.tree.map(lambda x: x[..., None, :], tokens)


def visible_tokens(spec: MaskSpec, q: Tokens, kv: Tokens):
    """``bool[batch, Sq, Sk]`` mask of :func:`visible` for two runs of tokens (or None)."""
    return visible(spec, rows(q), cols(kv))


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


def _namespace(x):
    """numpy for numpy arrays (host counts: :mod:`jax_seqpar.core.work`), else jax.numpy."""
    return np if isinstance(x, np.ndarray) else jnp


def summarize(tokens: Tokens, block: int, *, per_row: bool = False) -> BlockSummary:
    """Summarize ``tokens`` (seq a multiple of ``block``) block by block: over the whole
    batch (``[num_blocks]`` fields), or for each batch row with ``per_row``. Numpy
    tokens give numpy summaries (the same rule on host)."""
    xp = _namespace(tokens.positions)
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
    xp = _namespace(q.pos_min)

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
