"""The time model's compute for packed documents: a representative batch's documents, in
its token order, counted as the kernels compute them (:mod:`.predict` uses it when
``predict(segment_ids=...)`` is given).

Documents change which tiles are computed, and per device: causal work is within each
document, so a layout that balances one document (zigzag) may leave a device with
twice the mean. The model lays the batch out over the candidate's devices, classifies
every (query tile, key tile) pair of every ring step per batch row
(:func:`jax_seqpar.core.work.computed_tiles_per_shard`, the kernels' own rule) and
charges each step its busiest device: the ring waits for it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jax_seqpar.core import layout as layouts, packing, work
from jax_seqpar.core.masks import PAD_SEGMENT
from jax_seqpar.core.shape import LayerShape

__all__ = ["LAYOUTS", "documents", "step_pairs"]

#: The token orders ``predict(layout=)`` takes.
LAYOUTS = ("contiguous", "zigzag", "striped", "per_document")

#: Tile pairs classified at most (rows x tiles x tiles); beyond, exact visible pairs.
MAX_TILE_PAIRS = 2**24


def documents(shape: LayerShape, segment_ids, layout: Optional[str]):
    """``(ids [B', S], layout or None)`` validated, or None (one document per row in the
    default layout: :mod:`.predict`'s own position-only count)."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}.")
    if segment_ids is None:
        if layout == "per_document":
            raise ValueError('layout="per_document" is laid out from documents: pass '
                             "segment_ids= (a representative batch, int[batch, seq_len]).")
        if layout is None:
            return None
        segment_ids = np.zeros((1, shape.seq_len), np.int32)
    ids = np.asarray(segment_ids)
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.shape[1] != shape.seq_len:
        raise ValueError(f"segment_ids must be [batch, seq_len={shape.seq_len}]. Got "
                         f"{ids.shape}.")
    return ids.astype(np.int32), layout


def laid_out(strategy: str, devices: int, shape: LayerShape, tile: int, batch):
    """``(positions, segment_ids)`` ``[B', S']`` of ``batch = (ids, layout)`` in its layout
    over ``devices`` (padded with :data:`PAD_SEGMENT` as the entry point pads)."""
    ids, layout = batch
    if layout is None:
        layout = "zigzag" if shape.causal and strategy != "ulysses" else "contiguous"
    chunks = {"zigzag": 2 * devices, "striped": devices * devices}.get(layout, devices)
    length = -(-ids.shape[1] // chunks) * chunks
    ids = np.pad(ids, ((0, 0), (0, length - ids.shape[1])), constant_values=PAD_SEGMENT)
    if layout == "per_document":
        positions = packing.per_document_positions(ids, devices, tile)
    else:
        order = {"contiguous": np.arange(length, dtype=np.int32),
                 "zigzag": np.asarray(layouts.zigzag_positions(length, devices)),
                 "striped": np.asarray(layouts.striped_positions(length, devices))}[layout]
        positions = np.broadcast_to(order, ids.shape)
    return positions, np.take_along_axis(ids, positions, 1)


def step_pairs(strategy: str, ring: int, ulysses: int, shape: LayerShape, tile: int,
               batch) -> list[float]:
    """Computed (query, key) pairs per row at each ring step, on that step's busiest
    device (the all-gather: one step, its busiest device's total).

    A ring group's tokens are its ``ulysses`` devices' slots together (what Ulysses'
    all-to-all gathers); tiles are ``tile`` clipped to a group. Past
    :data:`MAX_TILE_PAIRS`, the exact visible pairs (no tile rounding).
    """
    positions, ids = laid_out(strategy, ring * ulysses, shape, tile, batch)
    rows, length = ids.shape
    block = min(tile, length // ring)
    if rows * (length / block) ** 2 <= MAX_TILE_PAIRS:
        steps = work.computed_tiles_per_shard(positions, ids, ring, block_q=block,
                                              causal=shape.causal, window=shape.window,
                                              per_step=True) * float(block * block)
    else:
        steps = work.work_per_step(positions, ids, ring, shape.causal, shape.window)
    steps = steps / rows  # [device, step], per row
    if strategy == "allgather":
        return [float(steps.sum(1).max())]
    return [float(x) for x in steps.max(0)]
