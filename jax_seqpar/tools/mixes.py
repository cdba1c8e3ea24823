"""Document mixes for the packed-balance bench (``jax-seqpar bench --packed``).

Each returns ``int32[B, S]`` segment ids of documents packed like
:func:`jax_seqpar.examples.pack_documents`: documents drawn from a length distribution
are concatenated into one stream and cut into rows of ``S`` tokens; a document's id is
its index in the stream (ids increase along a row; a document cut by a row end keeps
its id in both rows). The tests draw from them too (``tests/document_mixes.py`` adds
adversarial and padded mixes).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["MASKED", "MIXES", "chunked", "draw", "heavy_tailed", "one_long", "pack", "prefix_lm",
           "uniform_short", "vlm"]


def pack(lengths: Sequence[int] | np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    """The stream of documents of ``lengths`` (ints: a list or an array) cut into
    ``int32[batch, seq_len]`` ids."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.sum() < batch * seq_len:
        raise ValueError(f"documents of {lengths.sum()} tokens do not fill {batch} rows of "
                         f"{seq_len}.")
    ids = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)[:batch * seq_len]
    return ids.reshape(batch, seq_len)


def draw(sampler: Callable, batch: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """Packed documents whose lengths ``sampler(rng, n)`` draws (clipped to >= 1)."""
    lengths, total = [], 0
    while total < batch * seq_len:
        more = np.maximum(1, np.asarray(sampler(rng, 64), np.int64))
        lengths.extend(more.tolist())
        total += int(more.sum())
    return pack(lengths, batch, seq_len)


def one_long(batch: int, seq_len: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """One document filling each row."""
    return np.repeat(np.arange(batch, dtype=np.int32)[:, None], seq_len, axis=1)


def uniform_short(batch: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """Documents of uniformly random length in [64, 1024)."""
    return draw(lambda r, n: r.integers(64, 1024, n), batch, seq_len, rng)


def heavy_tailed(batch: int, seq_len: int, rng: np.random.Generator, alpha: float = 1.3,
                 scale: int = 64):
    """Pareto lengths ``ceil(64 (1 + Pareto(1.3)))``: median ~110 tokens, mean ~280, one
    document in 100 above 2,200 tokens: most documents short, a few holding many tokens."""
    return draw(lambda r, n: np.ceil(scale * (1 + r.pareto(alpha, n))), batch, seq_len, rng)


#: The bench's three mixes.
MIXES = {"one_long": one_long, "uniform_short": uniform_short, "heavy_tailed": heavy_tailed}


# Masked mixes: ``(segment_ids, bidirectional_ids)`` (ids ``int32[B, S]``; bidirectional
# ids non-zero on each prefix or image, unique along the stream, or None), packed like
# :func:`pack`: a document cut by a row end keeps its ids, its spans too.


def _pack_spans(documents, batch: int, seq_len: int):
    """``documents``: a list of ``int32[n]`` bidirectional ids (0: causal), one array a
    document; their stream cut into ``(segment_ids, bidirectional_ids)`` rows."""
    bids = np.concatenate(documents)[:batch * seq_len].reshape(batch, seq_len)
    return pack([d.size for d in documents], batch, seq_len), bids.astype(np.int32)


def prefix_lm(batch: int, seq_len: int, rng: np.random.Generator, low: float = 0.1,
              high: float = 0.6):
    """Heavy-tailed documents (:func:`heavy_tailed`'s lengths), each with a bidirectional
    prefix of a uniform ``low .. high`` fraction of its tokens (at least one)."""
    documents: list[np.ndarray] = []
    total = 0
    while total < batch * seq_len:
        n = int(np.ceil(64 * (1 + rng.pareto(1.3))))
        prefix = max(1, int(round(rng.uniform(low, high) * n)))
        documents.append(np.r_[np.full(prefix, len(documents) + 1), np.zeros(n - prefix)])
        total += n
    return _pack_spans(documents, batch, seq_len)


def vlm(batch: int, seq_len: int, rng: np.random.Generator, images: tuple[int, int] = (1, 4),
        image_tokens: tuple[int, int] = (256, 1024)):
    """Vision-language documents: 1-4 images of 256-1024 tokens (each one bidirectional
    id), between heavy-tailed runs of text (causal)."""
    documents, total, next_id = [], 0, 1
    while total < batch * seq_len:
        parts = [np.zeros(int(np.ceil(64 * (1 + rng.pareto(1.3)))))]
        for _ in range(int(rng.integers(images[0], images[1] + 1))):
            parts.append(np.full(int(rng.integers(image_tokens[0], image_tokens[1] + 1)),
                                 next_id))
            parts.append(np.zeros(int(np.ceil(64 * (1 + rng.pareto(1.3))))))
            next_id += 1
        documents.append(np.concatenate(parts))
        total += documents[-1].size
    return _pack_spans(documents, batch, seq_len)


def chunked(batch: int, seq_len: int, rng: np.random.Generator, few: bool = False):
    """Chunked causal rows (no bidirectional ids): one document per row, or with ``few``
    documents of ``S/4 .. S`` tokens (one to four a row)."""
    if not few:
        return one_long(batch, seq_len), None
    return draw(lambda r, n: r.integers(seq_len // 4, seq_len + 1, n), batch, seq_len,
                rng), None


#: The masked mixes, ``{name (mix, chunk_size)}``; each mix returns
#: ``(segment_ids, bidirectional_ids or None)``.
MASKED: dict[str, tuple[Callable[..., tuple], Optional[int]]] = {
    "prefix_lm": (prefix_lm, None),
    "vlm": (vlm, None),
    "chunked_2560": (chunked, 2560),
    "chunked_3000": (chunked, 3000),
    "chunked_6000": (chunked, 6000),
    "chunked_few_3000": (lambda b, s, r: chunked(b, s, r, few=True), 3000),
}
