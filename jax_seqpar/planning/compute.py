"""The time model's compute: the (query, key) pairs each ring step computes on the busiest
device, as the kernels compute them, and their seconds (:mod:`.predict` adds the
transfers).

Pairs are counted in whole tiles of ``tile`` tokens that the mask does not empty
(:func:`tile_pairs`), for the token order the package runs: zigzag over all ``P`` shards
when causal where it balances the strategy's work (ring, hybrid, all-gather) and the
mask's reach is not bounded (:func:`jax_seqpar.strategies.registry.default_layout`), else
contiguous (Ulysses; windows and chunks); per ring step, or in one step where the strategy gathers K/V.
Packed documents are counted per row by :mod:`.packed`. The FLOPs are
``2 B H (Dqk + Dv)`` per pair forward, ``(3 Dqk + 2 Dv) / (Dqk + Dv)`` times that
backward, at the hardware's attention FLOP/s.
"""

from __future__ import annotations


import jax
import numpy as np

from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import packed
from jax_seqpar.planning.hardware import Hardware
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.entry import Strategy

__all__ = ["TILE", "step_seconds", "tile_pairs", "visible_pairs"]

#: Tokens per kernel tile, each side, unless the model is told otherwise.
TILE = 256


def visible_pairs(seq_len: int, spec: MaskSpec) -> float:
    """(query, key) pairs a causal and/or ``(left, right)`` window mask keeps (exact;
    ``spec``'s other fields are not counted here)."""
    window = spec.window
    left = seq_len - 1 if window is None else min(window[0], seq_len - 1)
    right = 0 if spec.causal else (seq_len - 1 if window is None else min(window[1], seq_len - 1))

    def clipped_sum(limit):  # sum over i < seq_len of min(i, limit)
        return limit * (limit + 1) / 2 + (seq_len - 1 - limit) * limit

    return float(seq_len + clipped_sum(left) + clipped_sum(right))


def _shard_positions(seq_len: int, shards: int, zigzag: bool) -> np.ndarray:
    """``[shards, L]`` global positions of each shard's tokens, the sequence padded to
    the whole half-shards its layout needs (as the global entry point pads it)."""
    pieces = 2 * shards if zigzag else shards
    positions = np.arange(-(-seq_len // pieces) * pieces)
    if not zigzag:
        return positions.reshape(shards, -1)
    halves = positions.reshape(2 * shards, -1)
    return np.concatenate([halves[:shards], halves[::-1][:shards]], axis=1)


def tile_pairs(q_positions: np.ndarray | jax.Array, kv_positions: np.ndarray | jax.Array,
               shape: LayerShape, tile: int = TILE) -> float:
    """(query, key) pairs a kernel computes: whole tiles that are not EMPTY.

    Tiles are ``tile`` tokens clipped to the lengths, classified from
    their position ranges as the kernels do (conservatively), so a tile that
    holds two far-apart zigzag half-shards is computed whole.
    """
    def ranges(positions, tile):
        tile = min(tile, positions.size)
        padded = -(-positions.size // tile) * tile
        edge = np.pad(positions, (0, padded - positions.size), mode="edge").reshape(-1, tile)
        return edge.min(axis=1), edge.max(axis=1), tile

    q_lo, q_hi, tile_q = ranges(q_positions, tile)
    k_lo, k_hi, tile_k = ranges(kv_positions, tile)
    q_lo, q_hi, k_lo, k_hi = q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :]
    empty = np.zeros((q_lo.size, k_lo.size), bool)
    if shape.causal:
        empty |= k_lo > q_hi
    if shape.window is not None:
        left, right = shape.window
        empty |= (k_lo > q_hi + right) | (k_hi < q_lo - left)
    if shape.chunk_size is not None:  # no key tile's chunk among the query tile's
        chunk = shape.chunk_size
        empty |= (k_lo // chunk > q_hi // chunk) | (k_hi // chunk < q_lo // chunk)
    return float((~empty).sum()) * tile_q * tile_k


def _step_pairs(entry: Strategy, ring: int, ulysses: int, shape: LayerShape,
                tile: int) -> list[float]:
    """Computed pairs per ring step on the busiest device (one step: no ring).

    Token orders as the package runs them (``default_layout``): zigzag over all ``P`` shards when causal
    where it balances (:attr:`~jax_seqpar.strategies.entry.Strategy.zigzag_balances`:
    ring, hybrid and all-gather), else contiguous (Ulysses). A device attends for its
    ring group's ``I`` shards gathered by a head split (the hybrid's all-to-all; all of
    them for Ulysses), or its own queries to every key at once where the strategy
    gathers K/V (:attr:`~jax_seqpar.strategies.entry.Strategy.gathers_kv`).
    """
    devices = ring * ulysses
    zigzag = registry.default_layout(entry.name, shape.mask, seq_len=shape.seq_len,
                                     num_shards=devices) == "zigzag"
    shards = _shard_positions(shape.seq_len, devices, zigzag)
    if entry.gathers_kv:
        kv = shards.reshape(-1)
        return [max(tile_pairs(q, kv, shape, tile) for q in _sampled(shards))]
    groups = shards.reshape(ring, -1)  # a ring group's tokens after the a2a
    sampled_groups = _sampled(range(ring))
    steps = {}
    for step in _sampled(range(ring), 16):
        steps[step] = max(tile_pairs(groups[g], groups[(g - step) % ring], shape,
                                     tile) for g in sampled_groups)
    # Long rings: steps not classified take the mean of the sampled later steps.
    later = [pairs for step, pairs in steps.items() if step] or [steps[0]]
    return [steps.get(step, sum(later) / len(later)) for step in range(ring)]


def _sampled(items, limit: int = 8):
    """All items when few, else ``limit`` of them spread evenly (for large meshes)."""
    items = list(items)
    if len(items) <= limit:
        return items
    return [items[i] for i in np.linspace(0, len(items) - 1, limit).round().astype(int)]


def step_seconds(entry: Strategy, ring: int, ulysses: int, shape: LayerShape,
                 hardware: Hardware, tile: int, documents: packed.Documents | None = None):
    """Forward and backward compute seconds per ring step of the strategy ``entry`` over
    ``ring x ulysses`` devices (tile-level, busiest device; one step: no ring);
    ``documents``: :func:`jax_seqpar.planning.packed.documents` of a packed batch, or None."""
    d_qk, d_v = shape.head_dim, shape.v_head_dim or shape.head_dim  # None: head_dim
    heads = shape.num_heads // ulysses
    if documents is not None:
        pairs = packed.step_pairs(entry, ring, ulysses, shape, tile, documents)
    elif _tile_count(ring, shape, tile) <= _MAX_TILE_PAIRS:
        pairs = _step_pairs(entry, ring, ulysses, shape, tile)
    else:  # too many tiles to classify: exact visible pairs, spread evenly
        per_device = visible_pairs(shape.seq_len, shape.mask) / ring
        steps = 1 if entry.gathers_kv else ring
        pairs = [per_device / steps] * steps
    forward = [2 * shape.batch * heads * (d_qk + d_v) * p / hardware.attention_flops
               for p in pairs]
    ratio = (3 * d_qk + 2 * d_v) / (d_qk + d_v) if shape.backward else 0.0
    return forward, [f * ratio for f in forward]


_MAX_TILE_PAIRS = 2**20  # beyond, tiles are a negligible fraction of a chunk


def _tile_count(ring: int, shape: LayerShape, tile: int) -> float:
    tiles = shape.seq_len / tile
    return tiles * tiles / ring * min(ring, 8)
