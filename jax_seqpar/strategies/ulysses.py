"""Ulysses attention: all-to-all from sequence shards to head shards and back.

Paper: Jacobs et al., DeepSpeed Ulysses, arXiv:2309.14509.

``[B, S/P, H, D] -all_to_all-> [B, S, H/P, D]``: each device then attends over
the whole sequence for H/P heads, and a second all-to-all returns the output to
sequence shards. Balanced by construction (every device has the same work for
any mask). When ``Hkv`` is not a multiple of P, K/V heads are replicated just
enough (``P / gcd(Hkv, P)`` times) for every device to hold the K/V heads of its
query heads.

Pipelined over head groups (:mod:`jax_seqpar.strategies.head_pipeline`): the
exchange of one group travels while the kernel works on another.
"""

from __future__ import annotations

from jax_seqpar.strategies.head_pipeline import KernelStage, head_pipeline
from jax_seqpar.strategies.heads import kv_replication, local_heads, resolve_head_groups
from jax_seqpar.strategies.inputs import axis_size, gather_tokens, prepare


def ulysses_attention(q, k, v, *, seq_axes, causal=False, segment_ids=None, positions=None,
                      window=None, scale=None, kernel="auto", block_sizes=None, softcap=None,
                      sinks=None, kv_segment_ids=None, return_lse=False, head_groups="auto"):
    """Exact attention of a sequence sharded over ``seq_axes`` (call inside ``shard_map``).

    Args:
      q: ``[B, S/P, H, Dqk]``; k: ``[B, S/P, Hkv, Dqk]``; v: ``[B, S/P, Hkv, Dv]``
        this device's shard. ``H`` must be divisible by P.
      seq_axes: mesh axis (or tuple of axes) along which the sequence is split.
      causal, window, segment_ids, positions, scale, kernel, block_sizes, softcap,
        sinks, kv_segment_ids, return_lse: as in :func:`jax_seqpar.strategies.ring.ring_attention`
        (``sinks`` replicated).
      head_groups: how many groups the ``H/P`` heads a device receives are pipelined in (see
        :mod:`jax_seqpar.strategies.head_pipeline`;
        :func:`jax_seqpar.strategies.heads.head_group_counts` lists the counts the heads
        allow). ``"auto"`` (default): the largest allowed count up to
        :data:`jax_seqpar.strategies.heads.MAX_AUTO_HEAD_GROUPS`. Groups hide exchanges
        behind the kernel where collectives are asynchronous (GPU; TPU with the all-to-all
        option); their cost is the buffers in flight while a kernel runs (B=1, S=16384,
        H=16, Hkv=4, D=128, bf16, causal, 8 devices, forward + backward temp per device,
        1 -> 2 groups: h100:8 44.1 -> 48.2 MiB, v5p:2x2x2 41.2 -> 58.4 MiB). ``1``: one
        all-to-all each of q, k, v and out, nothing pipelined.

    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype`` (softmax statistics in float32).

    >>> out = jax.shard_map(functools.partial(ulysses_attention, seq_axes="sp"),
    ...                     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
    """
    q_tokens, kv_tokens, options = prepare(
        q, k, v, axis_name=seq_axes, causal=causal, segment_ids=segment_ids,
        positions=positions, window=window, scale=scale, kernel=kernel,
        block_sizes=block_sizes, softcap=softcap, sinks=sinks, kv_segment_ids=kv_segment_ids)
    size = axis_size(seq_axes)
    repeats = kv_replication(q.shape[2], k.shape[2], size)
    groups = resolve_head_groups(head_groups, q.shape[2], k.shape[2], size)
    if repeats > 1:
        k, v = (x.repeat(repeats, axis=2) for x in (k, v))  # [B, S/P, Hkv*r, D]
    q_tokens, kv_tokens = gather_tokens((q_tokens, kv_tokens), seq_axes)  # [B, S]
    return head_pipeline(seq_axes, KernelStage(options), q, k, v, q_tokens, kv_tokens,
                         groups=groups, sinks=local_heads(sinks, seq_axes),
                         return_lse=return_lse)
