"""Ulysses attention: all-to-all from sequence shards to head shards and back.

Paper: Jacobs et al., DeepSpeed Ulysses, arXiv:2309.14509.

``[B, S/P, H, D] -all_to_all-> [B, S, H/P, D]``: each device then attends over
the whole sequence for H/P heads, and a second all-to-all returns the output to
sequence shards. Balanced by construction (every device has the same work for
any mask). When ``Hkv`` is not a multiple of P, K/V heads are replicated just
enough (``P / gcd(Hkv, P)`` times) for every device to hold the K/V heads of its
query heads.

Pipelined along the sequence (:mod:`jax_seqpar.strategies.chunk_pipeline`: the keys
first, then the queries, each piece's transfer behind a kernel; the default where each
device holds enough tokens) or over head groups
(:mod:`jax_seqpar.strategies.head_pipeline`); ``overlap=False`` sends each exchange whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Literal

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.kernels.options import BlockSizes, KernelName, Options

import jax
import jax.numpy as jnp

from jax_seqpar.strategies.chunk_pipeline import chunk_pipeline
from jax_seqpar.strategies.head_pipeline import KernelStage, head_pipeline
from jax_seqpar.strategies.heads import (chunk_sizes, kv_replication, local_heads,
                                         resolve_pieces)
from jax_seqpar.strategies.inputs import (Metadata, Operands, axis_size, describe,
                                          gather_tokens, shard_operands)

__all__ = ["attend", "ulysses_attention"]


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, seq_axes: str | tuple[str, ...],
                      causal: bool = False, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, window: int | tuple[int, int] | None = None,
                      scale: float | None = None, kernel: KernelName = "auto",
                      block_sizes: BlockSizes | None = None, softcap: float | None = None,
                      sinks: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                      chunk_size: int | None = None, bidirectional_ids: jax.Array | None = None,
                      mask_fn: Callable | None = None, return_lse: bool = False,
                      overlap: bool | Literal["auto"] = "auto", chunks: int | Literal["auto"] = "auto",
                      head_groups: int | Literal["auto"] = "auto"):
    """Exact attention of a sequence sharded over ``seq_axes`` (call inside ``shard_map``).

    Args:
      q: ``[B, S/P, H, Dqk]``; k: ``[B, S/P, Hkv, Dqk]``; v: ``[B, S/P, Hkv, Dv]``
        this device's shard. ``H`` must be divisible by P.
      seq_axes: mesh axis (or tuple of axes) along which the sequence is split.
      causal, window, chunk_size, mask_fn, segment_ids, positions, bidirectional_ids,
        scale, kernel, block_sizes, softcap, sinks, kv_segment_ids, return_lse: as in
        :func:`jax_seqpar.strategies.ring.ring_attention` (``sinks`` replicated).
      overlap: ``"auto"`` (default) or True: the exchange pipelined behind the kernel,
        in ``chunks`` sequence pieces where the local length allows, else in
        ``head_groups`` head groups; False: each exchange whole, one kernel call
        (:func:`jax_seqpar.strategies.heads.resolve_pieces`).
      chunks: how many query pieces (:func:`jax_seqpar.strategies.heads.chunk_sizes`;
        :func:`jax_seqpar.strategies.heads.chunk_counts` lists what the local length
        allows); ``"auto"``: :func:`~jax_seqpar.strategies.heads.default_chunks` (5 at
        2048 tokens a device, 1 where the smallest piece would bring fewer than
        :data:`~jax_seqpar.strategies.heads.MIN_CHUNK_TOKENS` tokens).
        Chunks hide all but ``1/2^(chunks-1)`` of the bytes where collectives are
        asynchronous (GPU; TPU with the all-to-all option).
      head_groups: how many groups the ``H/P`` heads a device receives are pipelined in
        when the sequence is not chunked (see :mod:`jax_seqpar.strategies.head_pipeline`;
        :func:`jax_seqpar.strategies.heads.head_group_counts` lists the counts the heads
        allow). ``"auto"``: 1 with chunks, else the largest allowed count up to
        :data:`jax_seqpar.strategies.heads.MAX_AUTO_HEAD_GROUPS`.

    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype`` (softmax statistics in float32).

    >>> out = jax.shard_map(functools.partial(ulysses_attention, seq_axes="sp"),
    ...                     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
    """
    options, metadata = describe(
        q, k, v, causal=causal, window=window, chunk_size=chunk_size, mask_fn=mask_fn,
        scale=scale, kernel=kernel, block_sizes=block_sizes, softcap=softcap,
        return_lse=return_lse, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
        positions=positions, bidirectional_ids=bidirectional_ids, sinks=sinks)
    return attend(q, k, v, options, metadata, seq_axes=seq_axes, overlap=overlap, chunks=chunks,
                  head_groups=head_groups)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, options: Options, metadata: Metadata,
           *, seq_axes, overlap="auto", chunks="auto", head_groups="auto"):
    """Ulysses on described inputs (:func:`ulysses_attention` after its checks), the core the global
    view runs inside ``shard_map``: ``options`` and the local, checked ``metadata``
    (:func:`jax_seqpar.strategies.inputs.describe`)."""
    shard = shard_operands(q, metadata, seq_axes)
    size = axis_size(seq_axes)
    repeats = kv_replication(q.shape[2], k.shape[2], size)
    chunks, groups = resolve_pieces(overlap, chunks, head_groups, q.shape[2], k.shape[2], size,
                                    q.shape[1])
    if repeats > 1:
        # Replicated in float32: the replicas' gradients, on different devices, come back
        # and sum in float32 and round once (the pipeline sends K/V in q.dtype).
        k, v = (x.astype(jnp.float32).repeat(repeats, axis=2) for x in (k, v))
    q_tokens, kv_tokens = gather_tokens((shard.q_tokens, shard.kv_tokens), seq_axes)  # [B, S]
    operands = Operands(q_tokens, kv_tokens, local_heads(shard.sinks, seq_axes))
    if chunks > 1:
        return chunk_pipeline(seq_axes, options, q, k, v, operands,
                              sizes=chunk_sizes(q.shape[1], chunks),
                              return_lse=options.return_lse)
    return head_pipeline(seq_axes, KernelStage(options), q, k, v, operands,
                         groups=groups, return_lse=options.return_lse)
