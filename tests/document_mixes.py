"""Document mixes that stress the per-document order's balance bound: a test helper.

Each returns ``int32[B, S]`` segment ids packed like :mod:`jax_seqpar.tools.mixes`' (the
bench's mixes, which these extend): ``(batch, seq_len, rng) -> ids``; padding is
:data:`jax_seqpar.core.masks.PAD_SEGMENT`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jax_seqpar.core.masks import PAD_SEGMENT
from jax_seqpar.tools.mixes import draw, heavy_tailed, one_long, uniform_short

__all__ = ["ADVERSARIAL", "with_padding"]


def with_padding(mix: Callable, batch: int, seq_len: int, rng: np.random.Generator,
                 max_fraction: float = 0.5):
    """``mix`` with a random tail of each row (up to ``max_fraction``) made padding."""
    ids = mix(batch, seq_len, rng)
    for row in ids:
        row[seq_len - int(rng.integers(0, int(max_fraction * seq_len) + 1)):] = PAD_SEGMENT
    return ids


def _lognormal(batch, seq_len, rng):
    return draw(lambda r, n: np.ceil(r.lognormal(np.log(512.0), 1.5, n)), batch, seq_len, rng)


def _constant(length):
    return lambda batch, seq_len, rng=None: draw(lambda r, n: np.full(n, length), batch,
                                                 seq_len, rng)


def _sqrt_worst(batch, seq_len, rng=None):
    """One document of ~sqrt(2S) tokens among singletons (the merge's worst case)."""
    big = int(np.sqrt(2 * seq_len))
    return draw(lambda r, n: np.r_[big, np.ones(n - 1)], batch, seq_len, rng)


def _geometric(batch, seq_len, rng=None):
    sizes = 2 ** np.arange(int(np.log2(seq_len)))
    return draw(lambda r, n: np.resize(sizes, n), batch, seq_len, rng)


_PRIMES = np.array([17, 19, 23, 101, 251, 509, 1021, 2039, 4093, 8191])

#: Mixes that stress the per-document layout's bound. Every document one token, all
#: shorter than 2P (for P <= 8), lengths no shard count divides, heavy tails, two
#: large documents, every scale at once, just below a dealt document's length, padding.
ADVERSARIAL = {
    "one_doc": one_long,
    "all_ones": _constant(1),
    "shorter_than_2P": lambda b, s, r: draw(lambda g, n: g.integers(1, 16, n), b, s, r),
    "primes": lambda b, s, r: draw(lambda g, n: g.choice(_PRIMES, n), b, s, r),
    "lognormal": _lognormal,
    "pareto_1.3": heavy_tailed,
    "pareto_1.1": lambda b, s, r: heavy_tailed(b, s, r, alpha=1.1),
    "sqrt_worst": _sqrt_worst,
    "two_big": lambda b, s, r: draw(lambda g, n: g.integers(s // 8, s, n), b, s, r),
    "geometric": _geometric,
    "below_2Pc": _constant(2 * 8 * 128 - 1),
    "uniform_short": uniform_short,
    "padded_pareto": lambda b, s, r: with_padding(heavy_tailed, b, s, r),
    "padded_one_doc": lambda b, s, r: with_padding(one_long, b, s, r),
    "padded_short": lambda b, s, r: with_padding(
        lambda b2, s2, r2: draw(lambda g, n: g.integers(1, 16, n), b2, s2, r2), b, s, r, 0.9),
}
