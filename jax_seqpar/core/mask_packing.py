"""The per-document token order balanced by the mask: prefix-LM, images, chunks.

:mod:`jax_seqpar.core.packing` balances causal-within-document work, where a token at
offset ``t`` of a document sees ``t + 1`` keys. A bidirectional prefix or image makes
its queries see every key of their span (the prefix's first token is as costly as its
last), and chunks (``position // chunk_size``) cap every query's keys at its chunk: the
causal cost is then wrong by up to the whole span, and so is its balance. Here every
token's cost is what the mask gives it, counted by the mask predicate itself
(:func:`jax_seqpar.core.work.token_work`), and every shard gets the mean cost
in visible (query, key) pairs and in computed tiles. Per row (``S`` tokens, ``P``
shards, tile ``c``):

1. *Pieces*: every document of at least ``MIN_TILES`` tiles is cut into whole
   tiles from its start, ``c`` consecutive tokens each (the last few of the row go
   back to the fill, next to their document's tail, so that ``P`` divides their
   number). Each piece costs its queries' visible pairs.
2. *Fill*: everything else (short documents, the tails of cut ones, padding), each
   token at its document's mean cost over those tokens, is split in two halves,
   denser and sparser than the fill's mean, each in document order. Every shard
   takes a run of each, as many tokens as every other shard, the dense share chosen
   so that the shard's fill cost is nearest its target (first: the mean).
3. *Deal*: the fill's loads are exact before the pieces move (a token's pairs do not
   depend on the order; every shard takes as many pieces, so its fill tiles start at
   the same slot), and so is every tile's computed count against all the others
   (:func:`jax_seqpar.core.blocks.classify`). Pieces go, costliest first, to the shard
   with room whose overload after taking it is lowest (pairs over their mean, and
   tiles over theirs with twice the slack), then pairs of pieces swap between the
   most overloaded shard and another while that lowers it. The fill is then split
   again towards what each shard's pieces leave it, and dealt again
   (``ROUNDS``); the best round is kept.
4. Within a shard: the dealt pieces first (so they stay whole tiles), then the fill in
   (document, position) order, padding last.

Host numpy only (a data pipeline step): the deal is a loop over at most ``S / c``
pieces. Exactness never depends on it: positions travel with the tokens.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_seqpar.core import blocks, masks, work
from jax_seqpar.core.masks import PAD_SEGMENT

__all__ = ["masked_row_positions"]

#: Documents of at least this many whole tiles are cut into pieces (the rest is fill):
#: many pieces give the deal room; a document of one tile gains nothing from it.
MIN_TILES = 2
#: How far over its mean a shard's pairs and tiles may go, relatively, in the deal.
PAIR_SLACK, TILE_SLACK = 1.0, 2.0
#: Most piece swaps after the first deal (each lowers the worst overload).
SWAPS = 256
#: Rounds of (split the fill, deal the pieces); the best round is kept.
ROUNDS = 3
#: The deal's orders tried each round (weights of pairs and tiles); the best is kept.
WEIGHTS = ((1.0, 1.0), (1.0, 0.0), (0.0, 1.0))


def _runs(ids: np.ndarray):
    """``(start, length)`` of each token's run of equal ``ids`` (sorted ids)."""
    start = np.searchsorted(ids, ids, side="left")
    return start, np.searchsorted(ids, ids, side="right") - start


def _tile_costs(spec: masks.MaskSpec, tiles: masks.Tokens) -> np.ndarray:
    """``float64[T]``: of the ``T`` tiles ``tiles`` (``[T, c]`` fields, padding
    :data:`PAD_SEGMENT`), how many each computes as queries against all of them as keys
    (:func:`jax_seqpar.core.blocks.classify`, the kernels' rule)."""
    count, block = tiles.positions.shape
    flat = jax.tree.map(lambda x: x.reshape(1, count * block).astype(np.int32), tiles)
    summary = jax.tree.map(lambda x: x[0], blocks.summarize(flat, block, per_row=True))
    kind = np.asarray(blocks.classify(spec, summary, summary))  # numpy for host summaries
    return (kind != blocks.EMPTY).sum(1).astype(np.float64)


def _overload(load, mean):
    """A shard's worst overload, ``[..., P]`` from ``load [2, ..., P]`` (pairs, tiles):
    each over its mean, relative to its slack."""
    return np.maximum((load[0] / mean[0] - 1) / PAIR_SLACK, (load[1] / mean[1] - 1) / TILE_SLACK)


