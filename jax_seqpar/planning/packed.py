"""The time model's compute for packed documents: a representative batch's documents, in
its token order, counted as the kernels compute them (:mod:`.predict` uses it when
``predict(segment_ids=...)`` is given).

Documents change which tiles are computed, and per device: causal work is within each
document, so a layout that balances one document (zigzag) may leave a device with
twice the mean. The model lays the batch out over the candidate's devices, classifies
every (query tile, key tile) pair of every ring step per batch row
(:func:`jax_seqpar.core.work.computed_tiles_per_shard`, the kernels' own rule) and
charges each step its busiest device: the ring waits for it. The mask is the layer's
(its causality and window) with the batch's bidirectional ids (prefix-LM prompts,
images) and pieces, counted as the kernels classify them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from jax_seqpar.core import layout as layouts, packing, work
from jax_seqpar.core.masks import PAD_SEGMENT, MaskSpec, Tokens
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.core.layout import LayoutName
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.entry import Strategy

__all__ = ["Documents", "documents", "laid_out", "step_pairs"]


#: Tile pairs classified at most (rows x tiles x tiles); beyond, exact visible pairs.
MAX_TILE_PAIRS = 2**24


@dataclasses.dataclass
class Documents:
    """A representative packed batch, as the time model lays it out.

    Attributes:
      tokens: natural-order ``[B', S]`` segment ids and bidirectional ids (``positions``
        unused).
      layout: the token order (:data:`jax_seqpar.core.layout.LAYOUTS`), or None for the
        package's default.
      spec: the mask (the layer's causality and window, and its chunks).
    """

    tokens: Tokens
    layout: Optional[LayoutName]
    spec: MaskSpec


def documents(shape: LayerShape, natural: Tokens, layout: Optional[LayoutName],
              spec: Optional[MaskSpec] = None) -> Optional[Documents]:
    """The batch ``natural`` (natural-order segment ids and bidirectional ids, either
    None) validated, or None (one document per row, no ids, no pieces, the default
    layout: :mod:`.predict`'s own position-only count, which classifies tiles by
    causality, window and chunks). ``spec``: the mask, by default the shape's."""
    spec = shape.mask if spec is None else spec
    if layout is not None and layout not in layouts.LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {layouts.LAYOUTS}.")
    segment_ids, bids = natural.segment_ids, natural.bidirectional_ids
    if bids is not None and not spec.causal:
        raise ValueError("bidirectional_ids lift causality: they mean nothing without "
                         "causal=True. Drop them or make the layer causal.")
    if segment_ids is None:
        if layout == "per_document":
            raise ValueError('layout="per_document" is laid out from documents: pass '
                             "segment_ids= (a representative batch, int[batch, seq_len]).")
        if layout is None and bids is None:
            return None
        rows = np.shape(bids)[0] if bids is not None and np.ndim(bids) == 2 else 1
        segment_ids = np.zeros((rows, shape.seq_len), np.int32)

    def as_rows(name, ids):
        ids = np.asarray(ids)
        ids = ids[None] if ids.ndim == 1 else ids
        if ids.ndim != 2 or ids.shape[1] != shape.seq_len:
            raise ValueError(f"{name} must be [batch, seq_len={shape.seq_len}]. Got "
                             f"{ids.shape}.")
        return ids.astype(np.int32)

    segment_ids = as_rows("segment_ids", segment_ids)
    if bids is not None:
        bids = as_rows("bidirectional_ids", bids)
        if bids.shape != segment_ids.shape:
            raise ValueError(f"bidirectional_ids {bids.shape} must have the shape of "
                             f"segment_ids {segment_ids.shape}.")
    return Documents(Tokens(None, segment_ids, bids), layout, spec)


def laid_out(entry: Strategy, devices: int, shape: LayerShape, tile: int,
             batch: Documents) -> Tokens:
    """``batch``'s tokens ``[B', S']`` in its layout over ``devices`` (None: the strategy
    ``entry``'s default, :func:`jax_seqpar.strategies.registry.default_layout`: zigzag
    where it balances causal work and the mask's reach is not bounded): positions, segment ids
    and bidirectional ids (padded with :data:`~jax_seqpar.core.masks.PAD_SEGMENT` as the
    entry point pads)."""
    ids, bids, layout = batch.tokens.segment_ids, batch.tokens.bidirectional_ids, batch.layout
    if ids is None:
        raise ValueError("laid_out takes documents (segment ids): see documents().")
    if layout is None:
        layout = registry.default_layout(entry.name, batch.spec, seq_len=shape.seq_len,
                                         num_shards=devices)
    pieces = {"zigzag": 2 * devices, "striped": devices * devices}.get(layout, devices)
    length = -(-ids.shape[1] // pieces) * pieces
    pad = ((0, 0), (0, length - ids.shape[1]))
    ids = np.pad(ids, pad, constant_values=PAD_SEGMENT)
    bids = None if bids is None else np.pad(bids, pad)
    if layout == "per_document":  # balanced for the mask when either is given
        positions = packing.per_document_positions(
            ids, devices, tile, bidirectional_ids=bids, chunk_size=batch.spec.chunk_size)
    else:
        order = {"contiguous": np.arange(length, dtype=np.int32),
                 "zigzag": np.asarray(layouts.zigzag_positions(length, devices)),
                 "striped": np.asarray(layouts.striped_positions(length, devices))}[layout]
        positions = np.broadcast_to(order, ids.shape)
    gather = lambda x: None if x is None else np.take_along_axis(x, positions, 1)  # noqa
    return Tokens(positions, gather(ids), gather(bids))


def step_pairs(entry: Strategy, ring: int, ulysses: int, shape: LayerShape, tile: int,
               batch: Documents) -> list[float]:
    """Computed (query, key) pairs per row at each ring step of the strategy ``entry``, on
    that step's busiest device (where it gathers K/V, the all-gather's way: one step, its
    busiest device's total).

    A ring group's tokens are its ``ulysses`` devices' slots together (what Ulysses'
    all-to-all gathers); tiles are ``tile`` clipped to a group. Past
    ``MAX_TILE_PAIRS``, the exact visible pairs (no tile rounding).
    """
    tokens = laid_out(entry, ring * ulysses, shape, tile, batch)
    rows, length = tokens.positions.shape
    block = min(tile, length // ring)
    if rows * (length / block) ** 2 <= MAX_TILE_PAIRS:
        steps = work.computed_tiles_per_shard(batch.spec, tokens, ring, block_q=block,
                                     per_step=True) * float(block * block)
    else:
        steps = work.work_per_step(batch.spec, tokens, ring)
    steps = steps / rows  # [device, step], per row
    if entry.gathers_kv:
        return [float(steps.sum(1).max())]
    return [float(x) for x in steps.max(0)]
