"""Validation of attention inputs and the per-shard token metadata every strategy uses.

The argument checks themselves are :mod:`jax_seqpar.core.checks` (ids, positions,
lengths, flags, numbers) and :func:`jax_seqpar.core.masks.normalize_window`; every
entry point, global or per shard, reaches them through the functions here.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from jax_seqpar.core import checks, layout, masks
from jax_seqpar.kernels.contract import Options, check_softcap


def check_qkv(q, k, v) -> None:
    """Raise ``ValueError`` unless q, k, v form a valid ``[B, S, H, D]`` triple."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim]. "
                             f"Got {name}.shape={x.shape}.")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must share the batch size. Got {q.shape=}, {k.shape=}, "
                         f"{v.shape=}.")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [batch, seq, kv_heads]. Got {k.shape=}, "
                         f"{v.shape=}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share head_dim. Got q head_dim={q.shape[3]}, "
                         f"k head_dim={k.shape[3]}.")
    if not q.dtype == k.dtype == v.dtype or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one floating dtype (as jax.nn.dot_product_attention "
                         f"requires). Got q.dtype={q.dtype}, k.dtype={k.dtype}, "
                         f"v.dtype={v.dtype}; cast them to one dtype first.")
    heads, kv_heads = q.shape[2], k.shape[2]
    if not heads or not kv_heads or not q.shape[3] or not v.shape[3]:
        raise ValueError(f"q, k, v need at least one head and a head_dim of at least 1. Got "
                         f"{q.shape=}, {k.shape=}, {v.shape=}.")
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads} "
                         "(MHA, GQA or MQA).")


def check_self_attention(q, k, v, segment_ids):
    """:func:`check_qkv` plus one sequence length for q and k; returns ``segment_ids``
    as ``int32[B, S]`` (:func:`check_ids`)."""
    check_qkv(q, k, v)
    batch, seq_len = q.shape[:2]
    if k.shape[1] != seq_len:
        raise ValueError(f"self-attention needs q and k of one sequence length. "
                         f"Got q seq={seq_len}, k seq={k.shape[1]}.")
    return check_ids("segment_ids", segment_ids, batch, seq_len, segments=True)


def check_ids(name: str, ids, batch: int, seq: int, *, segments: bool = False):
    """``ids`` as ``int32[batch, seq]`` (or None): integers of that shape that fit int32,
    and for ``segments`` not the reserved padding id (:mod:`jax_seqpar.core.checks`);
    ``ValueError`` otherwise."""
    check = checks.segment_ids if segments else checks.positions
    return check(name, ids, batch, seq)


def empty_result(q, v, return_lse: bool):
    """The result of a call with no query or no key (a zero-size dim): zeros of
    ``[B, T, H, Dv]`` in ``q.dtype`` (a query that sees no key gets zeros), and with
    ``return_lse`` the ``float32[B, T, H]`` lse of rows that saw nothing."""
    out = jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    if not return_lse:
        return out
    return out, jnp.full(q.shape[:3], masks.EMPTY_LSE, jnp.float32)


def check_options(*, causal, window, scale, softcap) -> None:
    """Raise ``ValueError`` for a bad ``causal`` (a bool), ``window`` (non-negative
    ints), ``scale`` (a finite number) or ``softcap`` (a positive number): before any
    array work, at the public boundary (:meth:`Options.make` reads them again)."""
    checks.flag("causal", causal)
    masks.normalize_window(window)
    checks.scale(scale)
    check_softcap(softcap)


