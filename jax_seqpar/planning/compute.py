"""The time model's compute: the (query, key) pairs each ring step computes on the busiest
device, as the kernels compute them, and their seconds (:mod:`.predict` adds the
transfers).

Pairs are counted in whole tiles of ``tile`` tokens that the mask does not empty
(:func:`tile_pairs`), for the token order the package runs: zigzag over all ``P`` shards
when causal where it balances the strategy's work (ring, hybrid, all-gather) and the
mask's reach is not bounded (:func:`jax_seqpar.strategies.registry.default_layout`), else
contiguous (Ulysses; windows and chunks); per ring step, or in one step where the strategy
gathers K/V. Where a strategy cuts its exchange into sequence pieces (Ulysses' pipeline,
the hybrid's around its ring: :attr:`~jax_seqpar.strategies.entry.Strategy.kernel_calls`),
every kernel call is counted in the token order its all-to-alls give it, which
interleaves the devices' pieces (:func:`jax_seqpar.strategies.pieces.kernel_calls`): a
window or causality empties fewer tiles there than in the contiguous order (a causal
window of 1024 at S=8192 over 8 devices: 523 tiles for Ulysses' forward, 150 contiguous).
Packed documents are counted per row by :mod:`.packed`. The FLOPs are
``2 B H (Dqk + Dv)`` per pair forward, ``(3 Dqk + 2 Dv) / (Dqk + Dv)`` times that
backward for a call that needs dq, dK and dV; a pipelined backward call that needs only
dq or only dK/dV costs the products it computes, against those of a whole call on the
hardware's kernel (:attr:`jax_seqpar.planning.hardware.Hardware.split_backward`,
``_pipeline_pairs``). At the hardware's attention FLOP/s.
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
    ring, hybrid and all-gather), else contiguous (Ulysses), each group's devices in turn
    (exchanges not cut into sequence pieces; those are ``_pipeline_pairs``'). A device attends for its
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


def _pipeline_pairs(entry: Strategy, ring: int, ulysses: int, shape: LayerShape, tile: int,
                    split_backward: bool) -> tuple[list[float], list[float]] | None:
    """``(forward, backward)`` computed pairs per ring step on the busiest ring group of a
    strategy that cuts its exchange into sequence pieces
    (:attr:`~jax_seqpar.strategies.entry.Strategy.kernel_calls`: Ulysses' pipeline, the
    hybrid's around its ring), counted call by call with :func:`tile_pairs` in the token
    order each call receives (the pieces' all-to-alls interleave the devices' tokens, so
    a window or causality empties fewer tiles than in the contiguous order); None where
    the strategy does not (then :func:`_step_pairs`).

    The backward's pairs are in units of a call that needs dq, dK and dV (what the ring's
    calls read); a call that reads only dq or only dK/dV costs the products it computes,
    the scores and ``dP`` recomputed for itself: dq ``2 Dqk + Dv`` and dK/dV
    ``2 Dqk + 2 Dv`` (times ``2`` FLOPs a pair), of a whole call's ``4 Dqk + 3 Dv`` where
    the backward is two kernels that each recompute them (``split_backward``: Pallas,
    Mosaic; 3/7 and 4/7 at equal head dims, together one whole call), or of its
    ``3 Dqk + 2 Dv`` where one fused loop shares them (the XLA kernel: 3/5 and 4/5). The
    XLA loop keeps every product whatever the call reads (a dq-only call took 96 % of a
    whole one on CPU), but the CPU timings at S=8192 over 8 devices fit these FLOP shares
    better than a whole call each (f+b Ulysses/ring with a causal window of 1024: about
    4x measured, 4.2x predicted, 5.6x with whole calls; plain causal, Ulysses/all-gather
    about 1.1x measured, 1.8x predicted, 2.3x with whole calls).
    """
    if entry.kernel_calls is None:
        return None
    devices = ring * ulysses
    zigzag = registry.default_layout(entry.name, shape.mask, seq_len=shape.seq_len,
                                     num_shards=devices) == "zigzag"
    shards = _shard_positions(shape.seq_len, devices, zigzag)
    d_qk, d_v = shape.head_dim, shape.v_head_dim or shape.head_dim
    # The products a call that reads dq, dK and dV computes: two kernels, or one loop.
    whole = 4 * d_qk + 3 * d_v if split_backward else 3 * d_qk + 2 * d_v
    share = {"all": 1.0, "dq": (2 * d_qk + d_v) / whole, "dkv": (2 * d_qk + 2 * d_v) / whole}
    by_group = [entry.kernel_calls(shape, ring, ulysses, shards, g)
                for g in _sampled(range(ring))]
    forward, backward = [0.0] * ring, [0.0] * ring
    for steps in by_group:
        if steps is None:  # not cut into pieces for this layer: one call a step
            return None
        for step, calls in enumerate(steps):
            counted = [(call, tile_pairs(call.q_positions, call.kv_positions, shape, tile))
                       for call in calls]
            forward[step] = max(forward[step], sum(pairs for call, pairs in counted
                                                   if call.computes == "forward"))
            backward[step] = max(backward[step], sum(share[call.computes] * pairs
                                                     for call, pairs in counted
                                                     if call.computes != "forward"))
    return forward, backward


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
    pipelined = None
    if documents is not None:
        pairs = packed.step_pairs(entry, ring, ulysses, shape, tile, documents)
    elif _tile_count(ring, shape, tile) <= _MAX_TILE_PAIRS:
        pipelined = _pipeline_pairs(entry, ring, ulysses, shape, tile, hardware.split_backward)
        pairs = (pipelined[0] if pipelined is not None
                 else _step_pairs(entry, ring, ulysses, shape, tile))
    else:  # too many tiles to classify: exact visible pairs, spread evenly
        per_device = visible_pairs(shape.seq_len, shape.mask) / ring
        steps = 1 if entry.gathers_kv else ring
        pairs = [per_device / steps] * steps
    backward_pairs = pairs if pipelined is None else pipelined[1]
    per_pair = 2 * shape.batch * heads * (d_qk + d_v) / hardware.attention_flops
    ratio = (3 * d_qk + 2 * d_v) / (d_qk + d_v) if shape.backward else 0.0
    return [per_pair * p for p in pairs], [per_pair * ratio * p for p in backward_pairs]


_MAX_TILE_PAIRS = 2**20  # beyond, tiles are a negligible fraction of a chunk


def _tile_count(ring: int, shape: LayerShape, tile: int) -> float:
    tiles = shape.seq_len / tile
    return tiles * tiles / ring * min(ring, 8)
