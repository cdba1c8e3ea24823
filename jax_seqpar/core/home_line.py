"""The home documents' line: an order of whole units whose cuts balance every shard.

:mod:`jax_seqpar.core.home_packing` lays the *home* documents (those it does not spread)
on a line of ``sum(room)`` slots, in some order, each folded (its tokens ``t`` and
``n-1-t`` together), and cuts the line into the shards' free slots in shard order: shard
``s`` takes slots ``[R_s, R_{s+1})``, ``R`` the cumulative rooms. A unit of ``n``
folded tokens cut after ``t`` carries ``~t (n+1)/2`` of its visible pairs before the cut:
the line's cumulative work ``F(x)`` is piecewise linear (exact at unit ends), and only its
values at the ``P - 1`` cuts matter. So is its cumulative tile count (a surrogate:
:func:`tile_surrogate`). A document shorter than every room crosses at most one cut
(two shards); padding crosses any.

:func:`line_order` picks the order: a greedy fill that keeps ``F`` on the target curve,
largest units first, then a local search (swaps and moves of units, the worst shard's
first) on the shards' busiest/mean pairs and tiles over their bounds, the units' spans
over ``D`` a penalty. Everything here is on the units' totals: ``float64[n]`` arrays,
no token, ``O(n)`` per evaluated order.
"""

from __future__ import annotations

import numpy as np

__all__ = ["line_loads", "line_order", "tile_surrogate"]

#: Orders the local search evaluates per row at most (it stops earlier once nothing
#: improves): a count, not a time, so that the layout is the same on every machine.
SEARCH_TRIALS = 20000
#: Moves tried per improvement round before the search gives up.
PATIENCE = 1500
#: The search stops once every shard's surrogate load is within this fraction of its cap
#: (the margin for what the surrogates miss).
STOP = 0.97
#: Penalty per unit that spans more than ``D`` shards (a ratio; any balance is cheaper).
SPAN_PENALTY = 100.0


def tile_surrogate(tokens: np.ndarray, pairs: np.ndarray, block: int) -> np.ndarray:
    """``float64[n]``: ~the ``block`` tiles units of ``tokens`` tokens and ``pairs``
    visible pairs compute: ``pairs / c^2`` (the tiles the pairs fill) plus one tile row
    per ``c`` tokens (the diagonal and the tiles documents share)."""
    return pairs / float(block) ** 2 + tokens / float(block)


