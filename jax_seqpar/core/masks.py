"""Attention masks from per-token metadata, and their block classification.

A mask is never a dense ``[S, S]`` array. It is a static :class:`MaskSpec`
(``causal``, ``window``) applied to per-token metadata (:class:`Tokens`: global
positions and optional segment ids). The same predicate serves every kernel and
every strategy, so a mask means the same thing whatever the token order or the
sharding.

For skipping work, :func:`summarize` reduces the metadata of a block of tokens to
its ranges, and :func:`classify` tells, for every (query block, key block) pair,
whether it is ``EMPTY`` (nothing visible: skip it), ``FULL`` (everything visible:
no mask needed) or ``PARTIAL``. The classification is conservative: ``EMPTY`` and
``FULL`` are only claimed when they hold for every token pair and batch row.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional, Union

import jax
import jax.numpy as jnp

EMPTY, PARTIAL, FULL = 0, 1, 2

#: The log-sum-exp given to a query row that sees no key: finite, so merges and
#: gradients stay NaN-free, and so low that any real block outweighs it.
EMPTY_LSE = -1e30

#: The segment id of padding, reserved: never a real document. The global entry point
#: pads sequences with it; layouts and work counts give it no work.
PAD_SEGMENT = -(2**31)


def normalize_window(window: Union[None, int, tuple[int, int]]) -> Optional[tuple[int, int]]:
    """``None``, one int (both sides) or ``(left, right)`` -> ``(left, right)`` or None."""
    if window is None:
        return None
    if isinstance(window, numbers.Integral):
        window = (window, window)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be an int or a (left, right) pair. Got {window!r}.")
    left, right = (int(w) for w in window)
    if left < 0 or right < 0:
        raise ValueError(f"window sides must be >= 0. Got {window=}.")
    return left, right


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
    if spec.window is not None:
        left, right = spec.window
        ok = both(ok, (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right))
    if q_seg is not None:
        ok = both(ok, q_seg == kv_seg)
    return ok


def visible_tokens(spec: MaskSpec, q: Tokens, kv: Tokens):
    """``bool[batch, Sq, Sk]`` mask of :func:`visible` for two runs of tokens (or None)."""
    q_seg = None if q.segment_ids is None else q.segment_ids[:, :, None]
    kv_seg = None if kv.segment_ids is None else kv.segment_ids[:, None, :]
    return visible(spec, q.positions[:, :, None], kv.positions[:, None, :], q_seg, kv_seg)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockSummary:
    """Ranges of the metadata of each block of tokens, ``int32[num_blocks]``.

    Taken over the whole batch, so one decision holds for every batch row.
    """

    pos_min: jax.Array
    pos_max: jax.Array
    seg_min: Optional[jax.Array] = None
    seg_max: Optional[jax.Array] = None


def summarize(tokens: Tokens, block: int) -> BlockSummary:
    """Summarize ``tokens`` (seq a multiple of ``block``) into per-block ranges."""
    batch, seq = tokens.positions.shape
    if seq % block:
        raise ValueError(f"{seq=} must be a multiple of {block=}.")

    def ranges(x):
        x = x.reshape(batch, seq // block, block)
        return x.min(axis=(0, 2)), x.max(axis=(0, 2))

    pos_min, pos_max = ranges(tokens.positions)
    if tokens.segment_ids is None:
        return BlockSummary(pos_min, pos_max)
    seg_min, seg_max = ranges(tokens.segment_ids)
    return BlockSummary(pos_min, pos_max, seg_min, seg_max)


def classify(spec: MaskSpec, q: BlockSummary, kv: BlockSummary) -> jax.Array:
    """``int8[num_q_blocks, num_kv_blocks]`` of ``EMPTY`` / ``PARTIAL`` / ``FULL``.

    int8 keeps the table a quarter of int32's size; the Pallas kernels only reduce it
    to per-row loop bounds (fused, never stored).
    """
    q_lo, q_hi = q.pos_min[:, None], q.pos_max[:, None]
    k_lo, k_hi = kv.pos_min[None, :], kv.pos_max[None, :]
    empty = jnp.zeros(jnp.broadcast_shapes(q_lo.shape, k_lo.shape), bool)
    full = jnp.ones_like(empty)
    if spec.causal:
        empty |= k_lo > q_hi
        full &= k_hi <= q_lo
    if spec.window is not None:
        left, right = spec.window
        empty |= (k_lo > q_hi + right) | (k_hi < q_lo - left)
        full &= (k_hi <= q_lo + right) & (k_lo >= q_hi - left)
    if q.seg_min is not None:
        qs_lo, qs_hi = q.seg_min[:, None], q.seg_max[:, None]
        ks_lo, ks_hi = kv.seg_min[None, :], kv.seg_max[None, :]
        empty |= (ks_lo > qs_hi) | (ks_hi < qs_lo)
        full &= (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)