def _deal(pairs, tiles, num_shards: int, base_pairs, base_tiles, weight=(1.0, 1.0)):
    """``int32[n]`` the shard of each piece (``n / P`` pieces per shard), the shards
    starting from the fill's loads ``base_pairs``, ``base_tiles`` ``[P]``: costliest
    first (``weight``: of pairs and tiles, each over its mean, in that order), each to
    the shard with room whose overload after taking it is lowest; then
    swaps of two pieces between the most overloaded shard and another while the pair's
    worse overload drops (a longest-processing-time schedule alone strands the last
    expensive pieces when every shard must take as many)."""
    cost = np.stack([pairs, tiles]).astype(np.float64)  # [2, n]
    load = np.stack([base_pairs, base_tiles]).astype(np.float64)  # [2, P]
    mean = np.maximum((cost.sum(1) + load.sum(1)) / num_shards, 1e-30)[:, None]
    room = np.full(num_shards, pairs.size // num_shards)
    shard = np.zeros(pairs.size, np.int32)
    weight = np.asarray(weight, np.float64)[:, None]
    for piece in np.lexsort((np.arange(pairs.size), -(weight * cost / mean).sum(0))):
        after = _overload(load + cost[:, piece, None], mean)
        best = int(np.argmin(np.where(room > 0, after + 1e-9 * load.sum(0), np.inf)))
        shard[piece] = best
        load[:, best] += cost[:, piece]
        room[best] -= 1
    for _ in range(SWAPS):
        over = _overload(load, mean)
        worst = int(np.argmax(over))
        mine, others = np.flatnonzero(shard == worst), np.flatnonzero(shard != worst)
        if not mine.size or not others.size:
            break
        moved = cost[:, mine, None] - cost[:, None, others]  # [2, mine, others]
        target = shard[others]
        new_worst = _overload(load[:, worst, None, None] - moved, mean)
        new_other = _overload(load[:, target][:, None, :] + moved, mean)
        gain = np.maximum(new_worst, new_other)
        i, j = np.unravel_index(np.argmin(gain), gain.shape)
        if gain[i, j] >= over[worst] - 1e-12:
            break
        load[:, worst] -= moved[:, i, j]
        load[:, target[j]] += moved[:, i, j]
        shard[mine[i]], shard[others[j]] = target[j], worst
    return shard


def _split_fill(excess, halves, targets, size: int, num_shards: int) -> np.ndarray:
    """``int64[S]`` the shard of each fill token: shard ``r`` takes the next run of the
    dense half and the next of the sparse half (stream order), as many tokens as every
    other shard, the dense share chosen so that its summed ``excess`` is nearest
    ``targets[r]``; the last shard takes what is left."""
    dense, sparse = halves
    window = (dense.size + sparse.size) // num_shards
    cum_dense = np.r_[0.0, np.cumsum(excess[dense])]
    cum_sparse = np.r_[0.0, np.cumsum(excess[sparse])]
    shard = np.full(size, -1, np.int64)
    at_dense = at_sparse = 0
    for r in range(num_shards):
        low = max(0, window - (sparse.size - at_sparse))
        high = min(window, dense.size - at_dense)
        if r == num_shards - 1:
            take = dense.size - at_dense
        else:
            share = np.arange(low, high + 1)
            got = (cum_dense[at_dense + share] - cum_dense[at_dense]
                   + cum_sparse[at_sparse + window - share] - cum_sparse[at_sparse])
            take = int(share[np.argmin(np.abs(got - targets[r]))])
        shard[dense[at_dense:at_dense + take]] = r
        shard[sparse[at_sparse:at_sparse + window - take]] = r
        at_dense, at_sparse = at_dense + take, at_sparse + window - take
    return shard


def _whole_tiles(slots: np.ndarray, block: int) -> np.ndarray:
    """``[P, L]`` token indices cut in ``[-1, block]`` tiles per shard (``-1``: padding)."""
    rows = -(-slots.shape[1] // block)
    return np.pad(slots, ((0, 0), (0, rows * block - slots.shape[1])),
                  constant_values=-1).reshape(-1, block)


def _grid(tokens: masks.Tokens, index: np.ndarray) -> masks.Tokens:
    """``tokens`` gathered at ``index`` (``-1``: a padding token)."""
    fills = masks.Tokens(0, PAD_SEGMENT, None if tokens.bidirectional_ids is None else 0)
    return jax.tree.map(lambda x, fill: np.where(index < 0, fill, x[np.maximum(index, 0)]),
                        tokens, fills)


def masked_row_positions(spec: masks.MaskSpec, tokens: masks.Tokens, *, num_shards: int,
                         block: int) -> np.ndarray:
    """``int32[S]``: the natural position of the token at each slot, for one row.

    Args:
      spec: the mask (causal, chunks) the order balances.
      tokens: the row in natural order, 1-D fields (``positions`` is ``arange(S)``;
        segment ids required, bidirectional ids optional).
      num_shards, block: ``P`` and the tile ``c``.
    """
    size, P = tokens.positions.shape[0], num_shards
    cost = work.token_work(spec, tokens)[0].astype(np.float64)
    if tokens.segment_ids is None:
        raise ValueError("masked_row_positions needs the row's segment ids.")
    order = np.lexsort((tokens.positions, tokens.segment_ids)).astype(np.int32)
    ids = tokens.segment_ids[order]
    pad = ids == PAD_SEGMENT
    start, n = _runs(ids)
    offset = np.arange(size) - start
    cost = cost[order]
    dealt_doc = ~pad & (n >= MIN_TILES * block)

    # 1. Pieces: whole tiles from each dealt document's start, P-fold in number.
    in_piece = dealt_doc & (offset // block < n // block)
    heads = np.flatnonzero(in_piece & (offset % block == 0))
    extra = heads.size % P  # the last few pieces go back to the fill, by their tail
    for head in heads[heads.size - extra:]:
        in_piece[head:head + block] = False
    heads = heads[:heads.size - extra]
    piece_id = np.cumsum(in_piece & (offset % block == 0)) - 1  # valid where in_piece
    pairs = cost[heads[:, None] + np.arange(block)].sum(1)

    # 2. The fill: each document's leftover tokens at their mean cost, in two halves.
    fill = ~in_piece
    count = np.bincount(start[fill], minlength=size)[start]  # fill tokens of the document
    fill_cost = np.bincount(start[fill], weights=cost[fill], minlength=size)[start]
    density = np.where(pad | ~fill, 0.0, fill_cost / np.maximum(count, 1))
    fill_tokens = int(fill.sum())
    mean_density = density[fill].sum() / max(fill_tokens, 1)
    excess = density - mean_density
    stream = np.flatnonzero(fill)  # document order: a window holds runs of tokens
    halves = (stream[excess[stream] > 0], stream[excess[stream] <= 0])  # dense, sparse

    # 3. Deal the pieces on top of the fill's loads, then re-split the fill towards
    # what each shard's pieces leave it, and again. Every load is exact before the deal:
    # a token's pairs do not depend on the order, and every shard holds the same number
    # of pieces, so its fill tiles start at the same slot wherever the pieces go.
    local = size // P - heads.size // P * block  # fill slots of a shard
    targets, deals = np.zeros(P), []
    for _ in range(ROUNDS):
        fill_shard = _split_fill(excess, halves, targets, size, P)
        fill_pairs = np.bincount(fill_shard[fill], weights=cost[fill], minlength=P)
        fill_slots = order[np.lexsort((np.arange(size), pad, np.where(fill, fill_shard, P)))]
        tile_cost = _tile_costs(spec, _grid(tokens, np.concatenate([
            order[heads[:, None] + np.arange(block)],
            _whole_tiles(fill_slots[:P * local].reshape(P, local), block)])))
        fill_tiles = tile_cost[heads.size:].reshape(P, -1).sum(1)
        for weight in WEIGHTS:
            piece_shard = _deal(pairs, tile_cost[:heads.size], P, fill_pairs, fill_tiles,
                                weight)
            load = np.stack([fill_pairs + np.bincount(piece_shard, pairs, minlength=P),
                             fill_tiles + np.bincount(piece_shard, tile_cost[:heads.size],
                                                      minlength=P)])
            worst = _overload(load, np.maximum(load.mean(1, keepdims=True), 1e-30)).max()
            deals.append((worst, fill_shard, piece_shard, load))
        best = min(deals, key=lambda deal: deal[0])  # the first of the least overloaded
        # The next fill's targets: the mean less what the best deal so far leaves each
        # shard beyond this round's fill (its pieces' pairs when it is this round's; else
        # also the change of fill, which damps the steps: measured, it balances more rows
        # than the pieces' pairs alone).
        beyond = best[3][0] - fill_pairs
        targets = (best[3][0].mean() - beyond) - (fill_tokens // P) * mean_density
    _, fill_shard, piece_shard, _ = best
    shard = (np.where(in_piece, piece_shard[np.maximum(piece_id, 0)], fill_shard)
             if piece_shard.size else fill_shard)  # no document fills a whole piece

    # 4. Slots by (shard, dealt pieces first, padding last), document order within.
    group = np.where(in_piece, 0, np.where(pad, 2, 1))
    return order[np.lexsort((np.arange(size), group, shard))].astype(np.int32)
