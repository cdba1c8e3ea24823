"""How much attention work each device of a token order does: visible (query, key) pairs.

A device's work in a sequence-parallel layer is the number of (query, key) pairs its
queries see, whichever device holds the keys (a ring brings them all). Host numpy,
counted by the mask's own rules: both sides sorted by (document, position) and cut in
tiles, each pair of tiles classified (:func:`jax_seqpar.core.blocks.classify`, exact
where it says EMPTY or FULL) and the PARTIAL ones counted pair by pair by the mask
predicate (:func:`jax_seqpar.core.masks.visible`: causal, window, chunks, documents,
bidirectional ids). No ``[S, S]`` matrix is held. A document need not be one run:
equal ids are one document, as for the mask.

Every count takes the mask as data: a :class:`~jax_seqpar.core.masks.MaskSpec` and the
laid-out :class:`~jax_seqpar.core.masks.Tokens` (positions, segment ids, bidirectional ids).

* :func:`token_work`: each token's visible keys;
* :func:`work_per_shard`: summed over each shard's slots (``[P]``, or ``[B, P]``);
* :func:`work_per_step`: per device and ring step (``[P, P]``);
* :func:`ring_makespans`: a ring's time models from per-step loads;
* :func:`computed_tiles_per_shard`: the (query tile, key tile) pairs the kernels compute
  in a ring, classified per batch row as they classify them
  (:func:`jax_seqpar.core.blocks.classify`): what time follows.

Padding (:data:`~jax_seqpar.core.masks.PAD_SEGMENT`) sees nothing and nothing sees it.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jax_seqpar.core import blocks, masks
from jax_seqpar.core.masks import PAD_SEGMENT

__all__ = ["computed_tiles_per_shard", "ring_makespans", "token_work", "work_per_shard",
           "work_per_step"]


def _rows(tokens: masks.Tokens) -> masks.Tokens:
    """``tokens`` as ``int64[B, S]`` numpy fields (``[S]`` is one row); no segment ids:
    one document (zeros)."""
    positions = np.asarray(tokens.positions, np.int64)
    if positions.ndim == 1:
        positions = positions[None]
    if positions.ndim != 2:
        raise ValueError(f"positions must be [batch, seq] (or [seq]). Got {positions.shape}.")

    def field(name, value, default):
        if value is None:
            return default
        value = np.asarray(value, np.int64)
        value = value[None] if value.ndim == 1 else value
        if value.shape != positions.shape:
            raise ValueError(f"{name} {value.shape} must have the shape of positions "
                             f"{positions.shape}.")
        return value

    return masks.Tokens(positions,
                        field("segment_ids", tokens.segment_ids, np.zeros_like(positions)),
                        field("bidirectional_ids", tokens.bidirectional_ids, None))


#: Tokens a side of the tiles :func:`_counts` classifies; partial tiles evaluated at once.
_TILE, _PARTIAL_BATCH = 128, 256


def _sorted_tiles(tokens: masks.Tokens):
    """``(order, tiles)``: ``tokens`` (1-D fields) in (document, position) order, padded
    with :data:`~jax_seqpar.core.masks.PAD_SEGMENT` to whole tiles, ``[n, _TILE]`` fields; ``order`` maps each
    slot to its token (``-1``: padding)."""
    size = tokens.positions.shape[0]
    ids = np.zeros_like(tokens.positions) if tokens.segment_ids is None else tokens.segment_ids
    order = np.lexsort((tokens.positions, ids))
    padded = -(-max(size, 1) // _TILE) * _TILE
    order = np.pad(order, (0, padded - size), constant_values=-1)
    fills = masks.Tokens(0, PAD_SEGMENT, None if tokens.bidirectional_ids is None else 0)
    tiles = jax.tree.map(lambda x, fill: np.where(order < 0, fill, x[order]).reshape(-1, _TILE),
                         tokens, fills)
    return order.reshape(-1, _TILE), tiles


def _counts(spec: masks.MaskSpec, q: masks.Tokens, kv: masks.Tokens) -> np.ndarray:
    """``int64[Sq]``: how many of the keys ``kv`` each query of ``q`` sees (one row,
    1-D fields). Both sides sorted by (document, position) and tiled; each tile pair
    classified by :func:`jax_seqpar.core.blocks.classify` (exact where it claims EMPTY
    or FULL), the PARTIAL ones counted element by element by
    :func:`jax_seqpar.core.masks.visible`: no ``[S, S]`` matrix."""
    q_order, q_tiles = _sorted_tiles(q)
    kv_order, kv_tiles = _sorted_tiles(kv)
    flat = lambda tiles: jax.tree.map(lambda x: x.reshape(1, -1).astype(np.int32), tiles)  # noqa
    q_sum = jax.tree.map(lambda x: x[0], blocks.summarize(flat(q_tiles), _TILE, per_row=True))
    kv_sum = jax.tree.map(lambda x: x[0], blocks.summarize(flat(kv_tiles), _TILE, per_row=True))
    kind = blocks.classify(spec, q_sum, kv_sum)  # [nq, nk]
    per_slot = np.zeros(q_order.shape, np.int64)
    full_keys = ((kind == blocks.FULL) * (kv_order >= 0).sum(1)).sum(1)  # FULL: no padding
    per_slot += full_keys[:, None]
    rows, cols = np.nonzero(kind == blocks.PARTIAL)
    for first in range(0, rows.size, _PARTIAL_BATCH):
        qi, ki = rows[first:first + _PARTIAL_BATCH], cols[first:first + _PARTIAL_BATCH]
        seen = masks.visible(spec, masks.rows(jax.tree.map(lambda x: x[qi], q_tiles)),
                             masks.cols(jax.tree.map(lambda x: x[ki], kv_tiles)))
        np.add.at(per_slot, qi, seen.sum(-1))
    out = np.zeros(q.positions.shape, np.int64)
    real = q_order >= 0
    out[q_order[real]] = per_slot[real]
    return np.where(q.segment_ids != PAD_SEGMENT, out, 0)


def token_work(spec: masks.MaskSpec, tokens: masks.Tokens) -> np.ndarray:
    """``int64[B, S]``: how many keys of its row each token sees under ``spec``.

    Args:
      spec: the mask (causal, window, chunk_size; a ``mask_fn`` too).
      tokens: ``int[B, S]`` (or ``[S]``) fields in any token order (a layout's order):
        global positions, unique within a row; document ids or None (one document);
        bidirectional ids or None.
    """
    tokens = _rows(tokens)
    return np.stack([_counts(spec, row, row) for row in _unbatched(tokens)])


def _unbatched(tokens: masks.Tokens):
    """The rows of ``[B, S]`` tokens, each with 1-D fields."""
    return [jax.tree.map(lambda x: x[b], tokens) for b in range(tokens.positions.shape[0])]


def _check_split(seq_len: int, num_shards: int) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or (
            num_shards < 1 or seq_len % num_shards):
        raise ValueError(f"num_shards={num_shards!r} must be a positive int dividing the "
                         f"sequence ({seq_len} tokens).")
    return seq_len // num_shards


def work_per_shard(spec: masks.MaskSpec, tokens: masks.Tokens, num_shards: int, *,
                   per_row: bool = False) -> np.ndarray:
    """Visible (query, key) pairs of each shard's queries: ``int64[P]`` summed over the
    rows (``[B, P]`` with ``per_row``).

    Shard ``r`` holds slots ``r*S/P .. (r+1)*S/P - 1`` of every row; its queries see
    keys on every shard. ``work.max() / work.mean()`` is a layout's imbalance.

    Args:
      spec: the mask.
      tokens: ``int[B, S]`` fields in layout order: the tokens' global positions (the
        ``positions`` :func:`jax_seqpar.permute_batch` returns), their document ids
        and bidirectional ids in the same order (or None).
      num_shards: ``P``; per_row: one row of counts per batch row.

    .. code-block:: python

        batch, positions = permute_batch(batch, "zigzag", 8)
        work = work_per_shard(MaskSpec(causal=True), Tokens(positions, batch["segment_ids"]), 8)
        float(work.max() / work.mean())  # 1.0: balanced
    """
    work = token_work(spec, tokens)
    rows, seq_len = work.shape
    local = _check_split(seq_len, num_shards)
    per = work.reshape(rows, num_shards, local).sum(-1)
    return per if per_row else per.sum(0)


def work_per_step(spec: masks.MaskSpec, tokens: masks.Tokens, num_shards: int) -> np.ndarray:
    """``int64[P, P]``: entry ``[r, k]`` is the visible pairs of shard ``r``'s queries with
    the keys of shard ``(r - k) % P``, the keys a ring brings at step ``k``, summed over
    the rows. Arguments as :func:`work_per_shard`."""
    tokens = _rows(tokens)
    local = _check_split(tokens.positions.shape[1], num_shards)
    out = np.zeros((num_shards, num_shards), np.int64)
    shards = np.arange(num_shards)
    for row in _unbatched(tokens):
        for j in range(num_shards):
            keys = jax.tree.map(lambda x: x[j * local:(j + 1) * local], row)  # noqa: B023
            seen = _counts(spec, row, keys)
            out[shards, (shards - j) % num_shards] += seen.reshape(num_shards, local).sum(1)
    return out


def ring_makespans(per_step: np.ndarray) -> dict:
    """A ring's time, relative to the mean device's total, from per-step loads
    ``[P, P]`` (``[r, k]``: device ``r`` at step ``k``; work or tile counts).

    Returns:
      ``{"total": ..., "chain": ..., "lockstep": ...}``: the busiest device's total
      (devices that never wait), a chain (device ``r`` starts step ``k+1`` when it and
      its sender ``r-1`` finished step ``k``: the sender issues the next hop when its
      step starts), and lock-step (every step waits for its slowest device).
    """
    per_step = np.asarray(per_step, float)
    mean = max(per_step.sum(1).mean(), 1e-300)
    finish = per_step[:, 0].copy()
    for k in range(1, per_step.shape[1]):
        finish = np.maximum(finish, np.roll(finish, 1)) + per_step[:, k]
    return {"total": per_step.sum(1).max() / mean, "chain": finish.max() / mean,
            "lockstep": per_step.max(0).sum() / mean}


def _shard_summaries(tokens: masks.Tokens, num_shards: int, block: int):
    """Per-row summaries of each shard's tiles, ``[B, P, n]`` fields: each shard tiled
    on its own as a kernel call tiles it (the tile clipped to the shard, its tail padded)."""
    rows, seq_len = tokens.positions.shape
    local = _check_split(seq_len, num_shards)
    block = min(block, local)
    padded = -(-local // block) * block
    fills = masks.Tokens(0, PAD_SEGMENT, None if tokens.bidirectional_ids is None else 0)

    def shards(x, fill):
        x = x.reshape(rows * num_shards, local)
        return np.pad(x, ((0, 0), (0, padded - local)), constant_values=fill).astype(np.int32)

    summary = blocks.summarize(jax.tree.map(shards, tokens, fills), block,
                              per_row=True)  # [B*P, n]
    return jax.tree.map(lambda x: x.reshape(rows, num_shards, -1), summary)


def computed_tiles_per_shard(spec: masks.MaskSpec, tokens: masks.Tokens, num_shards: int, *,
                             block_q: int, block_k: Optional[int] = None, count: str = "skip",
                             per_step: bool = False) -> np.ndarray:
    """Row-tiles each shard's queries compute in a ring: ``int64[P]`` (``[P, P]`` per ring
    step with ``per_step``: ``[r, k]`` is shard ``r``'s queries against the keys of
    shard ``(r - k) % P``).

    Each ring step is one kernel call on a shard's queries and one shard's keys, tiled
    on their own and classified per batch row with :func:`jax_seqpar.core.blocks.classify`
    (ranges, segment signatures and bidirectional id ranges, padding left out), as the
    kernels classify them.

    Args:
      spec, tokens: the mask and the tokens in layout order (see :func:`work_per_shard`).
      num_shards: ``P``; block_q, block_k: the kernel's tiles (``block_k`` defaults to
        ``block_q``; both clipped to a shard).
      count: ``"skip"``, the non-``EMPTY`` tiles (the XLA and Mosaic kernels compute
        those), or ``"range"``, every tile from a query tile's first to its last
        non-``EMPTY`` one at each step (the Triton kernel's loop bounds).
      per_step: per device and ring step.
    """
    tokens = _rows(tokens)
    block_k = block_q if block_k is None else block_k
    q = _shard_summaries(tokens, num_shards, block_q)
    kv = _shard_summaries(tokens, num_shards, block_k)
    expand = lambda tree, axis: jax.tree.map(lambda x: np.expand_dims(x, axis), tree)  # noqa
    # [B, P (queries), P (keys), nq, nk], classified on host by the kernels' rule
    nonempty = blocks.classify(spec, expand(q, 2), expand(kv, 1)) != blocks.EMPTY
    if count == "skip":
        per_pair = nonempty.sum(axis=(3, 4))
    elif count == "range":
        cols = np.arange(nonempty.shape[-1])
        first = np.where(nonempty, cols, nonempty.shape[-1]).min(-1)
        end = np.where(nonempty, cols + 1, 0).max(-1)
        per_pair = np.maximum(end - first, 0).sum(-1)
    else:
        raise ValueError(f"count={count!r} is not 'skip' or 'range'.")
    pairs = np.asarray(per_pair.sum(0), np.int64)  # [P queries, P keys]; numpy on host
    if not per_step:
        return pairs.sum(1)
    shards = np.arange(num_shards)
    return pairs[shards[:, None], (shards[:, None] - shards[None, :]) % num_shards]
