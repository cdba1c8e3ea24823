"""Documents stay home: the per-document order that keeps each document on few shards.

:mod:`jax_seqpar.core.packing` balances every device's work, dealing long documents to
every shard: every device then needs keys from every other. Here the balance is kept
(every shard near the mean visible pairs and computed tiles) while each document lies on
at most ``D`` consecutive shards, so a query's keys lie within ``D - 1`` shards on either
side and a strategy sends only that reach (:func:`jax_seqpar.core.reach.mask_reach`).
Per row (``S`` tokens, ``P`` shards of ``L = S/P`` slots):

1. Every token costs the keys it sees (:func:`jax_seqpar.core.work.token_work`: causal
   within its document, a bidirectional prefix or image, chunks); a document's tiles are
   estimated by :func:`jax_seqpar.core.home_line.tile_surrogate`.
2. *Spread* documents, those with more work than a shard's mean (or more tokens than a
   shard holds), are folded (tile runs ``r`` and ``m-1-r`` together) and cut in pieces
   over at most ``D`` consecutive shards, water-filled so that the work beyond the home
   density that every shard holds stays even (:func:`spread_pieces`: each document's
   span searched one at a time).
3. *Home* documents, the rest, and the padding are whole units of a line cut into the
   shards' free slots in shard order (:mod:`jax_seqpar.core.home_line`: a greedy fill
   and a local search on the pairs' and tiles' surrogates); a home document crosses at
   most one cut. The exact per-shard counts (:mod:`jax_seqpar.core.work`) then correct
   the surrogates and the line is searched again (``ATTEMPTS`` times; the best kept).
4. Within a shard, tokens are sorted by (padding last, document, position).

Where no order can keep the balance, :func:`lower_bounds` proves it: a document of ``w``
pairs on at most ``D`` shards puts ``>= w / D`` on one of them, plus the cheapest tokens
that fill the rest of their slots.

Host numpy only (a data pipeline step): loops over documents. Exactness never depends on
it: positions travel with the tokens, and the attention checks the bound.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jax_seqpar.core import home_line, masks, packing, work
from jax_seqpar.core.masks import PAD_SEGMENT

__all__ = ["PAIRS_BOUND", "TILES_BOUND", "balance", "home_positions", "home_row_positions",
           "lower_bounds", "spread_pieces"]

#: The most a kept bound lets the busiest shard's visible pairs be over their mean (as
#: the unbounded per-document order keeps them).
PAIRS_BOUND = 1.05
#: The same for the computed tiles.
TILES_BOUND = 1.10
#: Rounds of the spread documents' placement search (each tries every span of each).
PLACEMENT_ROUNDS = 3
#: Line searches per row: each after the first corrects the surrogates by the exact
#: per-shard counts of the one before; the best is kept.
ATTEMPTS = 3


def _folded(doc_tokens: np.ndarray, block: int) -> np.ndarray:
    """A document's tokens (natural order) folded by runs of ``block``: runs ``r`` and
    ``m-1-r`` together (``r = 0, 1, ..``, the last, partial run second), so any cut has
    about its mean cost per token and its pieces are whole tiles but one."""
    runs = np.split(doc_tokens, np.arange(block, doc_tokens.size, block))
    m = len(runs)
    order = np.empty(m, np.int64)
    order[0::2], order[1::2] = np.arange((m + 1) // 2), np.arange(m - 1, (m - 1) // 2, -1)
    return np.concatenate([runs[r] for r in order])


def _water_fill(level: np.ndarray, amount: float, sizes_cap: np.ndarray, n: int) -> np.ndarray:
    """``int64[k]``: the tokens of a document of ``n`` tokens and ``amount`` excess work
    given to shards at ``level``: the lowest raised to one level (equal shares for a
    document no denser than the home documents), at most ``sizes_cap`` each."""
    if amount <= 0:
        share = np.full(level.size, 1.0 / level.size)
    else:
        order = np.sort(level)
        fill = np.cumsum(order)
        k = np.arange(1, level.size + 1)
        top = (amount + fill) / k
        m = int(np.flatnonzero((k == level.size) | (top <= np.r_[order[1:], np.inf]))[0])
        share = np.maximum(top[m] - level, 0) / amount
    tokens = np.floor(share * n).astype(np.int64)
    tokens[np.argmax(share)] += n - tokens.sum()
    for _ in range(level.size):  # clip to the room, the rest to those with room left
        over = np.maximum(tokens - sizes_cap, 0).sum()
        if not over:
            break
        tokens = np.minimum(tokens, sizes_cap)
        free = sizes_cap - tokens
        give = np.floor(over * free / max(free.sum(), 1)).astype(np.int64)
        give[np.argmax(free)] += over - give.sum()
        tokens += give
    return tokens


def spread_pieces(sizes: np.ndarray, excess: np.ndarray, L: int, D: int, P: int) -> list:
    """For documents of ``sizes`` tokens and ``excess`` work (beyond the home density),
    costliest first: ``int64[P]`` tokens of each on every shard, on at most ``D``
    consecutive shards, water-filled; each document's span the one keeping the highest
    shard lowest, searched again one document at a time (``PLACEMENT_ROUNDS`` times)."""
    def lay(choice):
        level, room, out = np.zeros(P), np.full(P, L, np.int64), []
        for (k, s), n, w in zip(choice, sizes, excess):
            tokens = np.zeros(P, np.int64)
            tokens[s:s + k] = _water_fill(level[s:s + k], w, room[s:s + k], int(n))
            level += w * tokens / n
            room -= tokens
            out.append(tokens)
        return out, float(level.max() + 1e-3 * (level ** 2).mean())

    def options(n):
        return [(k, s) for k in range(max(-(-int(n) // L), 1), min(D, P) + 1)
                for s in range(P - k + 1)]

    choice: list = []
    for i in range(len(sizes)):  # greedy, then rounds of one document's best span
        choice.append(min(options(sizes[i]), key=lambda o: lay(choice + [o])[1]))
    for _ in range(PLACEMENT_ROUNDS if len(sizes) > 1 else 0):
        for i in range(len(sizes)):
            choice[i] = min(options(sizes[i]),
                            key=lambda o: lay(choice[:i] + [o] + choice[i + 1:])[1])
    return lay(choice)[0]


def _documents(tokens: masks.Tokens):
    """``(real, padding)``: each document's natural indices (by position), and padding's."""
    ids, positions = np.asarray(tokens.segment_ids), np.asarray(tokens.positions)
    order = np.lexsort((positions, ids))
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    docs = np.split(order, starts[1:]) if order.size else []
    real = [d for d in docs if ids[d[0]] != PAD_SEGMENT]
    padding = next((d for d in docs if ids[d[0]] == PAD_SEGMENT), np.zeros(0, np.int64))
    return real, padding


def home_row_positions(spec: masks.MaskSpec, tokens: masks.Tokens, *, num_shards: int,
                       max_shards: int, block: int, seed: int = 0) -> np.ndarray:
    """``int32[S]``: the natural position of the token at each slot, one row, every
    document on at most ``max_shards`` consecutive shards (``ValueError`` where one
    document has more tokens than ``max_shards`` shards hold).

    Args:
      spec: the causal mask the order balances (chunks too); tokens: the row in natural
        order, 1-D fields (``positions`` ``arange(S)``, segment ids, bidirectional ids
        or None); num_shards: ``P``; max_shards: ``D``; block: the tile spread runs
        align to (and tiles are counted at); seed: the line search's stream.
    """
    size, P, D = tokens.positions.shape[0], num_shards, max_shards
    L = size // P
    ids = np.asarray(tokens.segment_ids)
    positions = np.asarray(tokens.positions)
    cost = work.token_work(spec, tokens)[0].astype(np.float64)
    real, padding = _documents(tokens)
    doc_pairs = np.array([cost[d].sum() for d in real])
    doc_sizes = np.array([d.size for d in real], np.float64)
    doc_tiles = home_line.tile_surrogate(doc_sizes, doc_pairs, block)
    mean = np.array([max(doc_pairs.sum() / P, 1e-30), max(doc_tiles.sum() / P, 1e-30)])
    cap = mean * np.array([PAIRS_BOUND, TILES_BOUND])
    shard = np.full(size, -1, np.int64)
    room, fixed = np.full(P, L, np.int64), np.zeros((2, P))

    # 1. Spread documents (more work than a shard's mean, or more tokens than it holds),
    #    folded and cut in pieces over at most ``D`` consecutive shards so that the work
    #    the shards' home documents must make up stays even.
    spread = (doc_sizes > L) | (doc_pairs > mean[0])
    home = [int(d) for d in np.flatnonzero(~spread)]
    big = [int(d) for d in np.argsort(-doc_pairs, kind="stable") if spread[d]]
    for d in big:
        if doc_sizes[d] > D * L:
            raise ValueError(f"a document of {int(doc_sizes[d])} tokens cannot lie on "
                             f"max_document_shards={D} shards of {L} tokens: pass "
                             f"max_document_shards >= {-(-int(doc_sizes[d]) // L)}.")
    rho = doc_pairs[~spread].sum() / max(size - doc_sizes[spread].sum(), 1)
    pieces = spread_pieces(doc_sizes[big], doc_pairs[big] - rho * doc_sizes[big], L, D, P)
    for d, piece in zip(big, pieces):
        ends = np.cumsum(piece)
        folded = _folded(real[d], block)
        for j, part in enumerate(np.split(folded, ends[:-1])):
            shard[part] = j
            room[j] -= part.size
            fixed[:, j] += [cost[part].sum(), doc_tiles[d] * part.size / real[d].size]

    # 2. The home documents and the padding (runs of ``block``) on the line, cut into the
    #    shards' free slots in shard order.
    units = [_folded(real[d], block) for d in home]
    units += [padding[i:i + block] for i in range(0, padding.size, block)]
    if not units:
        return _slots(ids, positions, shard)
    sizes = np.array([u.size for u in units], np.float64)
    pairs = np.zeros(len(units))
    tiles = np.zeros(len(units))
    pairs[:len(home)], tiles[:len(home)] = doc_pairs[home], doc_tiles[home]
    spreadable = np.arange(len(units)) >= len(home)
    best: tuple = (np.inf, None)
    correction = np.zeros((2, P))
    for attempt in range(ATTEMPTS):  # the surrogates corrected by the exact counts
        order = home_line.line_order(sizes, pairs, tiles, spreadable, room, fixed + correction,
                                     cap, max_shards=D, seed=seed + attempt)
        stream = np.concatenate([units[u] for u in order])
        shard[stream] = np.searchsorted(np.cumsum(room), np.arange(stream.size), side="right")
        slots = _slots(ids, positions, shard)
        exact = _exact(spec, tokens, slots, P, block)
        ratio = (exact / exact.mean(1, keepdims=True)).max(1) / [PAIRS_BOUND, TILES_BOUND]
        if ratio.max() < best[0]:
            best = (ratio.max(), slots)
        if ratio.max() <= 1:
            break
        guess = np.stack(home_line.line_loads(order, sizes, pairs, tiles, room)[:2]) + fixed
        correction += exact * (guess.sum(1) / exact.sum(1))[:, None] - guess
    return best[1]


def _slots(ids, positions, shard):
    """Slots by (shard, padding last, document, position)."""
    pad = (ids == PAD_SEGMENT).astype(np.int64)
    return np.lexsort((positions, ids, pad, shard)).astype(np.int32)


def _exact(spec, tokens, slots, num_shards: int, block: int) -> np.ndarray:
    """``float64[2, P]``: one row's visible pairs and computed tiles per shard in ``slots``."""
    laid = _laid_out(jax.tree.map(lambda x: None if x is None else x[None], tokens),
                     slots[None])
    return np.stack([work.work_per_shard(spec, laid, num_shards),
                     work.computed_tiles_per_shard(spec, laid, num_shards, block_q=block)]
                    ).astype(np.float64)



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
        keeps the balance among those that bound the reach (``D <= P // 2``), else the
        unbounded per-document order (an int ``D >= P``: that order too).

    Raises:
      ValueError: an int ``D`` whose order misses the balance (naming what it reaches and
        the smallest ``D`` that keeps it) or that a document cannot fit.
    """
    auto = isinstance(max_document_shards, str)
    # "auto" tries only the bounds that bound the reach (core.reach.documents_bound_reach)
    last = (num_shards // 2 if auto else int(max_document_shards))
    unbounded = lambda: packing.per_document_positions(  # noqa: E731
        np.asarray(natural.segment_ids), num_shards, block,
        bidirectional_ids=natural.bidirectional_ids,
        chunk_size=spec.chunk_size)
    if last >= num_shards:  # no bound below P: the unbounded order
        return unbounded()
    floors = lower_bounds(spec, natural, num_shards)

    def attempt(bound):
        """``(positions, (pairs, tiles, span))``, or ``(None, None)``: no order."""
        if floors[bound - 1] > PAIRS_BOUND and (auto or bound != last):
            return None, None  # proven out of reach
        try:
            positions, (pairs, tiles), span = _try(spec, natural, num_shards, bound, block)
        except ValueError:
            return None, None  # a document needs more shards
        return positions, (pairs, tiles, span)

    def keeps(got, bound) -> bool:
        return got is not None and (got[0] <= PAIRS_BOUND and got[1] <= TILES_BOUND
                                    and got[2] <= bound)

    # Every bound up to the last is searched: an order searched for a tighter bound may
    # keep the balance within a looser one (its documents spanning more than it asked).
    tried: list = []
    for bound in range(1, last + 1):
        tried.append(attempt(bound))
        kept = next((positions for positions, got in tried if keeps(got, bound)), None)
        if kept is not None:
            return kept
    if auto:
        return unbounded()
    reached = tried[-1][1]
    feasible = next((b for b in range(last + 1, num_shards) if keeps(attempt(b)[1], b)),
                    num_shards)
    raise ValueError(_missed(last, reached, floors[last - 1], num_shards, feasible))


def _missed(bound: int, reached, floor: float, num_shards: int, feasible: int) -> str:
    got = ("no order (a document needs more shards)" if reached is None else
           f"busiest/mean visible pairs {reached[0]:.3f}, computed tiles {reached[1]:.3f}, "
           f"widest document {reached[2]} shards")
    proof = (f" (no order can: every order with documents on at most {bound} shards has a "
             f"shard with >= {floor:.3f}x the mean visible pairs)" if floor > PAIRS_BOUND
             else f" (the lower bound is {floor:.3f}x the mean visible pairs)")
    fix = (f"the smallest bound that keeps it is max_document_shards={feasible}"
           if feasible < num_shards else
           f"no bound below {num_shards} keeps it: pass max_document_shards={num_shards} or "
           "None (the unbounded per_document order)")
    return (f"max_document_shards={bound} cannot keep the per-document balance (busiest "
            f"shard <= {PAIRS_BOUND}x the mean visible pairs and <= {TILES_BOUND}x the mean "
            f"computed tiles): it reaches {got}{proof}; {fix}, or pass "
            "max_document_shards='auto'.")


def lower_bounds(spec: masks.MaskSpec, natural: masks.Tokens, num_shards: int) -> np.ndarray:
    """``float64[P]``: entry ``D - 1`` a lower bound on the busiest/mean visible pairs of
    any order of the ``int[B, S]`` natural rows with every document on at most ``D``
    consecutive shards (summed over the rows; ``inf``: a document cannot fit).

    A document of ``n`` tokens and ``w`` pairs on ``k <= D`` shards leaves ``k L - n`` of
    their slots to other tokens, each costing at least the cheapest of the row's tokens
    (padding 0): one of the ``k`` shards holds at least ``(w + cheapest(k L - n)) / k``;
    every other row adds at least its ``L`` cheapest tokens to it.
    """
    rows, size = np.asarray(natural.segment_ids).shape
    P = num_shards
    L = size // P
    cost = work.token_work(spec, natural).astype(np.float64)  # [B, S]
    cheap = np.cumsum(np.sort(cost, axis=1), axis=1)
    cheap = np.concatenate([np.zeros((rows, 1)), cheap], axis=1)  # cheap[b, m]: m cheapest
    worst, floor = np.zeros((rows, P)), cheap[:, L]
    for b in range(rows):
        row = jax.tree.map(lambda x: None if x is None else x[b], natural)
        for doc in _documents(row)[0]:
            n, w = doc.size, cost[b, doc].sum()
            k = np.arange(1, P + 1)
            need = (w + cheap[b, np.clip(k * L - n, 0, size)]) / k
            need = np.where(k * L >= n, need, np.inf)
            worst[b] = np.maximum(worst[b], np.minimum.accumulate(need))
    mean = max(cost.sum() / P, 1e-30)
    if not rows:
        return np.zeros(P)
    return ((worst - floor[:, None]).max(0) + floor.sum()) / mean
