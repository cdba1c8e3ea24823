"""Put a whole training batch into a token order once, and back.

A layout is a property of the token order (see :mod:`jax_seqpar.core.layout`). Models
apply it ONCE per batch, to every per-token array (tokens, labels, segment ids,
loss weights) together, and hand the resulting ``positions`` to every attention
layer (``sequence_parallel_attention(..., positions=)``, RoPE): no layer then
moves tokens, and each sends exactly what its strategy needs. A loss that is a
(weighted) mean over tokens does not depend on their order.

``"per_document"`` (:mod:`jax_seqpar.core.packing`) depends on the data: every row
gets its own order from its segment ids, and going back needs the ``positions``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core import home_packing, layout as layouts, packing
from jax_seqpar.core.masks import MaskSpec, Tokens, normalize_document_shards as masks_normalize
from jax_seqpar.core.layout import LayoutName

__all__ = ["permute_batch", "unpermute_batch"]


_PERMUTE = {"zigzag": layouts.zigzag_permute, "striped": layouts.striped_permute}
_UNPERMUTE = {"zigzag": layouts.zigzag_unpermute, "striped": layouts.striped_unpermute}


def _check(batch, layout: str, axis: int):
    if layout not in layouts.LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {layouts.LAYOUTS}.")
    ranks = {jnp.ndim(x) for x in jax.tree.leaves(batch)}
    if not ranks:
        raise ValueError("batch holds no array to reorder.")
    if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis < min(ranks):
        raise ValueError(f"axis={axis!r} is not a dim of every array of the batch (ranks "
                         f"{sorted(ranks)}): pass the sequence axis, 0 <= axis < {min(ranks)} "
                         "(default 1, for [B, S, ...] arrays).")
    shapes = {x.shape[:axis + 1] for x in jax.tree.leaves(batch)}
    if len(shapes) != 1:
        raise ValueError(f"every array of the batch must share its leading [batch, seq] dims "
                         f"(up to axis {axis}). Got {sorted(shapes)}.")
    return shapes.pop()


def _gather(batch, order, axis: int):
    """Every leaf of ``batch`` reordered along ``axis`` by ``order`` (``lead`` shaped: one
    order per leading index); numpy leaves stay numpy when ``order`` is numpy."""
    def take(x):
        host = isinstance(x, np.ndarray) and isinstance(order, np.ndarray)
        xp = np if host else jnp
        index = order.reshape(order.shape + (1,) * (x.ndim - order.ndim))
        return xp.take_along_axis(xp.asarray(x), xp.asarray(index), axis=axis)

    return jax.tree.map(take, batch)


def _per_document(batch, num_shards, axis, lead, tokens: Tokens, spec: MaskSpec, block_size,
                  bound=None):
    """``tokens``: the natural-order ids (``positions`` unused); ``spec``: the chunks."""
    if tokens.segment_ids is None:
        raise ValueError('layout="per_document" orders every row by its documents: pass '
                         "segment_ids= (int[batch, seq], in natural order).")
    for name in ("segment_ids", "bidirectional_ids"):
        ids = getattr(tokens, name)
        if ids is not None and tuple(ids.shape) != tuple(lead):
            raise ValueError(f"{name} must have the batch's leading dims {tuple(lead)}. Got "
                             f"{tuple(ids.shape)}.")
    rows = tokens.segment_ids.reshape(-1, lead[axis])
    bids = tokens.bidirectional_ids
    bids = None if bids is None else bids.reshape(-1, lead[axis])
    block = packing.DEFAULT_BLOCK if block_size is None else block_size
    if bound is not None:
        if not isinstance(rows, np.ndarray) or not (bids is None or isinstance(bids, np.ndarray)):
            raise ValueError("max_document_shards= places whole documents on host: pass numpy "
                             "segment_ids (and bidirectional_ids), not JAX arrays (a data "
                             "pipeline step).")
        if not (isinstance(bound, str) and bound == "auto"):
            bound = masks_normalize(bound)  # a positive int (ValueError otherwise)
        natural = Tokens(np.broadcast_to(np.arange(rows.shape[1], dtype=np.int32), rows.shape),
                         rows.astype(np.int32), None if bids is None else bids.astype(np.int32))
        positions = home_packing.home_positions(spec, natural, num_shards, bound,
                                                block=block).reshape(lead)
        return _gather(batch, positions, axis), positions
    positions = packing.per_document_positions(rows, num_shards, block, bidirectional_ids=bids,
                                               chunk_size=spec.chunk_size).reshape(lead)
    return _gather(batch, positions, axis), positions


def permute_batch(batch: Any, layout: LayoutName, num_shards: int, *, axis: int = 1,
                  segment_ids: jax.Array | None = None, block_size: Optional[int] = None,
                  bidirectional_ids: jax.Array | None = None, chunk_size: Optional[int] = None,
                  max_document_shards: Union[int, Literal["auto"], None] = None):
    """Reorder every array of ``batch`` into ``layout`` along the sequence ``axis``.

    Args:
      batch: a pytree of arrays that share ``[B, S]`` leading dims (e.g. ``tokens
        int32[B, S]``, ``targets``, ``segment_ids``, ``weights``, ``[B, S, d]``
        embeddings), in natural token order.
      layout: ``"contiguous"`` (nothing moves), ``"zigzag"``, ``"striped"`` or
        ``"per_document"`` (each row ordered by its documents so that every shard does
        the same causal-within-document work: :mod:`jax_seqpar.core.packing`).
      num_shards: ``P``, the number of sequence shards the layout is for.
      axis: the sequence axis (default 1).
      segment_ids: ``"per_document"`` only (and required there): ``int[B, S]``
        document ids in natural order (:data:`~jax_seqpar.core.masks.PAD_SEGMENT`:
        padding). Numpy ids are laid out on host and numpy arrays of the batch stay
        numpy; JAX ids (traceable, under ``jit``) give JAX arrays.
      block_size: ``"per_document"`` only: the kernel tile dealt runs are aligned
        to (default :data:`~jax_seqpar.core.packing.DEFAULT_BLOCK`).
      bidirectional_ids: ``"per_document"`` only: ``int[B, S]`` in natural order (the
        ids the attention layers take: a prefix-LM prompt, an image), or None.
      chunk_size: ``"per_document"`` only: the layers' chunked attention, or None.
        With either, every shard gets the mean work of the causal mask they make, in
        visible pairs and in computed tiles (:mod:`jax_seqpar.core.mask_packing`; host
        numpy ids only), instead of the mean causal-within-document work.
      max_document_shards: ``"per_document"`` only: ``D``, place every document on at
        most ``D`` consecutive shards (:mod:`jax_seqpar.core.home_packing`; host numpy
        ids): shorter ones whole on one shard where the balance allows. An int must keep
        the balance (busiest shard <= 1.05x the mean visible pairs, <= 1.10x the mean
        computed tiles; a ``ValueError`` names what it reaches and the smallest ``D``
        that keeps it); ``"auto"`` takes the smallest ``D`` that does among those
        that bound the reach (``D <= P // 2``; else the unbounded order). Pass
        :func:`jax_seqpar.core.packing.document_shards` of the laid-out ids to the
        attention calls' ``max_document_shards=``: each then sends ``D - 1`` shards'
        keys either side, none for ``D = 1``.

    Returns:
      ``(batch, positions)``: the batch in layout order, and ``int32[B, S]`` the global
      position of every token in that order, for ``positions=`` and RoPE (one order
      per row for ``"per_document"``).

    Raises:
      ValueError: an unknown layout, an ``axis`` that is not a dim of every array,
        arrays that disagree on ``[B, S]``, a sequence
        the layout cannot split (zigzag needs ``S % 2P == 0``, the others
        ``S % P == 0``), ``"per_document"`` without ``segment_ids``, or with
        bidirectional ids or chunks and JAX (not numpy) ids.

    .. code-block:: python

        batch, positions = permute_batch({"tokens": tokens, "targets": targets},
                                         "zigzag", num_shards=8)
        batch, positions = permute_batch(batch, "per_document", num_shards=8,
                                         segment_ids=batch["segment_ids"])
        batch, positions = permute_batch(batch, "per_document", num_shards=8,
                                         segment_ids=batch["segment_ids"],
                                         bidirectional_ids=batch["image_ids"])
        batch, positions = permute_batch(batch, "per_document", num_shards=8,
                                         segment_ids=batch["segment_ids"],
                                         max_document_shards="auto")
        bound = document_shards(batch["segment_ids"], num_shards=8)  # pass it on
    """
    lead = _check(batch, layout, axis)
    spec = MaskSpec.make(causal=True, chunk_size=chunk_size)
    tokens = Tokens(None, segment_ids, bidirectional_ids)
    if layout == "per_document":
        return _per_document(batch, num_shards, axis, lead, tokens, spec, block_size,
                             max_document_shards)
    if any(x is not None for x in (segment_ids, block_size, bidirectional_ids, chunk_size,
                                   max_document_shards)):
        raise ValueError(f"segment_ids=, block_size=, bidirectional_ids=, chunk_size= and "
                         f"max_document_shards= shape "
                         f"the per_document layout only; layout={layout!r} is the same for "
                         "every batch.")
    seq_len = lead[axis]
    arange = jnp.arange(seq_len, dtype=jnp.int32)
    if layout != "contiguous":
        batch = jax.tree.map(lambda x: _PERMUTE[layout](x, num_shards, axis=axis), batch)
        arange = _PERMUTE[layout](arange, num_shards, axis=0)
    return batch, jnp.broadcast_to(arange, (*lead[:axis], seq_len))


def unpermute_batch(batch: Any, layout: LayoutName, num_shards: int, *, axis: int = 1,
                    positions: jax.Array | None = None):
    """Inverse of :func:`permute_batch`: arrays in ``layout`` order back to natural order.

    Args:
      batch: a pytree of arrays sharing ``[B, S]`` leading dims (e.g. logits).
      layout, num_shards, axis: as given to :func:`permute_batch`.
      positions: the ``positions`` :func:`permute_batch` returned; required for
        ``"per_document"`` (its order depends on the data), optional otherwise.

    Returns:
      The batch in natural token order.
    """
    lead = _check(batch, layout, axis)
    if positions is not None:
        if tuple(positions.shape) != tuple(lead):
            raise ValueError(f"positions must have the batch's leading dims {tuple(lead)}. "
                             f"Got {tuple(positions.shape)}.")
        xp = np if isinstance(positions, np.ndarray) else jnp
        return _gather(batch, xp.argsort(positions, axis=axis).astype(np.int32), axis)
    if layout == "per_document":
        raise ValueError('layout="per_document" depends on the data: pass the positions= '
                         "permute_batch returned.")
    if layout == "contiguous":
        return batch
    return jax.tree.map(lambda x: _UNPERMUTE[layout](x, num_shards, axis=axis), batch)