def shard_tokens(q, *, axis_name, segment_ids=None, positions=None,
                 bidirectional_ids=None) -> masks.Tokens:
    """Metadata of this shard's tokens; positions default to the contiguous split.

    Args:
      q: the local ``[B, S_local, H, D]`` queries (for shapes).
      axis_name: the mesh axis (or tuple of axes) the sequence is split over.
      segment_ids, positions, bidirectional_ids: ``int32[B, S_local]`` or None
        (``bidirectional_ids`` already checked: :func:`jax_seqpar.core.checks.bidirectional_ids`).
    """
    batch, local_len = q.shape[:2]
    segment_ids = check_ids("segment_ids", segment_ids, batch, local_len, segments=True)
    positions = check_ids("positions", positions, batch, local_len)
    if positions is None:
        positions = layout.shard_positions("contiguous", local_len, axis_name=axis_name)
        positions = jnp.broadcast_to(positions, (batch, local_len)).astype(jnp.int32)
    return masks.Tokens(jnp.asarray(positions),
                        None if segment_ids is None else jnp.asarray(segment_ids),
                        None if bidirectional_ids is None else jnp.asarray(bidirectional_ids))


def axis_size(axis_name) -> int:
    """Number of shards along ``axis_name`` (a name or a tuple of names)."""
    return jax.lax.axis_size(axis_name)


def prepare(q, k, v, *, axis_name, causal, segment_ids, positions, window, scale, kernel,
            block_sizes, softcap=None, sinks=None, kv_segment_ids=None, chunk_size=None,
            bidirectional_ids=None, mask_fn=None):
    """The common prologue of every per-shard strategy: validate, then build metadata.

    ``sinks`` (``[H]`` float, or None) is only validated here; strategies fold it
    into their merged result with :func:`jax_seqpar.core.merge.with_sinks`.

    Returns:
      ``(q_tokens, kv_tokens, options)``: this shard's query and key/value
      :class:`~jax_seqpar.core.masks.Tokens` (the same positions; the keys' segment ids
      are ``kv_segment_ids`` when given) and the call's static :class:`Options`.
    """
    from jax_seqpar.core.merge import check_sinks

    check_qkv(q, k, v)
    check_sinks(sinks, q.shape[2])
    check_options(causal=causal, window=window, scale=scale, softcap=softcap)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"sequence-parallel attention splits ONE sequence, so every shard holds as many "
            f"query as key/value tokens. Got {q.shape[1]} local query tokens and {k.shape[1]} "
            "local key/value tokens: shard q, k and v along the same split of the same "
            "sequence (for attention to another sequence, run "
            "jax_seqpar.dot_product_attention without a mesh).")
    spec = masks.MaskSpec.make(checks.flag("causal", causal), window, chunk_size, mask_fn)
    bidirectional_ids = checks.bidirectional_ids(bidirectional_ids, *q.shape[:2], spec.causal)
    checks.mask_fn(spec, q.shape[0], q.shape[1], k.shape[1])
    q_tokens = shard_tokens(q, axis_name=axis_name, segment_ids=segment_ids, positions=positions,
                            bidirectional_ids=bidirectional_ids)
    kv_tokens = q_tokens
    if kv_segment_ids is not None:
        if segment_ids is None:
            raise ValueError("kv_segment_ids needs segment_ids for the queries too (a query "
                             "sees a key when their segment ids are equal).")
        kv_segment_ids = check_ids("kv_segment_ids", kv_segment_ids, *q.shape[:2],
                                   segments=True)
        kv_tokens = masks.Tokens(q_tokens.positions, jnp.asarray(kv_segment_ids),
                                 q_tokens.bidirectional_ids)
    options = Options.make(q, spec, scale=scale, kernel=kernel, block_sizes=block_sizes, softcap=softcap)
    return q_tokens, kv_tokens, options


def gather_tokens(tokens, axis_name):
    """``[B, S/P]`` metadata of the local tokens (a :class:`~jax_seqpar.core.masks.Tokens` or a
    tree of them) -> ``[B, S]`` of the whole sequence; an array that appears more than
    once (query and key positions) is gathered once."""
    gathered = {}

    def gather(x):
        if id(x) not in gathered:
            gathered[id(x)] = jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
        return gathered[id(x)]

    return jax.tree.map(gather, tokens)
