"""The per-document token order: balanced causal work for rows of packed documents.

Zigzag balances the causal work of ONE document filling the sequence. Packed rows hold
many documents, each causal within itself, and there zigzag can leave a device with
twice the mean work. The per-document order balances every device's
causal-within-document work (the visible (query, key) pairs of its queries) to within
a few percent of the mean, for any mix of document lengths and padding.

Per row (``S`` tokens, ``P`` shards of ``L = S/P`` slots, tile ``c``):

1. Documents are the groups of equal segment id (the mask's meaning). Every document
   is *folded*: its offsets ``t`` and ``n-1-t`` form a pair of work ``n + 1``, so a set
   of whole pairs has the document's mean work per token, ``(n + 1) / 2``. Padding
   (:data:`jax_seqpar.core.masks.PAD_SEGMENT`) has work 0.
2. *Dealt* documents (``n >= 2Pc`` tokens, or more work than a shard's mean) are
   dealt to every shard by pair index, a zigzag inside the document: every shard gets
   the same tokens and the same work of each, and the same share at every ring step.
   Runs of whole tiles first, then token-level runs; fewer than ``2P`` middle
   tokens are left over.
3. Everything else, the *fill* (shorter documents kept whole, those middle tokens,
   padding), is one stream merged from a dense half (tokens of documents denser than
   the fill's mean) and a sparse half, in order of each half's running excess work, so
   the merged stream's running excess never strays further than one token's from
   zero. Cut cyclically into ``P`` windows of equal length, it gives every shard the
   mean fill work up to a few tokens' worth, and keeps each short document on one
   shard (two where a window ends inside it).
4. Within a shard, tokens are sorted by (padding last, document, position): each
   document's tokens are contiguous and causal, so tiles stay document-pure except
   where two documents meet.

The steps are sorts, cumulative sums and searches: no data-dependent shape, no loop
over documents. The one implementation runs on host numpy (a data pipeline step,
:func:`jax_seqpar.permute_batch`) and in ``jax.numpy`` (traceable: the global entry
point's ``layout="per_document"`` computes it from traced segment ids).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core import mask_packing
from jax_seqpar.core.masks import PAD_SEGMENT, MaskSpec, Tokens

__all__ = ["DEFAULT_BLOCK", "balance_bound", "document_shards", "per_document_positions",
           "widest_documents"]

#: The tile the layout aligns dealt runs to unless told. It divides every kernel's
#: default tiles (XLA 256, Triton 128 or 64, Mosaic 512 are multiples of it).
DEFAULT_BLOCK = 128


def _is_numpy(xp) -> bool:
    return xp is np


def _sort_order(xp, *keys):
    """``int32`` stable argsort by ``keys`` (most significant first), 1-D."""
    if _is_numpy(xp):
        return np.lexsort(keys[::-1]).astype(np.int32)
    iota = jax.lax.iota(np.int32, keys[0].shape[0])
    return jax.lax.sort((*keys, iota), num_keys=len(keys), is_stable=True)[-1]


def _scatter(xp, index, values):
    """``out[index] = values`` for a permutation ``index``."""
    if _is_numpy(xp):
        out = np.empty_like(values)
        out[index] = values
        return out
    return xp.zeros_like(values).at[index].set(values)


def _row_positions(xp, seg, *, num_shards: int, block: int, spread_tokens: int):
    """``int32[S]``: the natural position of the token at each slot, for one row."""
    size = seg.shape[0]
    P = num_shards
    real_dtype = np.float64 if _is_numpy(xp) else np.float32
    idx = xp.arange(size, dtype=np.int32)

    # 1. Documents: tokens in (id, position) order ("document order" from here on).
    order = _sort_order(xp, seg)
    ids = seg[order]
    pad = ids == PAD_SEGMENT
    start = xp.searchsorted(ids, ids, side="left").astype(np.int32)
    n = xp.searchsorted(ids, ids, side="right").astype(np.int32) - start  # its length
    offset = idx - start
    pair = xp.minimum(offset, n - 1 - offset)  # the fold: offsets t and n-1-t pair up
    back = (offset > n - 1 - offset).astype(np.int32)  # 0: the pair's front, 1: its back
    length = n.astype(real_dtype)
    doc_work = length * (length + 1) / 2
    first = offset == 0
    shard_work = xp.sum(xp.where(first & ~pad, doc_work, 0)) / P

    # 2. Dealt documents: pairs [r*q, (r+1)*q) to shard r, whole tiles then tokens.
    dealt_doc = ~pad & (n >= 2 * P) & ((n >= spread_tokens) | (doc_work > shard_work))
    q1 = xp.where(dealt_doc, block * (n // (2 * P * block)), 0)
    q2 = xp.where(dealt_doc, (n - 2 * P * q1) // (2 * P), 0)
    level1 = pair < P * q1
    dealt = dealt_doc & (pair < P * (q1 + q2))
    dealt_shard = xp.where(level1, pair // xp.maximum(q1, 1),
                           (pair - P * q1) // xp.maximum(q2, 1))

    # 3. The fill: a dense and a sparse stream, merged by running excess, cut in P windows.
    fill = ~dealt
    fill_tokens = xp.sum(fill.astype(np.int32))
    window_len = fill_tokens // P  # the same for every shard (S and dealt tokens are P-fold)
    density = xp.where(pad, 0, (length + 1) / 2)
    mean_density = xp.sum(xp.where(fill, density, 0)) / xp.maximum(fill_tokens, 1)
    excess = density - mean_density
    # Stream order: fill tokens first, each document's pairs in order, front before back.
    stream = _sort_order(xp, (~fill).astype(np.int32), start, 2 * pair + back)
    in_fill = fill[stream]
    weight = xp.where(in_fill, xp.abs(excess[stream]), 0)
    dense = (excess > 0)[stream]
    halves = xp.stack([xp.where(dense, weight, 0), xp.where(dense, 0, weight)])  # [2, S]
    running = xp.cumsum(halves, axis=1)
    # Each token's key: its stream's running |excess| at the token's midpoint, as a
    # fraction of the stream's total (both streams' totals are equal: the excess sums to 0).
    fraction = (running - halves / 2) / xp.maximum(running[:, -1:], 1e-30)
    key = xp.where(dense, fraction[0], fraction[1])
    merged = stream[_sort_order(xp, (~in_fill).astype(np.int32), key.astype(real_dtype))]
    # Cyclic windows at an offset of half a window: every shard has two cut ends.
    slot = (idx + window_len // 2) % xp.maximum(fill_tokens, 1)
    fill_shard = _scatter(xp, merged, (slot // xp.maximum(window_len, 1)).astype(np.int32))
    shard = xp.where(dealt, dealt_shard, fill_shard).astype(np.int32)

    # 4. Slots by (shard, padding last); document order is kept within (stable sort).
    return order[_sort_order(xp, 2 * shard + pad.astype(np.int32))]


def _namespace(segment_ids):
    return np if isinstance(segment_ids, np.ndarray) else jnp


def per_document_positions(segment_ids: jax.typing.ArrayLike, num_shards: int,
                           block_size: int = DEFAULT_BLOCK, *,
                           spread_tokens: Optional[int] = None,
                           bidirectional_ids: jax.typing.ArrayLike | None = None,
                           chunk_size: Optional[int] = None):
    """The per-document order of packed rows: ``int32[B, S]`` natural positions.

    ``positions[b, i]`` is the natural position of the token at slot ``i`` of row
    ``b``; shard ``r`` of ``P`` holds slots ``r*S/P .. (r+1)*S/P - 1``. Every row is
    laid out on its own; a shard's work is the sum over its rows.

    Args:
      segment_ids: ``int[B, S]`` (or ``[S]``) document ids in natural order; tokens
        with :data:`~jax_seqpar.core.masks.PAD_SEGMENT` are padding (no work, last in
        their shard). A numpy array is laid out on host in numpy; a JAX array (or a
        tracer, under ``jit``) in ``jax.numpy``.
      num_shards: ``P``; ``S`` must be divisible by it.
      block_size: the kernel tile dealt runs are aligned to (any positive int; only
        the tile counts depend on it, never correctness).
      spread_tokens: documents at least this long are dealt to every shard (default
        ``2 * P * block_size``: every run whole tiles). Documents with more work than
        a shard's mean are dealt whatever their length. (The causal order only.)
      bidirectional_ids: ``int[B, S]`` (or ``[S]``) in natural order, or None; with
        ``chunk_size`` (or None: one chunk), the causal mask the order balances. When
        either is given, every token costs the pairs the mask gives it and documents
        are dealt in whole tiles (:mod:`jax_seqpar.core.mask_packing`, host numpy:
        numpy ids only); else the causal order above (numpy or traced).

    Returns:
      ``int32[B, S]`` (``[S]`` for ``[S]`` ids), numpy for numpy ids, else a JAX array.

    Raises:
      ValueError: ``S`` not divisible by ``num_shards``, a non-positive size, or
        bidirectional ids or chunks with traced (JAX) ids or of another shape.

    >>> ids = np.repeat(np.arange(4), [100, 12, 10, 6])[None]   # one row, 4 documents
    >>> per_document_positions(ids, num_shards=4, block_size=16).shape
    (1, 128)
    """
    for name, value in (("num_shards", num_shards), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int. Got {name}={value!r}.")
    xp = _namespace(segment_ids)
    seg = xp.asarray(segment_ids).astype(np.int32)
    if seg.ndim not in (1, 2):
        raise ValueError(f"segment_ids must be [batch, seq] (or [seq]). Got {seg.shape}.")
    rows = seg if seg.ndim == 2 else seg[None]
    seq_len = rows.shape[1]
    if seq_len % num_shards:
        padded = -(-seq_len // num_shards) * num_shards
        raise ValueError(f"per_document needs seq_len divisible by num_shards. Got {seq_len=} "
                         f"with {num_shards=}; pad the rows to {padded} tokens with segment "
                         f"id PAD_SEGMENT ({PAD_SEGMENT}).")
    spread = 2 * num_shards * block_size if spread_tokens is None else int(spread_tokens)
    options = dict(num_shards=int(num_shards), block=int(block_size), spread_tokens=spread)
    if bidirectional_ids is not None or chunk_size is not None:
        spec = MaskSpec.make(causal=True, chunk_size=chunk_size)
        positions = _masked_rows(spec, Tokens(None, rows, bidirectional_ids),
                                 num_shards=int(num_shards), block=int(block_size))
    elif _is_numpy(xp):
        positions = (np.stack([_row_positions(np, r, **options) for r in rows])
                     if rows.shape[0] else rows)
    else:
        positions = _traced_rows(rows, **options)
    return positions if seg.ndim == 2 else positions[0]


def _masked_rows(spec: MaskSpec, natural: Tokens, *, num_shards: int, block: int):
    """The mask-balanced order (:mod:`.mask_packing`) of ``natural``'s numpy rows:
    segment ids ``[B, S]``, bidirectional ids ``[B, S]`` or ``[S]`` (or None)."""
    rows, bids = natural.segment_ids, natural.bidirectional_ids
    if not isinstance(rows, np.ndarray) or not (bids is None or isinstance(bids, np.ndarray)):
        raise ValueError("the per_document order balanced by bidirectional_ids/chunk_size is "
                         "laid out on host: pass numpy segment_ids and bidirectional_ids (a "
                         "data pipeline step, jax_seqpar.permute_batch), not JAX arrays.")
    if bids is not None:
        given_shape = bids.shape
        bids = bids[None] if bids.ndim == 1 else bids
        if bids.shape != rows.shape:
            raise ValueError(f"bidirectional_ids must have the shape of segment_ids "
                             f"{rows.shape}. Got {given_shape}.")
    arange = np.arange(rows.shape[1], dtype=np.int32)
    return np.stack([mask_packing.masked_row_positions(
        spec, Tokens(arange, row, None if bids is None else bids[b].astype(np.int32)),
        num_shards=num_shards, block=block) for b, row in enumerate(rows)]
                    ) if rows.shape[0] else rows


@functools.partial(jax.jit, static_argnames=("num_shards", "block", "spread_tokens"))
def _traced_rows(rows, **options):
    """The rows' orders in ``jax.numpy``, one program (eager, op by op, is far slower)."""
    return jax.vmap(lambda row: _row_positions(jnp, row, **options))(rows)


