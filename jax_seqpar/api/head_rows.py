"""A per-head key mask as batch rows: each query head attends as a batch row of its own.

:func:`jax_seqpar.dot_product_attention` takes ``jax.nn``'s per-head key-padding masks
(``[B|1, N, 1, S]``); the strategies take one mask for all heads, so the heads are folded
into the batch (key/value heads repeated to the query heads they serve), attended, and
unfolded, keeping Explicit shardings of the batch and head dims.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_seqpar.core import masks
from jax_seqpar.strategies.inputs import Operands

__all__ = ["per_head"]


def _entries(x) -> tuple:
    """The PartitionSpec entry of each dim of ``x``'s type (all None off Explicit meshes)."""
    spec = tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ())
    return (spec + (None,) * x.ndim)[:x.ndim]


def _reshape(x, shape: tuple, spec: tuple):
    """``x.reshape(shape)``, sharded ``spec`` where ``x``'s type is sharded (an Explicit
    reshape that merges or splits sharded dims must name its result's sharding)."""
    if all(e is None for e in _entries(x)):
        return x.reshape(shape)
    return jax.lax.reshape(x, shape, out_sharding=jax.typeof(x).sharding.update(spec=P(*spec)))


def _joined(*entries):
    """One PartitionSpec entry sharding a merged dim over the axes of ``entries`` in order."""
    names = tuple(name for entry in entries if entry is not None
                  for name in (entry if isinstance(entry, tuple) else (entry,)))
    return None if not names else names[0] if len(names) == 1 else names


def _fold_heads(x, groups: int):
    """``[B, L, K, D] -> [B*N, L, 1, D]`` (``N = K * groups``): every head a batch row of its
    own, key/value heads repeated to the query head they serve."""
    x = jnp.repeat(x, groups, axis=2) if groups > 1 else x  # [B, L, N, D]
    batch, length, heads, dim = x.shape
    batch_entry, seq_entry, head_entry, _ = _entries(x)
    x = _reshape(jnp.moveaxis(x, 2, 1), (batch * heads, length, dim),
                 (_joined(batch_entry, head_entry), seq_entry, None))  # [B*N, L, D]
    return x[:, :, None]


def _unfold_heads(x, query):
    """``[B*N, T, 1, ...] -> [B, T, N, ...]`` sharded like ``query``: the inverse of
    :func:`_fold_heads` on a result."""
    batch, _, heads = query.shape[:3]
    batch_entry, seq_entry, head_entry = _entries(query)[:3]
    x = x[:, :, 0]  # [B*N, T, ...]
    rest = (None,) * (x.ndim - 2)
    x = _reshape(x, (batch, heads) + x.shape[1:], (batch_entry, head_entry, seq_entry) + rest)
    return jnp.moveaxis(x, 1, 2)  # [B, T, N, ...]



def per_head(attend: Callable, query: jax.Array, key: jax.Array, value: jax.Array,
             q_tokens: masks.Tokens, kv_segments: jax.Array):
    """``attend`` with per-head key segments ``int32[B, N, S]``: each head a batch row.

    ``attend(q, k, v, operands, return_lse)``: the call on ``[B*N, L, 1, D]`` rows
    (:class:`~jax_seqpar.strategies.inputs.Operands`; the keys' bidirectional ids left
    None: the queries'). ``q_tokens``: the queries' ``[B, T]`` segment and bidirectional
    ids (positions None). Returns ``(out [B, T, N, Hv] in query.dtype, lse float32[B, T, N])``, no
    sinks (they are per head: the caller folds them in).
    """
    batch, _, heads = query.shape[:3]
    groups = heads // key.shape[2]
    folded = [_fold_heads(x, g) for x, g in ((query, 1), (key, groups), (value, groups))]
    batch_entry, head_entry, seq_entry = _entries(kv_segments)
    kv_segments = _reshape(kv_segments, (batch * heads, kv_segments.shape[2]),
                           (_joined(batch_entry, head_entry), seq_entry))  # [B*N, S]
    per_row = jax.tree.map(lambda ids: jnp.repeat(ids, heads, axis=0), q_tokens)  # [B*N, T]
    operands = Operands(per_row, masks.Tokens(None, kv_segments))
    out, lse = attend(*folded, operands, True)  # [B*N, T, 1, Hv], float32 [B*N, T, 1]
    out = _unfold_heads(out, query)  # [B, T, N, Hv]
    return out, _unfold_heads(lse[..., None], query)[..., 0]  # float32 [B, T, N]
