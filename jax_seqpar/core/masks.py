"""Attention masks from per-token metadata, and their block classification.

A mask is never a dense ``[S, S]`` array. It is a static :class:`MaskSpec`
(``causal``, ``window``) applied to per-token metadata (:class:`Tokens`: global
positions and optional segment ids). The same predicate serves every kernel and
every strategy, so a mask means the same thing whatever the token order or the
sharding.

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
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2

#: The log-sum-exp given to a query row that sees no key: finite, so merges and
#: gradients stay NaN-free, and so low that any real block outweighs it.
EMPTY_LSE = -1e30

#: The segment id of padding, reserved: never a real document. A padded token sees no
#: key and no query sees it; the global entry point and the kernels pad with it, and
#: layouts and work counts give it no work.
PAD_SEGMENT = -(2**31)

#: Bits of a tile's segment signature: bit ``id % 32`` is set for every document in it.
SIGNATURE_BITS = 32


#: A window side this large reaches every pair of int32 positions (their difference is
#: at most ``2**32 - 1``): larger sides are clamped to it, which changes nothing.
MAX_WINDOW = 2**32 - 1


def _window_side(window, side):
    if isinstance(side, (bool, np.bool_)) or isinstance(side, (float, np.floating)):
        side = None  # True is not a length, and 2.5 tokens are none
    else:
        try:
            side = operator.index(side)  # ints, numpy ints, concrete integer 0-d arrays
        except TypeError:
            side = None
    if side is None:
        raise ValueError(f"window sides must be whole numbers of tokens (ints): window=k or "
                         f"(left, right). Got {window=}.")
    if side < 0:
        raise ValueError(f"window sides must be >= 0. Got {window=}.")
    return min(side, MAX_WINDOW)


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
    return tuple(_window_side(window, side) for side in window)


def shifted(x, by: int):
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


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of a mask (hashable, usable as a static argument).

    Attributes:
      causal: query position ``i`` sees key positions ``<= i``.
      window: ``(left, right)``: query position ``i`` sees key positions
        ``i - left .. i + right``; combines with ``causal``. ``None``: unbounded.
    """

    causal: bool = False
    window: Optional[tuple[int, int]] = None

    @classmethod
    def make(cls, causal: bool = False, window=None) -> "MaskSpec":
        return cls(causal=bool(causal), window=normalize_window(window))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tokens:
    """Per-token metadata of a run of tokens.

    Attributes:
      positions: ``int32[batch, seq]`` global token positions.
      segment_ids: ``int32[batch, seq]`` document ids (tokens attend only within
        their document), or ``None`` for one document.
    """

    positions: jax.Array
    segment_ids: Optional[jax.Array] = None


def visible(spec: MaskSpec, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """The mask predicate: may a query see a key? Broadcasts like its inputs.

    Args:
      spec: causal / window.
      q_pos, kv_pos: integer positions, broadcastable against each other
        (e.g. ``[..., Sq, 1]`` and ``[..., 1, Sk]``).
      q_seg, kv_seg: segment ids of the same shapes, or ``None``.
    Returns:
      bool array of the broadcast shape (or ``None`` when nothing is masked).
    """
    ok = None

    def both(a, b):
        return b if a is None else a & b

    if spec.causal:
        ok = both(ok, kv_pos <= q_pos)
    if spec.window is not None:  # edges saturate at the int32 limits, never wrap
        left, right = spec.window
        ok = both(ok, (kv_pos >= shifted(q_pos, -left)) & (kv_pos <= shifted(q_pos, right)))
    if q_seg is not None:
        ok = both(ok, (q_seg == kv_seg) & (q_seg != PAD_SEGMENT))
    return ok


def visible_tokens(spec: MaskSpec, q: Tokens, kv: Tokens):
    """``bool[batch, Sq, Sk]`` mask of :func:`visible` for two runs of tokens (or None)."""
    q_seg = None if q.segment_ids is None else q.segment_ids[:, :, None]
    kv_seg = None if kv.segment_ids is None else kv.segment_ids[:, None, :]
    return visible(spec, q.positions[:, :, None], kv.positions[:, None, :], q_seg, kv_seg)


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
    """

    pos_min: jax.Array
    pos_max: jax.Array
    seg_min: Optional[jax.Array] = None
    seg_max: Optional[jax.Array] = None
    seg_bits: Optional[jax.Array] = None
    padded: Optional[jax.Array] = None


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
    if tokens.segment_ids is None:
        return BlockSummary(positions.min(axis=axes), positions.max(axis=axes))
    segments = tokens.segment_ids.reshape(shape)
    pad = segments == PAD_SEGMENT
    top, bottom = np.iinfo(np.int32).max, np.iinfo(np.int32).min

    def ranges(x):
        return xp.where(pad, top, x).min(axis=axes), xp.where(pad, bottom, x).max(axis=axes)

    bit = xp.left_shift(np.uint32(1), xp.bitwise_and(segments, SIGNATURE_BITS - 1)
                        .astype(np.uint32))
    bits = xp.bitwise_or.reduce(xp.where(pad, np.uint32(0), bit), axis=axes)
    return BlockSummary(*ranges(positions), *ranges(segments), bits, pad.any(axis=axes))


def classify(spec: MaskSpec, q: BlockSummary, kv: BlockSummary) -> jax.Array:
    """``int8[..., num_q_blocks, num_kv_blocks]`` of ``EMPTY`` / ``PARTIAL`` / ``FULL``.

    Leading dims broadcast: batch-wide summaries give ``[nq, nk]``, per-row ones
    ``[B, nq, nk]``. int8 keeps the table a quarter of int32's size; the Pallas kernels
    only reduce it to per-row loop bounds (fused, never stored).
    """
    xp = _namespace(q.pos_min)
    rows = lambda x: x[..., :, None]  # noqa: E731
    cols = lambda x: x[..., None, :]  # noqa: E731
    q_lo, q_hi, k_lo, k_hi = rows(q.pos_min), rows(q.pos_max), cols(kv.pos_min), cols(kv.pos_max)
    empty = xp.zeros(np.broadcast_shapes(q_lo.shape, k_lo.shape), bool)
    full = xp.ones_like(empty)
    if spec.causal:
        empty |= k_lo > q_hi
        full &= k_hi <= q_lo
    if spec.window is not None:
        left, right = spec.window
        empty |= (k_lo > shifted(q_hi, right)) | (k_hi < shifted(q_lo, -left))
        full &= (k_hi <= shifted(q_lo, right)) & (k_lo >= shifted(q_hi, -left))
    if q.seg_min is not None:
        qs_lo, qs_hi, ks_lo, ks_hi = (rows(q.seg_min), rows(q.seg_max), cols(kv.seg_min),
                                      cols(kv.seg_max))
        empty |= (ks_lo > qs_hi) | (ks_hi < qs_lo) | ((rows(q.seg_bits) & cols(kv.seg_bits)) == 0)
        full &= (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
        full &= ~rows(q.padded) & ~cols(kv.padded)
    return xp.where(empty, EMPTY, xp.where(full, FULL, PARTIAL)).astype(np.int8)