def balance_bound(segment_ids: jax.Array, num_shards: int, block_size: int = DEFAULT_BLOCK, *,
                  spread_tokens: Optional[int] = None) -> np.ndarray:
    """Per row, a guaranteed bound on the per-document order's busiest/mean shard work.

    ``1 + (2 x_max + 2 n_cut) / mean``: ``x_max`` is the fill's largest excess density
    (the merge keeps the running excess within it), ``n_cut`` the fold rounding of the
    documents a window end cuts (at most one dense and one sparse document each);
    dealt documents are exact. Host numpy, known before attending.

    Args:
      segment_ids: ``int[B, S]`` (or ``[S]``); num_shards, block_size, spread_tokens:
        as :func:`per_document_positions`.

    Returns:
      ``float64[B]``.
    """
    seg = np.asarray(segment_ids)
    seg = seg[None] if seg.ndim == 1 else seg
    P = num_shards
    spread = 2 * P * block_size if spread_tokens is None else int(spread_tokens)
    bounds = []
    for row in seg:
        ids, n = np.unique(row, return_counts=True)
        real = ids != PAD_SEGMENT
        work = n * (n + 1) / 2
        mean = work[real].sum() / P
        dealt = real & (n >= 2 * P) & ((n >= spread) | (work > mean))
        q1 = np.where(dealt, block_size * (n // (2 * P * block_size)), 0)
        q2 = np.where(dealt, (n - 2 * P * q1) // (2 * P), 0)
        left = np.where(dealt, n - 2 * P * (q1 + q2), n)  # each document's fill tokens
        density = np.where(real, (n + 1) / 2, 0.0)
        mean_density = (density * left).sum() / max(left.sum(), 1)
        has = left > 0
        x_max = np.abs(density - mean_density)[has].max() if has.any() else 0.0
        n_cut = n[has & real].max() if (has & real).any() else 0.0
        bounds.append(1 + (2 * x_max + 2 * n_cut) / max(mean, 1))
    return np.array(bounds)


def _row_widest(xp, ids, num_shards: int):
    """``(span, document)``: the most consecutive shards of ``num_shards`` (slot ``i`` on
    shard ``i // (S/P)``) one document of the 1-D ``ids`` spans, and that document
    (padding spans nothing; ``(0, PAD_SEGMENT)`` for a row of padding)."""
    size = ids.shape[0]
    shard = (xp.arange(size, dtype=np.int32) // max(size // num_shards, 1)).astype(np.int32)
    order = _sort_order(xp, ids, shard)
    ids, shard = ids[order], shard[order]
    first = shard[xp.searchsorted(ids, ids, side="left")]
    last = shard[xp.searchsorted(ids, ids, side="right") - 1]
    span = xp.where(ids == PAD_SEGMENT, 0, last - first + 1).astype(np.int32)
    widest = xp.argmax(span) if size else 0
    return (span[widest], ids[widest]) if size else (np.int32(0), np.int32(PAD_SEGMENT))


def widest_documents(ids: jax.typing.ArrayLike, num_shards: int):
    """Per row, ``(span int32[B], document int32[B])``: the most consecutive shards one
    document spans in this order, and the document (see :func:`document_shards`).

    Args:
      ids: ``int[B, S]`` segment ids in the order the shards hold them (shard ``r`` of
        ``P`` holds slots ``r*S/P ..``), numpy (host) or JAX (traceable).
      num_shards: ``P``.
    """
    xp = _namespace(ids)
    rows = xp.asarray(ids).astype(np.int32)
    if _is_numpy(xp):
        pairs = [_row_widest(np, row, num_shards) for row in rows]
        return (np.array([p[0] for p in pairs], np.int32).reshape(len(pairs)),
                np.array([p[1] for p in pairs], np.int32).reshape(len(pairs)))
    return jax.vmap(lambda row: _row_widest(jnp, row, num_shards))(rows)


def document_shards(segment_ids: jax.typing.ArrayLike, num_shards: int):
    """The most consecutive shards any one document spans: ``last - first + 1`` of the
    shards that hold its tokens, the largest over the documents and rows. Pass it on as
    ``max_document_shards=`` (it bounds the mask's reach to ``D - 1`` shards either side).

    Args:
      segment_ids: ``int[B, S]`` (or ``[S]``) document ids in the order the shards hold
        them (after :func:`jax_seqpar.permute_batch`), shard ``r`` of ``P`` holding slots
        ``r*S/P .. (r+1)*S/P - 1``; :data:`~jax_seqpar.core.masks.PAD_SEGMENT` is padding.
      num_shards: ``P``; ``S`` must be divisible by it.

    Returns:
      An ``int`` for numpy or concrete ids (0 for padding alone), else a traced int32
      scalar.

    >>> document_shards(np.repeat(np.arange(3), [5, 6, 5]), num_shards=4)
    2
    """
    ids = segment_ids if isinstance(segment_ids, np.ndarray) else jnp.asarray(segment_ids)
    ids = ids[None] if ids.ndim == 1 else ids
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or (
            num_shards < 1) or ids.ndim != 2 or ids.shape[1] % num_shards:
        raise ValueError(f"document_shards needs int[batch, seq] ids and a positive "
                         f"num_shards dividing seq. Got ids of shape {tuple(ids.shape)}, "
                         f"{num_shards=!r}.")
    span, _ = widest_documents(ids, int(num_shards))
    widest = span.max(initial=0) if isinstance(span, np.ndarray) else jnp.max(span, initial=0)
    return widest if isinstance(widest, jax.core.Tracer) else int(widest)
