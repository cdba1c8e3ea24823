"""Documents stay home: the per-document order that keeps each document on few shards.

:mod:`jax_seqpar.core.packing` balances every device's work, dealing long documents to
every shard: every device then needs keys from every other. Here the balance is kept
(every shard near the mean visible pairs and computed tiles) while each document lies on
at most ``D`` consecutive shards, so a query's keys lie within ``D - 1`` shards on either
side and a strategy sends only that reach (:func:`jax_seqpar.core.reach.mask_reach`).
Per row (``S`` tokens, ``P`` shards of ``L = S/P`` slots):

1. Every token costs the keys it sees (:func:`jax_seqpar.core.work.token_work`: causal
   within its document, a bidirectional prefix or image, chunks).
2. *Spread* documents, those with more work than a shard's mean (or more tokens than a
   shard holds), go to ``k <= D`` consecutive shards, ``k`` the fewest that can carry
   them, where they add least to the busiest: inside the span the document is laid out
   by :func:`jax_seqpar.core.packing.per_document_positions` over ``k`` shards (every
   shard of the span takes the same share of its work).
3. *Home* documents, the rest, are whole units of one stream (each in folded order: its
   tokens ``t`` and ``n-1-t`` together, so any cut of it has its mean cost per token),
   cut into the shards' free slots in shard order, never wrapping: a document shorter
   than its shard's room stays whole on one shard, or on two where a cut falls inside it.
   The stream is built greedily, largest documents first, each the one that brings the
   next cut's cumulative work nearest its target (the mean less the spread documents'
   work), within ``D`` shards.
4. Within a shard, tokens are sorted by (padding last, document, position).

Host numpy only (a data pipeline step): loops over documents. Exactness never depends on
it: positions travel with the tokens, and the attention checks the bound.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jax_seqpar.core import masks, packing, work
from jax_seqpar.core.masks import PAD_SEGMENT

__all__ = ["PAIRS_BOUND", "TILES_BOUND", "balance", "home_positions", "home_row_positions"]

#: The balance a bound must keep: the busiest shard's visible pairs and computed tiles
#: over their means (those of the unbounded per-document order, issue 29).
PAIRS_BOUND, TILES_BOUND = 1.05, 1.10
#: A cut's cumulative work within this fraction of a shard's mean is on target: the stream
#: then takes the largest document that stays on target.
ON_TARGET = 0.01


def _spread(doc_tokens, span: int, spec: masks.MaskSpec, natural: masks.Tokens, *, block: int):
    """``[k, m]`` natural indices (``-1``: none) of one document laid out over ``span``
    shards by :func:`jax_seqpar.core.packing.per_document_positions`."""
    n = doc_tokens.size
    size = -(-n // span) * span
    sub = np.full(size, PAD_SEGMENT, np.int32)
    sub[:n] = 0
    sub_bids = None
    if natural.bidirectional_ids is not None or spec.chunk_size is not None:
        sub_bids = np.zeros((1, size), np.int32)
        if natural.bidirectional_ids is not None:
            sub_bids[0, :n] = np.asarray(natural.bidirectional_ids)[doc_tokens]
    order = packing.per_document_positions(sub[None], span, block, bidirectional_ids=sub_bids,
                                           chunk_size=spec.chunk_size)[0]
    index = np.where(order < n, doc_tokens[np.minimum(order, n - 1)], -1)
    return index.reshape(span, size // span)


def _folded(doc_tokens: np.ndarray) -> np.ndarray:
    """A document's tokens (natural order) folded: ``t`` then ``n-1-t``, ``t = 0, 1, ..``."""
    n = doc_tokens.size
    front, back = doc_tokens[: (n + 1) // 2], doc_tokens[::-1][: n // 2]
    out = np.empty(n, doc_tokens.dtype)
    out[0::2], out[1::2] = front, back
    return out


def _home_stream(ids, cost, home, padding, room, target, *, max_shards: int, block: int):
    """The home documents' tokens in stream order (folded within each), to be cut into
    ``room`` slots per shard in shard order. Shard by shard, the stream takes the
    largest unit (a document, or ``block`` tokens of padding) after which the shard's
    rest can still reach its ``target`` work with the units left (the density it then
    needs lies within theirs), the one nearest that density among equals; where no unit
    fits the rest, the one whose first part brings the shard nearest its target is cut
    (its rest opens the next shard, so it spans two; ``max_shards=1``: padding only)."""
    units = [_folded(np.sort(d)) for d in home]
    units += [padding[i:i + block] for i in range(0, padding.size, block)]
    sizes = np.array([u.size for u in units], np.int64)
    works = np.array([cost[u].sum() for u in units])
    density = works / np.maximum(sizes, 1)
    is_pad = np.array([ids[u[0]] == PAD_SEGMENT for u in units], bool)
    left = np.ones(len(units), bool)
    stream, carried_tokens, carried_work = [], 0, 0.0
    for r in range(room.size):
        tokens, work_left = room[r] - carried_tokens, target[r] - carried_work
        carried_tokens, carried_work = 0, 0.0
        while tokens > 0 and left.any():
            fits = left & (sizes <= tokens)
            if fits.any():
                rest_tokens = tokens - sizes
                want = (work_left - works) / np.maximum(rest_tokens, 1)
                pool = left.copy()
                low, high = density[pool].min(), density[pool].max()
                ok = fits & ((rest_tokens == 0) | ((want >= low) & (want <= high)))
                pick = ok if ok.any() else fits
                gap = np.abs(np.where(rest_tokens > 0, want, works / max(tokens, 1))
                             - work_left / tokens)
                score = np.where(pick, sizes * 1e6 - gap, -np.inf) if ok.any() else np.where(
                    pick, -np.abs(work_left - works - rest_tokens * density[pool].mean()), -np.inf)
                u = int(np.argmax(score))
                stream.append(units[u])
                left[u] = False
                tokens -= sizes[u]
                work_left -= works[u]
                continue
            cut = left & (is_pad | (max_shards > 1))
            if not cut.any():
                cut = left
            first = np.array([cost[units[u][:tokens]].sum() if cut[u] else np.inf
                              for u in range(len(units))])
            u = int(np.argmin(np.abs(first - work_left)))
            stream.append(units[u])
            left[u] = False
            carried_tokens, carried_work = sizes[u] - tokens, works[u] - first[u]
            tokens = 0
    return np.concatenate(stream) if stream else np.zeros(0, np.int64)


def home_row_positions(spec: masks.MaskSpec, tokens: masks.Tokens, *, num_shards: int,
                       max_shards: int, block: int) -> np.ndarray:
    """``int32[S]``: the natural position of the token at each slot, one row, every
    document on at most ``max_shards`` consecutive shards (``ValueError`` where one
    document has more tokens than ``max_shards`` shards hold).

    Args:
      spec: the causal mask the order balances (chunks too); tokens: the row in natural
        order, 1-D fields (``positions`` ``arange(S)``, segment ids, bidirectional ids
        or None); num_shards: ``P``; max_shards: ``D``; block: the tile spread runs
        align to.
    """
    size, P, D = tokens.positions.shape[0], num_shards, max_shards
    L = size // P
    ids = np.asarray(tokens.segment_ids)
    positions = np.asarray(tokens.positions)
    cost = work.token_work(spec, tokens)[0].astype(np.float64)
    order = np.lexsort((positions, ids))
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    docs = np.split(order, starts[1:])
    real = [d for d in docs if ids[d[0]] != PAD_SEGMENT]
    padding = next((d for d in docs if ids[d[0]] == PAD_SEGMENT), np.zeros(0, np.int64))
    total = sum(cost[d].sum() for d in real)
    mean = max(total / P, 1e-30)
    shard = np.full(size, -1, np.int64)
    room = np.full(P, L)
    target = np.full(P, mean)

    # 2. Spread documents, costliest first, on the span that keeps the busiest lowest.
    home = []
    for doc in sorted(real, key=lambda d: -cost[d].sum()):
        n, doc_work = doc.size, cost[doc].sum()
        if n > D * L:
            raise ValueError(f"a document of {n} tokens cannot lie on max_document_shards={D} "
                             f"shards of {L} tokens: pass max_document_shards >= {-(-n // L)}.")
        span = max(-(-n // L), int(np.ceil(doc_work / mean - 1e-9)))
        if span < 2:
            home.append(doc)
            continue
        span = min(span, D)
        fits = [s for s in range(P - span + 1) if (room[s:s + span] >= -(-n // span)).all()]
        if not fits:
            home.append(doc)
            continue
        start = min(fits, key=lambda s: (-(target[s:s + span].min()), s))
        laid = _spread(np.sort(doc), span, spec, tokens, block=block)
        for j, row in enumerate(laid):
            mine = row[row >= 0]
            shard[mine] = start + j
            room[start + j] -= mine.size
            target[start + j] -= cost[mine].sum()

    # 3. The home stream, cut into the shards' free slots in shard order.
    stream = _home_stream(ids, cost, home, padding, room, target, max_shards=D, block=block)
    if stream.size:
        shard[stream] = np.searchsorted(np.cumsum(room), np.arange(stream.size), side="right")

    # 4. Slots by (shard, padding last, document, position).
    pad = (ids == PAD_SEGMENT).astype(np.int64)
    return np.lexsort((positions, ids, pad, shard)).astype(np.int32)


def balance(spec: masks.MaskSpec, laid_out: masks.Tokens, num_shards: int, block: int
            ) -> tuple[float, float]:
    """``(pairs, tiles)``: the busiest shard's visible pairs and computed ``block`` tiles
    (:mod:`jax_seqpar.core.work`, summed over the rows) over their means, for ``int[B, S]``
    tokens in layout order."""
    pairs = work.work_per_shard(spec, laid_out, num_shards).astype(np.float64)
    tiles = work.computed_tiles_per_shard(spec, laid_out, num_shards,
                                          block_q=block).astype(np.float64)
    return (float(pairs.max() / max(pairs.mean(), 1e-30)),
            float(tiles.max() / max(tiles.mean(), 1e-30)))


def _laid_out(natural: masks.Tokens, positions: np.ndarray) -> masks.Tokens:
    take = lambda x: None if x is None else np.take_along_axis(x, positions, axis=1)  # noqa
    return masks.Tokens(positions, take(natural.segment_ids), take(natural.bidirectional_ids))


def _try(spec, natural, num_shards, bound, block):
    """``(positions [B, S], (pairs, tiles), widest span)`` of the home order for ``bound``."""
    rows = []
    for b in range(natural.segment_ids.shape[0]):
        row = masks.Tokens(natural.positions[b], natural.segment_ids[b],
                           None if natural.bidirectional_ids is None
                           else natural.bidirectional_ids[b])
        rows.append(home_row_positions(spec, row, num_shards=num_shards, max_shards=bound,
                                       block=block))
    positions = np.stack(rows).astype(np.int32)
    laid = _laid_out(natural, positions)
    return positions, balance(spec, laid, num_shards, block), packing.document_shards(
        np.asarray(laid.segment_ids), num_shards)


def home_positions(spec: masks.MaskSpec, natural: masks.Tokens, num_shards: int,
                   max_document_shards: int | str, *, block: int) -> np.ndarray:
    """``int32[B, S]``: the home order of numpy rows, every document on at most ``D``
    consecutive shards and every shard within :data:`PAIRS_BOUND` / :data:`TILES_BOUND`
    of the mean (summed over the rows).

    Args:
      spec: the causal mask (chunks too); natural: ``int[B, S]`` rows in natural order
        (positions ``arange(S)``, segment ids, bidirectional ids or None).
      num_shards: ``P``; block: the tile (tiles are counted at it).
      max_document_shards: ``D``, an int, or ``"auto"``: the smallest ``D`` whose order
        keeps the balance (``P`` and more: the unbounded per-document order).

    Raises:
      ValueError: an int ``D`` whose order misses the balance (naming what it reaches and
        the smallest ``D`` that keeps it) or that a document cannot fit.
    """
    auto = isinstance(max_document_shards, str)
    first = 1 if auto else int(max_document_shards)
    unbounded = lambda: packing.per_document_positions(  # noqa: E731
        np.asarray(natural.segment_ids), num_shards, block,
        bidirectional_ids=natural.bidirectional_ids,
        chunk_size=spec.chunk_size)
    if first >= num_shards:  # no bound below P: the unbounded order
        return unbounded()
    reached = None
    for bound in range(first, num_shards):
        try:
            positions, (pairs, tiles), span = _try(spec, natural, num_shards, bound, block)
        except ValueError:
            continue  # a document needs more shards
        ok = pairs <= PAIRS_BOUND and tiles <= TILES_BOUND and span <= bound
        if ok and (auto or bound == first):
            return positions
        if reached is None and bound == first:
            reached = (pairs, tiles, span)
        if ok:
            raise ValueError(_missed(first, reached, num_shards, feasible=bound))
    if auto:
        return unbounded()
    raise ValueError(_missed(first, reached, num_shards, feasible=None))


def _missed(bound: int, reached, num_shards: int, feasible: Optional[int]) -> str:
    got = ("no order (a document needs more shards)" if reached is None else
           f"busiest/mean visible pairs {reached[0]:.3f}, computed tiles {reached[1]:.3f}, "
           f"widest document {reached[2]} shards")
    fix = (f"the smallest bound that keeps it is max_document_shards={feasible}"
           if feasible is not None else
           f"no bound below {num_shards} keeps it: pass max_document_shards=None (the "
           "unbounded per_document order)")
    return (f"max_document_shards={bound} cannot keep the per-document balance (busiest "
            f"shard <= {PAIRS_BOUND}x the mean visible pairs and <= {TILES_BOUND}x the mean "
            f"computed tiles): it reaches {got}; {fix}, or pass max_document_shards='auto'.")