def _at_cuts(ends: np.ndarray, cumulative: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """``cumulative`` (at unit ``ends``, 0 at 0) interpolated at ``cuts``."""
    return np.interp(cuts, np.r_[0.0, ends], np.r_[0.0, cumulative])


def line_loads(order: np.ndarray, sizes: np.ndarray, pairs: np.ndarray, tiles: np.ndarray,
               room: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pairs [P], tiles [P], spans [n])`` of the units in ``order`` cut into ``room``:
    each shard's share of the units' pairs and tiles (linear inside a cut unit), and how
    many shards each unit (in ``order``) spans."""
    ends = np.cumsum(sizes[order])
    cuts = np.cumsum(room)[:-1].astype(np.float64)
    p = np.diff(np.r_[0.0, _at_cuts(ends, np.cumsum(pairs[order]), cuts), pairs.sum()])
    t = np.diff(np.r_[0.0, _at_cuts(ends, np.cumsum(tiles[order]), cuts), tiles.sum()])
    starts = ends - sizes[order]
    spans = (np.searchsorted(cuts, ends, side="left")
             - np.searchsorted(cuts, starts, side="right") + 1)
    return p, t, spans


class _Cost:
    """The cost of an order: the worst shard's ``max(pairs/target, tiles/target)`` (each
    over its bound), a little of the mean square for ties, the span penalty."""

    def __init__(self, sizes, pairs, tiles, spreadable, room, fixed, cap, max_shards):
        self.sizes, self.pairs, self.tiles = sizes, pairs, tiles
        self.spreadable, self.room, self.fixed, self.cap = spreadable, room, fixed, cap
        self.max_shards = max_shards

    def ratios(self, order):
        p, t, spans = line_loads(order, self.sizes, self.pairs, self.tiles, self.room)
        load = np.stack([p, t]) + self.fixed  # [2, P]
        over = np.maximum(0, spans - self.max_shards)[~self.spreadable[order]].sum()
        return (load / self.cap[:, None]).max(0), over

    def __call__(self, order):
        ratios, over = self.ratios(order)
        return float(ratios.max() + 1e-3 * (ratios ** 2).mean() + SPAN_PENALTY * over)


def _greedy(sizes, pairs, room, fixed_pairs, cap_pairs):
    """A first order: the line filled left to right, each step the largest unit whose
    density keeps the cumulative work nearest the target curve at the next cut."""
    target = np.cumsum(np.maximum(cap_pairs - fixed_pairs, 0))
    target *= pairs.sum() / max(target[-1], 1e-30)
    cuts = np.cumsum(room)
    left = np.ones(sizes.size, bool)
    by_size = np.argsort(-sizes, kind="stable")
    order, x, f = [], 0, 0.0
    while left.any():
        s = min(int(np.searchsorted(cuts, x, side="right")), cuts.size - 1)
        start = cuts[s - 1] if s else 0
        rate = (target[s] - (target[s - 1] if s else 0.0)) / max(cuts[s] - start, 1)
        goal = (target[s - 1] if s else 0.0) + rate * (x - start)  # the curve at x
        cand = by_size[left[by_size]]
        ahead = f + pairs[cand] - (goal + rate * sizes[cand])  # over the curve after it
        within = np.abs(ahead) <= 0.02 * max(target[-1] / cuts.size, 1e-30)
        u = int(cand[np.argmax(within)] if within.any() else cand[np.argmin(np.abs(ahead))])
        left[u] = False
        order.append(u)
        x += sizes[u]
        f += pairs[u]
    return np.array(order, np.int64)


def line_order(sizes: np.ndarray, pairs: np.ndarray, tiles: np.ndarray, spreadable: np.ndarray,
               room: np.ndarray, fixed: np.ndarray, cap: np.ndarray, *, max_shards: int,
               seed: int = 0, trials: int = SEARCH_TRIALS) -> np.ndarray:
    """``int64[n]``: the order of the units on the line.

    Args:
      sizes, pairs, tiles: ``float64[n]`` each unit's tokens, visible pairs and tiles.
      spreadable: ``bool[n]``, units that may span any shards (padding).
      room: ``int64[P]`` each shard's free slots (``sum(room) == sum(sizes)``).
      fixed: ``float64[2, P]`` the pairs and tiles each shard holds already.
      cap: ``float64[2]`` the most a shard may hold of each (bound x mean).
      max_shards: ``D``; seed: the search's random stream; trials: the most orders it
        evaluates. The same arguments give the same order on every machine.
    """
    cost = _Cost(sizes, pairs, tiles, spreadable, room, fixed, cap, max_shards)
    order = _greedy(sizes, pairs, room, fixed[0], cap[0])
    best = cost(order)
    rng = np.random.default_rng(seed)
    n, idle, tried = order.size, 0, 0
    cuts = np.cumsum(room)
    free = np.arange(n)  # positions of the units the search moves
    while n > 1 and idle < PATIENCE and tried < trials:
        ratios, over = cost.ratios(order)
        if ratios.max() <= STOP and not over:
            break
        worst = int(np.argmax(ratios))
        ends = np.cumsum(sizes[order])
        lo = np.searchsorted(ends, cuts[worst - 1] if worst else 0, side="right")
        hi = min(int(np.searchsorted(ends, cuts[worst], side="left")), n - 1)
        near = free[(free >= lo - 1) & (free <= hi + 1)]
        for _ in range(32):
            i = int(rng.choice(near) if near.size and rng.random() < 0.7 else rng.choice(free))
            if rng.random() < 0.5:
                j = int(rng.choice(free))
                trial = order.copy()
                trial[i], trial[j] = order[j], order[i]
            else:
                j = int(rng.integers(n))
                trial = np.insert(np.delete(order, i), j, order[i])
            if i == j:
                continue
            value = cost(trial)
            tried += 1
            if value < best - 1e-12:
                order, best, idle = trial, value, 0
                break
            idle += 1
    return order
