"""Tile geometry and sequence padding shared by the kernels."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_seqpar.core import blocks, masks
from jax_seqpar.core.masks import PAD_SEGMENT, MaskSpec, Tokens

__all__ = ["Tiling", "any_visible", "loaded", "pad_seq", "padded_tokens", "per_field",
           "schedule"]


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static geometry of one kernel call: sizes, tile sizes and tile counts."""

    batch: int
    kv_heads: int
    group: int
    q_len: int
    kv_len: int
    block_q: int
    block_k: int

    @property
    def num_q(self):
        return -(-self.q_len // self.block_q)

    @property
    def num_k(self):
        return -(-self.kv_len // self.block_k)


def pad_seq(x: jax.Array, length: int, value: float = 0, *, dim: int | None = None):
    """Pad axis 1 (the sequence) of ``x`` to ``length`` with ``value`` (and, with
    ``dim``, zero-pad the last axis to ``dim``); ``x`` itself when nothing is padded."""
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    if dim is not None:
        widths[-1] = (0, dim - x.shape[-1])
    if all(w == (0, 0) for w in widths):
        return x
    return jnp.pad(x, widths, constant_values=value)


def per_field(tokens: Tokens, value: object) -> Tokens:
    """A Tokens holding ``value`` in every field ``tokens`` has (None elsewhere): e.g. one
    BlockSpec per metadata array of a Pallas call."""
    return Tokens(*(None if getattr(tokens, f.name) is None else value
                    for f in dataclasses.fields(Tokens)))


# Any: a ref index is an int, a slice, ``pl.ds(...)`` or a tuple of them, for which
# JAX exports no one type (``...``, the default, takes the whole ref).
def loaded(tokens: Tokens, index: Any = ...) -> Tokens:
    """The values at ``index`` (an int, slice or ``pl.ds``; the whole ref by default)
    of a Tokens-of-refs (inside a Pallas kernel): positions, segment ids and
    bidirectional ids alike."""
    return Tokens(*(None if ref is None else ref[index]
                    for ref in (getattr(tokens, f.name) for f in dataclasses.fields(Tokens))))


def padded_tokens(t: Tiling, q_tokens: Tokens, kv_tokens: Tokens):
    """Pad metadata to whole tiles; padded tokens are padding (:data:`~jax_seqpar.core.masks.PAD_SEGMENT`), which
    sees nothing and is left out of the tile summaries."""
    q_pad, kv_pad = t.num_q * t.block_q, t.num_k * t.block_k
    if (q_pad, kv_pad) == (t.q_len, t.kv_len):
        return q_tokens, kv_tokens

    def pad(tokens, length):
        seg = tokens.segment_ids
        if seg is None:
            seg = jnp.zeros(tokens.positions.shape, jnp.int32)
        bid = tokens.bidirectional_ids
        return Tokens(pad_seq(tokens.positions, length), pad_seq(seg, length, PAD_SEGMENT),
                      None if bid is None else pad_seq(bid, length))

    return pad(q_tokens, q_pad), pad(kv_tokens, kv_pad)


def schedule(spec: MaskSpec, t: Tiling, q_tokens: Tokens, kv_tokens: Tokens):
    """Tokens padded to whole tiles, and the tile classes ``int8[B, nq, nk]``
    (``EMPTY`` / ``PARTIAL`` / ``FULL``, per batch row) every kernel skips and masks by."""
    q_tokens, kv_tokens = padded_tokens(t, q_tokens, kv_tokens)
    classes = blocks.classify(spec, blocks.summarize(q_tokens, t.block_q, per_row=True),
                             blocks.summarize(kv_tokens, t.block_k, per_row=True))
    return q_tokens, kv_tokens, classes


#: Tokens per tile of :func:`any_visible`'s test: any size is exact, finer tiles find
#: more calls with nothing to compute.
CALL_TEST_BLOCK = 128


def any_visible(spec: MaskSpec, q_tokens: Tokens, kv_tokens: Tokens,
                block: int = CALL_TEST_BLOCK):
    """``bool[]`` (traced): may any query of ``q_tokens [B, Sq]`` see any key of
    ``kv_tokens [B, Sk]``? False only when every tile pair of every batch row is
    ``EMPTY`` (e.g. a ring step whose queries and keys share no document), so a kernel
    call on them can be skipped whole."""
    batch, q_len = q_tokens.positions.shape
    kv_len = kv_tokens.positions.shape[1]
    t = Tiling(batch, 1, 1, q_len, kv_len, min(block, q_len), min(block, kv_len))
    return (schedule(spec, t, q_tokens, kv_tokens)[2] != blocks.EMPTY).any()
