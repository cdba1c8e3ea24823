"""The reach of a mask: how far beyond its own shard a query's keys may lie.

Sequence-parallel attention sends a device the keys its queries may see. Where the mask
bounds that, only the bound travels (:mod:`jax_seqpar.strategies.halo`: a halo
exchange; nothing at all where the reach is ``(0, 0)``). Two kinds of field bound it:

* on the contiguous split (shard ``r`` holds positions ``r*L .. r*L+L-1``), a window
  and chunks, which bound a query's keys by position;
* in any token order, ``max_document_shards=D`` with segment ids: every document lies
  on at most ``D`` consecutive shards, so a query's keys (its document's tokens) lie
  within ``D - 1`` shards on either side: ``((D-1)*L, (D-1)*L)`` tokens. Two-sided even
  under ``causal``: inside a document's span the per-document order balances the
  causal work, it does not keep the positions monotone. ``D = 1``: ``(0, 0)``.

The tighter bound wins, side by side. ``mask_fn``, segment ids alone and padding only
take keys away: they bound nothing.
"""

from __future__ import annotations

from typing import Optional

from jax_seqpar.core.masks import MaskSpec

__all__ = ["documents_bound_reach", "is_local", "mask_reach"]


def mask_reach(spec: MaskSpec, local_len: int, num_shards: int, *, bidirectional: bool = False,
               contiguous: bool = True, shard_len: Optional[int] = None
               ) -> Optional[tuple[int, int]]:
    """Tokens ``(left, right)`` beyond a shard that some query of it can see, or None (the
    full exchange).

    ``S = P*L`` tokens (``L = local_len``, ``P = num_shards``). Each field of the mask
    that bounds a query's keys bounds the reach, and the tighter bound wins:

    * ``window=(left, right)`` (contiguous split): ``left`` tokens before the shard,
      ``right`` after;
    * ``chunk_size=c`` (contiguous split): a query sees keys of its own chunk only, so
      shard ``r`` needs ``(r*L) mod c`` tokens before it (its first query's chunk start)
      and, without ``causal``, ``(-(r+1)*L) mod c`` after it (its last query's chunk
      end, clipped at ``S``); the reach is the largest over the shards;
    * ``causal`` makes the contiguous split's ``right`` 0, unless ``bidirectional``:
      with bidirectional ids a causal query also sees the later keys of its id;
    * ``max_document_shards=D`` (any order, segment ids given): ``(D-1) * shard_len``
      tokens on either side.

    Args:
      spec: the mask; local_len: ``L``; num_shards: ``P``.
      bidirectional: the tokens carry bidirectional ids.
      contiguous: the positions are the contiguous split (else only the documents'
        bound holds).
      shard_len: the length of the shards ``max_document_shards`` counts (default
        ``L``; the hybrid's ring over groups of ``I`` devices counts the devices' own).
    Returns:
      ``(left, right)`` with ``left + right < (P-1)*L``, or None when nothing bounds
      the reach or it reaches (nearly) every shard.

    >>> mask_reach(MaskSpec.make(causal=True, chunk_size=1024), 1024, 8)
    (0, 0)
    >>> mask_reach(MaskSpec.make(causal=True, chunk_size=2048), 1024, 8)
    (1024, 0)
    >>> mask_reach(MaskSpec.make(causal=True, max_document_shards=2), 1024, 8, contiguous=False)
    (1024, 1024)
    """
    infinite = (num_shards - 1) * local_len  # the whole rest of the sequence
    left = right = infinite
    if contiguous:
        left, right = _contiguous_reach(spec, local_len, num_shards, bidirectional)
    if spec.max_document_shards is not None:
        unit = local_len if shard_len is None else shard_len
        side = min((spec.max_document_shards - 1) * unit, infinite)
        left, right = min(left, side), min(right, side)
    if left + right >= infinite:
        return None
    return left, right


def _contiguous_reach(spec: MaskSpec, local_len: int, num_shards: int,
                      bidirectional: bool) -> tuple[int, int]:
    """The window's and the chunks' reach on the contiguous split (the full sequence where
    neither bounds it, or where the halo's zeros past the sequence ends would be seen)."""
    infinite = (num_shards - 1) * local_len
    left = right = infinite
    if spec.window is not None:
        left, right = min(spec.window[0], infinite), min(spec.window[1], infinite)
    if spec.chunk_size is not None:
        chunk, seq_len = spec.chunk_size, num_shards * local_len
        left = min(left, max((r * local_len) % chunk for r in range(num_shards)))
        right = min(right, max(min((-(r + 1) * local_len) % chunk, seq_len - (r + 1) * local_len)
                               for r in range(num_shards)))
    if spec.causal and not bidirectional:
        right = 0
    if left + right >= infinite or not _ends_unseen(spec, left, right, local_len, num_shards):
        return infinite, infinite
    return left, right


def _ends_unseen(spec: MaskSpec, left: int, right: int, local_len: int,
                 num_shards: int) -> bool:
    """Whether no query sees the halo's tokens past the sequence ends: shard 0's left halo
    (zeros at positions ``S-left .. S-1``) and shard ``P-1``'s right halo (zeros at
    ``0 .. right-1``), as the halo exchange places them on the contiguous split. A causal
    mask hides the first (later keys), a window or the chunks either. (With documents the
    halo's ids past the ends are padding: nothing sees them.)"""
    seq_len, chunk, window = num_shards * local_len, spec.chunk_size, spec.window
    left_hidden = not left or spec.causal or (
        window is not None and seq_len - left - (local_len - 1) > window[1]) or (
        chunk is not None and (seq_len - left) // chunk > (local_len - 1) // chunk)
    right_hidden = not right or (
        window is not None and seq_len - local_len - right + 1 > window[0]) or (
        chunk is not None and (right - 1) // chunk < (seq_len - local_len) // chunk)
    return bool(left_hidden and right_hidden)


def is_local(spec: MaskSpec, local_len: int, num_shards: int, *, bidirectional: bool = False,
             contiguous: bool = True) -> bool:
    """Whether the mask's reach is ``(0, 0)``: every query's keys are on its own device,
    and attention needs no collective at all (forward and backward)."""
    return mask_reach(spec, local_len, num_shards, bidirectional=bidirectional,
                      contiguous=contiguous) == (0, 0)


def documents_bound_reach(max_document_shards: Optional[int], num_shards: int) -> bool:
    """Whether ``max_document_shards=D`` bounds the reach on ``P`` shards: ``D - 1`` shards
    either side leave some shard out, ``2 (D - 1) < P - 1``. A larger ``D`` (or None)
    bounds nothing: every strategy sends the full exchange, and the bound is neither
    checked nor counted.

    >>> documents_bound_reach(4, 8), documents_bound_reach(5, 8)
    (True, False)
    """
    return max_document_shards is not None and 2 * (max_document_shards - 1) < num_shards - 1
