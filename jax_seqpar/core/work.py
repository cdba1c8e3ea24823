"""How much attention work each device of a token order does: visible (query, key) pairs.

A device's work in a sequence-parallel layer is the number of (query, key) pairs its
queries see, whichever device holds the keys (a ring brings them all). Host numpy, no
``[S, S]`` matrix: a query at position ``p`` of document ``s`` sees exactly the keys
whose ``(document, position)`` lies in ``[(s, lo), (s, hi)]`` (``lo, hi`` from the
window and causality), so its count is the distance between two insertion points in
the row's keys sorted by ``(document, position)``. ``O(S log S)`` a row, any window,
any ids (a document need not be one run: equal ids are one document, as for the mask).

* :func:`token_work`: each token's visible keys;
* :func:`work_per_shard`: summed over each shard's slots (``[P]``, or ``[B, P]``);
* :func:`work_per_step`: per device and ring step (``[P, P]``);
* :func:`ring_makespans`: a ring's time models from per-step loads;
* :func:`computed_tiles_per_shard`: the (query tile, key tile) pairs the kernels compute
  in a ring, classified per batch row as they classify them
  (:func:`jax_seqpar.core.masks.classify`): what time follows.

Padding (:data:`~jax_seqpar.core.masks.PAD_SEGMENT`) sees nothing and nothing sees it.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jax_seqpar.core import masks
from jax_seqpar.core.masks import PAD_SEGMENT, normalize_window

__all__ = ["computed_tiles_per_shard", "ring_makespans", "token_work", "work_per_shard",
           "work_per_step"]


def _rows(positions, segment_ids):
    """``(positions int64[B, S], segment_ids int64[B, S])`` (one document when None)."""
    positions = np.asarray(positions, np.int64)
    if positions.ndim == 1:
        positions = positions[None]
    if positions.ndim != 2:
        raise ValueError(f"positions must be [batch, seq] (or [seq]). Got {positions.shape}.")
    if segment_ids is None:
        return positions, np.zeros_like(positions)
    segment_ids = np.asarray(segment_ids, np.int64)
    segment_ids = segment_ids[None] if segment_ids.ndim == 1 else segment_ids
    if segment_ids.shape != positions.shape:
        raise ValueError(f"segment_ids {segment_ids.shape} must have the shape of positions "
                         f"{positions.shape}.")
    return positions, segment_ids


def _counts(q_pos, q_seg, k_pos, k_seg, causal: bool, window: Optional[tuple]):
    """For each query of one row, how many of the given keys it sees (1-D arrays)."""
    real = k_seg != PAD_SEGMENT
    k_pos, k_seg = k_pos[real], k_seg[real]
    low = int(min(q_pos.min(), k_pos.min(initial=q_pos.min())))
    span = int(max(q_pos.max(), k_pos.max(initial=q_pos.max()))) - low + 1
    ids = np.unique(np.concatenate([q_seg, k_seg]))
    keys = np.sort(np.searchsorted(ids, k_seg) * span + (k_pos - low))
    rel = q_pos - low
    lo = np.zeros_like(rel) if window is None else rel - window[0]
    hi = np.full_like(rel, span - 1) if window is None else rel + window[1]
    if causal:
        hi = np.minimum(hi, rel)
    lo, hi = np.clip(lo, 0, span - 1), np.clip(hi, 0, span - 1)
    base = np.searchsorted(ids, q_seg) * span
    count = np.searchsorted(keys, base + hi, "right") - np.searchsorted(keys, base + lo, "left")
    return np.where((hi >= lo) & (q_seg != PAD_SEGMENT), count, 0)


def token_work(positions, segment_ids=None, *, causal: bool = True, window=None) -> np.ndarray:
    """``int64[B, S]``: how many keys of its row each token sees.

    Args:
      positions: ``int[B, S]`` global (natural-order) positions, unique within a row,
        in any token order (a layout's order).
      segment_ids: ``int[B, S]`` document ids in the same order, or None (one document).
      causal, window: the mask (``window``: an int or ``(left, right)``).
    """
    positions, segment_ids = _rows(positions, segment_ids)
    window = normalize_window(window)
    return np.stack([_counts(p, s, p, s, causal, window)
                     for p, s in zip(positions, segment_ids)])


def _check_split(seq_len: int, num_shards: int) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or (
            num_shards < 1 or seq_len % num_shards):
        raise ValueError(f"num_shards={num_shards!r} must be a positive int dividing the "
                         f"sequence ({seq_len} tokens).")
    return seq_len // num_shards


def work_per_shard(positions, segment_ids, num_shards: int, causal: bool = True,
                   window=None, *, per_row: bool = False) -> np.ndarray:
    """Visible (query, key) pairs of each shard's queries: ``int64[P]`` summed over the
    rows (``[B, P]`` with ``per_row``).

    Shard ``r`` holds slots ``r*S/P .. (r+1)*S/P - 1`` of every row; its queries see
    keys on every shard. ``work.max() / work.mean()`` is a layout's imbalance.

    Args:
      positions: ``int[B, S]`` the tokens' global positions in layout order (the
        ``positions`` :func:`jax_seqpar.permute_batch` returns).
      segment_ids: ``int[B, S]`` their document ids in the same order, or None.
      num_shards: ``P``; causal, window: the mask.
      per_row: one row of counts per batch row.

    >>> batch, positions = permute_batch(batch, "zigzag", 8)
    >>> work = work_per_shard(positions, batch["segment_ids"], 8)
    >>> float(work.max() / work.mean())  # 1.0: balanced
    """
    work = token_work(positions, segment_ids, causal=causal, window=window)
    rows, seq_len = work.shape
    local = _check_split(seq_len, num_shards)
    per = work.reshape(rows, num_shards, local).sum(-1)
    return per if per_row else per.sum(0)


def work_per_step(positions, segment_ids, num_shards: int, causal: bool = True,
                  window=None) -> np.ndarray:
    """``int64[P, P]``: entry ``[r, k]`` is the visible pairs of shard ``r``'s queries with
    the keys of shard ``(r - k) % P``, the keys a ring brings at step ``k``, summed over
    the rows. Arguments as :func:`work_per_shard`."""
    positions, segment_ids = _rows(positions, segment_ids)
    window = normalize_window(window)
    local = _check_split(positions.shape[1], num_shards)
    out = np.zeros((num_shards, num_shards), np.int64)
    shards = np.arange(num_shards)
    for pos, seg in zip(positions, segment_ids):
        for j in range(num_shards):
            keys = slice(j * local, (j + 1) * local)
            seen = _counts(pos, seg, pos[keys], seg[keys], causal, window)
            out[shards, (shards - j) % num_shards] += seen.reshape(num_shards, local).sum(1)
    return out


def ring_makespans(per_step) -> dict:
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


def _shard_summaries(positions, segment_ids, num_shards: int, block: int):
    """Per-row summaries of each shard's tiles, ``[B, P, n]`` fields: each shard tiled
    on its own as a kernel call tiles it (the tile clipped to the shard, its tail padded)."""
    rows, seq_len = positions.shape
    local = _check_split(seq_len, num_shards)
    block = min(block, local)
    padded = -(-local // block) * block

    def shards(x, fill):
        x = x.reshape(rows * num_shards, local)
        return np.pad(x, ((0, 0), (0, padded - local)), constant_values=fill)

    tokens = masks.Tokens(shards(positions, 0).astype(np.int32),
                          shards(segment_ids, PAD_SEGMENT).astype(np.int32))
    summary = masks.summarize(tokens, block, per_row=True)  # [B*P, n]
    return jax.tree.map(lambda x: x.reshape(rows, num_shards, -1), summary)


def computed_tiles_per_shard(positions, segment_ids, num_shards: int, *, block_q: int,
                             block_k: Optional[int] = None, causal: bool = True, window=None,
                             count: str = "skip", per_step: bool = False) -> np.ndarray:
    """Row-tiles each shard's queries compute in a ring: ``int64[P]`` (``[P, P]`` per ring
    step with ``per_step``: ``[r, k]`` is shard ``r``'s queries against the keys of
    shard ``(r - k) % P``).

    Each ring step is one kernel call on a shard's queries and one shard's keys, tiled
    on their own and classified per batch row with :func:`jax_seqpar.core.masks.classify`
    (ranges and segment signatures, padding left out), as the kernels classify them.

    Args:
      positions, segment_ids: ``int[B, S]`` in layout order (see :func:`work_per_shard`;
        no segment ids: one document).
      num_shards: ``P``; block_q, block_k: the kernel's tiles (``block_k`` defaults to
        ``block_q``; both clipped to a shard).
      causal, window: the mask.
      count: ``"skip"``, the non-``EMPTY`` tiles (the XLA and Mosaic kernels compute
        those), or ``"range"``, every tile from a query tile's first to its last
        non-``EMPTY`` one at each step (the Triton kernel's loop bounds).
      per_step: per device and ring step.
    """
    positions, segment_ids = _rows(positions, segment_ids)
    window = normalize_window(window)
    spec = masks.MaskSpec.make(causal, window)
    block_k = block_q if block_k is None else block_k
    q = _shard_summaries(positions, segment_ids, num_shards, block_q)
    kv = _shard_summaries(positions, segment_ids, num_shards, block_k)
    expand = lambda tree, axis: jax.tree.map(lambda x: np.expand_dims(x, axis), tree)  # noqa
    # [B, P (queries), P (keys), nq, nk], classified on host by the kernels' rule
    nonempty = masks.classify(spec, expand(q, 2), expand(kv, 1)) != masks.EMPTY
    if count == "skip":
        per_pair = nonempty.sum(axis=(3, 4))
    elif count == "range":
        cols = np.arange(nonempty.shape[-1])
        first = np.where(nonempty, cols, nonempty.shape[-1]).min(-1)
        end = np.where(nonempty, cols + 1, 0).max(-1)
        per_pair = np.maximum(end - first, 0).sum(-1)
    else:
        raise ValueError(f"count={count!r} is not 'skip' or 'range'.")
    per_pair = per_pair.sum(0).astype(np.int64)  # [P queries, P keys]
    if not per_step:
        return per_pair.sum(1)
    shards = np.arange(num_shards)
    return per_pair[shards[:, None], (shards[:, None] - shards[None, :]) % num_shards]
