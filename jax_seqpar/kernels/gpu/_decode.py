"""Decode-sized calls of the Triton kernels (:mod:`.pallas`, :mod:`._bwd`): a GQA/MQA
group's few queries folded into the rows of one program per kv head (:func:`folds_group`,
:func:`fold`, :func:`unfold`), and split-K over the cache for calls too small to fill the
GPU (:func:`kv_splits`, :func:`split_kv`, :func:`merge_splits`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_seqpar.core import masks
from jax_seqpar.core.masks import Tokens
from jax_seqpar.kernels.gpu._core import MIN_DIM
from jax_seqpar.kernels.tiling import Tiling, pad_seq, padded_tokens

def folds_group(q_len: int, heads: int, kv_heads: int) -> bool:
    """Decode-sized queries (fewer than a 16-row tile) of a GQA/MQA group are folded
    into one row block per kv head: each K/V tile is read once for the whole group
    and a tile's rows are the group's heads, not 15 padding rows per head."""
    return q_len < MIN_DIM and heads > kv_heads


def fold(x, kv_heads: int):
    """``[B, Sq, Hkv * G, ...] -> [B, Sq * G, Hkv, ...]`` (rows ordered (token, head))."""
    b, s, h = x.shape[:3]
    x = x.reshape(b, s, kv_heads, h // kv_heads, *x.shape[3:])
    return jnp.swapaxes(x, 2, 3).reshape(b, s * (h // kv_heads), kv_heads, *x.shape[4:])


def unfold(x, group: int):
    """Inverse of :func:`fold`: ``[B, Sq * G, Hkv, ...] -> [B, Sq, Hkv * G, ...]``."""
    b, rows, kv_heads = x.shape[:3]
    x = x.reshape(b, rows // group, group, kv_heads, *x.shape[3:])
    return jnp.swapaxes(x, 2, 3).reshape(b, rows // group, kv_heads * group, *x.shape[4:])


def fold_tokens(tokens: Tokens, group: int) -> Tokens:
    """Each query token's metadata repeated for the ``group`` heads folded into rows."""
    return jax.tree.map(lambda x: jnp.repeat(x, group, axis=1), tokens)


#: Programs a call should launch to fill a GPU (132 SMs on H100, 108 on A100).
FILL_PROGRAMS = 128
#: Fewest keys one split of a decode call's cache gets.
MIN_SPLIT_KEYS = 256


def kv_splits(programs: int, num_q: int, kv_len: int, block_k: int) -> int:
    """Runs a short call's keys are split into (split-K, "flash decoding").

    A call with one query tile per (batch, head) launches ``programs`` programs,
    e.g. 8 for a decode step of one sequence with 8 K/V heads: a few SMs stream the
    whole cache. Doubling the splits while the programs stay under
    :data:`FILL_PROGRAMS` and every split keeps :data:`MIN_SPLIT_KEYS` keys (and a
    tile) gives each program its own run of the cache; the partial results are
    merged by :func:`merge_splits`. 1: the call already fills the GPU.
    """
    splits = 1
    while (num_q == 1 and programs * splits * 2 <= FILL_PROGRAMS
           and kv_len // (splits * 2) >= max(MIN_SPLIT_KEYS, block_k)):
        splits *= 2
    return splits


def split_kv(splits: int, q, k, v, q_tokens: Tokens, kv_tokens: Tokens, t: Tiling):
    """Each batch row's keys cut into ``splits`` equal runs (the last padded), each run
    a batch row of its own, the queries repeated for each: ``k [B, Sk, Hkv, D] ->
    [B * splits, Sk / splits, Hkv, D]``, ``q [B, Sq, H, D] -> [B * splits, Sq, H, D]``
    (rows ordered (batch, split), a free reshape of the cache)."""
    run = -(-t.kv_len // splits)
    q_tokens, kv_tokens = padded_tokens(
        dataclasses.replace(t, block_q=t.q_len, block_k=run), q_tokens, kv_tokens)

    def by_run(x):  # [B, Sk, ...] -> [B * splits, run, ...]
        x = pad_seq(x, splits * run)
        return x.reshape(x.shape[0] * splits, run, *x.shape[2:])

    def repeated(x):
        return jnp.repeat(x, splits, axis=0)

    return (repeated(q), by_run(k), by_run(v), jax.tree.map(repeated, q_tokens),
            jax.tree.map(by_run, kv_tokens))


def merge_splits(splits: int, out, lse, *high):
    """Softmax-merge the partial results of :func:`split_kv`'s runs:
    ``out f32[B * splits, Sq, H, Dv], lse f32[B * splits, Sq, H] -> [B, ...]``.
    A row no run sees keeps zeros and ``EMPTY_LSE``. ``high``: the runs' max logits
    ``f32[B * splits, Sq, H]`` (``options.return_max_logit``), merged by ``maximum``."""
    out = out.reshape(-1, splits, *out.shape[1:])
    lse = lse.reshape(-1, splits, *lse.shape[1:])
    top = lse.max(axis=1)
    weights = jnp.exp(lse - top[:, None])  # [B, splits, Sq, H]
    total = weights.sum(axis=1)
    out = jnp.einsum("bnqh,bnqhd->bqhd", weights, out) / total[..., None]
    seen = top > masks.EMPTY_LSE / 2
    return (out, jnp.where(seen, top + jnp.log(total), masks.EMPTY_LSE),
            *(x.reshape(-1, splits, *x.shape[1:]).max(axis=1) for x in high))
