"""Byte-level training data from Python's own standard library, packed into long rows.

No download: the documents are the ``.py`` files next to ``os.py`` in the running
interpreter, read in sorted order, so the data is deterministic for a given Python
installation (and differs between Python versions). Every file is one document;
documents are concatenated and cut into rows of ``seq_len`` tokens, with
``segment_ids`` telling which document each token belongs to, so attention never
crosses a document boundary and no padding is needed.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Optional

import numpy as np

VOCAB_SIZE = 256  # one token per byte


def stdlib_documents(max_bytes: int) -> list[bytes]:
    """The first ``max_bytes`` bytes of the standard library's top-level ``.py`` files.

    Args:
      max_bytes: stop once this many bytes are read (the last file is truncated).

    Returns:
      The documents' bytes, file by file, in sorted file-name order.
    """
    library = pathlib.Path(os.path.dirname(os.__file__))
    documents, total = [], 0
    for path in sorted(library.glob("*.py")):
        if total >= max_bytes:
            break
        text = path.read_bytes()[: max_bytes - total]
        if text:
            documents.append(text)
            total += len(text)
    if total < max_bytes:
        raise ValueError(f"the standard library in {library} has only {total} bytes of .py "
                         f"sources; asked for {max_bytes}. Use fewer steps or a shorter "
                         "seq_len / batch.")
    return documents


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Documents packed into rows for next-token prediction.

    Attributes:
      tokens: ``int32[rows, seq_len]`` input bytes.
      targets: ``int32[rows, seq_len]`` the byte after each input byte.
      segment_ids: ``int32[rows, seq_len]`` document index of each input byte.
      weights: ``float32[rows, seq_len]`` 1 where the target is in the input's
        document, 0 at the last byte of a document (the next document's first
        byte is not predictable from it) and where the input sees its target (both
        carry one non-zero bidirectional id).
      bidirectional_ids: ``int32[rows, seq_len]`` (see ``MASKS``), or None.
    """

    tokens: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    weights: np.ndarray
    bidirectional_ids: Optional[np.ndarray] = None


def pack_documents(documents: list[bytes], seq_len: int) -> PackedRows:
    """Concatenate ``documents`` and cut the stream into rows of ``seq_len`` tokens.

    RoPE positions (in :class:`jax_seqpar.flax.SelfAttention`) stay global within
    a row; they enter attention only as differences, so this equals restarting
    them at every document.

    .. code-block:: python

        pack_documents([b"abc", b"de"], seq_len=2).segment_ids
        # array([[0, 0],

           [0, 1]], dtype=int32)
    """
    stream = np.frombuffer(b"".join(documents), np.uint8).astype(np.int32)
    document = np.repeat(np.arange(len(documents), dtype=np.int32),
                         [len(d) for d in documents])
    rows = (stream.size - 1) // seq_len
    if rows < 1:
        raise ValueError(f"{stream.size} tokens do not fill one row of seq_len={seq_len} + 1.")
    used = rows * seq_len
    shape = (rows, seq_len)
    return PackedRows(
        tokens=stream[:used].reshape(shape),
        targets=stream[1:used + 1].reshape(shape),
        segment_ids=document[:used].reshape(shape),
        weights=(document[:used] == document[1:used + 1]).astype(np.float32).reshape(shape))


#: The masks a batch can carry (``jax-seqpar demo --mask``): ``"prefix"``, prefix-LM
#: documents (each document's first quarter in a row one bidirectional id, seen in both
#: directions); ``"vlm"``, image-like spans (a quarter of every ``seq_len // 4`` tokens
#: one id each, text causal around them); ``"chunked"``, Llama 4's chunked causal
#: attention (no ids: the model's ``chunk_size``).
MASKS = ("chunked", "prefix", "vlm")


def _prefix_ids(rows: PackedRows) -> np.ndarray:
    """``int32[rows, S]``: each document's first quarter in its row one id (its run's
    index + 1), the rest 0."""
    ids = np.zeros_like(rows.segment_ids, np.int32)
    for row, segments in zip(ids, rows.segment_ids):
        starts = np.flatnonzero(np.r_[True, segments[1:] != segments[:-1]])
        ends = np.r_[starts[1:], segments.size]
        for run, (start, end) in enumerate(zip(starts, ends)):
            row[start:start + max(1, (end - start) // 4)] = run + 1
    return ids


def _span_ids(shape: tuple) -> np.ndarray:
    """``int32[rows, S]``: spans of ``S // 16`` tokens every ``S // 4``, one id each."""
    seq_len = shape[-1]
    period = max(4, seq_len // 4)
    offset = np.arange(seq_len) % period
    ids = np.where((offset >= period // 4) & (offset < period // 2),
                   np.arange(seq_len) // period + 1, 0).astype(np.int32)
    return np.broadcast_to(ids, shape).copy()


def with_mask(rows: PackedRows, mask: Optional[str]) -> PackedRows:
    """``rows`` with the bidirectional ids of ``mask`` (one of ``MASKS``, or None),
    and no weight where an input sees its target (the same non-zero id: predicting it
    would be copying it)."""
    if mask is None or mask == "chunked":
        return rows
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} is not one of {MASKS} (or None).")
    ids = _prefix_ids(rows) if mask == "prefix" else _span_ids(
        rows.segment_ids.shape)
    sees_target = np.zeros(ids.shape, bool)
    sees_target[:, :-1] = (ids[:, :-1] != 0) & (ids[:, 1:] == ids[:, :-1])
    return dataclasses.replace(rows, bidirectional_ids=ids,
                               weights=np.where(sees_target, 0.0, rows.weights)
                               .astype(np.float32))


def training_batches(*, steps: int, batch: int, seq_len: int, seed: int,
                     mask: Optional[str] = None) -> PackedRows:
    """``steps`` batches of fresh rows, shuffled by ``seed``: arrays ``[steps, batch, seq_len]``,
    with the bidirectional ids of ``mask`` (:func:`with_mask`).

    .. code-block:: python

        data = training_batches(steps=10, batch=2, seq_len=1024, seed=0)
        data.tokens.shape
        # (10, 2, 1024)
    """
    rows_needed = steps * batch
    rows = pack_documents(stdlib_documents(rows_needed * seq_len + 1), seq_len)
    order = np.random.default_rng(seed).permutation(rows.tokens.shape[0])[:rows_needed]
    rows = with_mask(dataclasses.replace(rows, **{
        f.name: getattr(rows, f.name)[order] for f in dataclasses.fields(PackedRows)
        if getattr(rows, f.name) is not None}), mask)
    return dataclasses.replace(rows, **{
        f.name: getattr(rows, f.name).reshape(steps, batch, seq_len)
        for f in dataclasses.fields(PackedRows) if getattr(rows, f.name) is not None})
