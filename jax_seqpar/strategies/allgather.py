"""All-gather attention: every device gathers the whole K/V and attends with its queries.

Megatron-LM's ``all_gather`` context parallelism; Llama 3 (arXiv:2407.21783) uses
it for long-context training. Simple and low-latency, but K/V memory is O(S) per
device and the gather cannot hide behind compute. The backward is autodiff: the
all-gather transposes to a reduce-scatter of dK/dV. With zigzag positions the
causal work is balanced. With a window on the contiguous split (default
positions) only what the window reaches is gathered (:func:`jax_seqpar.strategies.halo.gather_window`).
"""

from __future__ import annotations

import jax

from jax_seqpar.strategies import halo
from jax_seqpar.strategies.inputs import axis_size, prepare
from jax_seqpar.core.merge import with_sinks
from jax_seqpar.strategies.ulysses import gather_tokens


def allgather_attention(q, k, v, *, seq_axes, causal=False, segment_ids=None, positions=None,
                        window=None, scale=None, kernel="auto", block_sizes=None, softcap=None,
                        sinks=None, kv_segment_ids=None, return_lse=False):
    """Exact attention of a sequence sharded over ``seq_axes`` (call inside ``shard_map``).

    Args:
      q: ``[B, S/P, H, Dqk]``; k: ``[B, S/P, Hkv, Dqk]``; v: ``[B, S/P, Hkv, Dv]``.
      seq_axes, causal, window, segment_ids, positions, scale, kernel,
        block_sizes, softcap, sinks, kv_segment_ids, return_lse: as in
        :func:`jax_seqpar.strategies.ring.ring_attention`.

    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype``.

    >>> out = jax.shard_map(functools.partial(allgather_attention, seq_axes="sp"),
    ...                     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
    """
    q_tokens, kv_tokens, options = prepare(
        q, k, v, axis_name=seq_axes, causal=causal, segment_ids=segment_ids,
        positions=positions, window=window, scale=scale, kernel=kernel,
        block_sizes=block_sizes, softcap=softcap, sinks=sinks, kv_segment_ids=kv_segment_ids)
    reach = None
    if positions is None:
        reach = halo.halo_sizes(options.spec, q.shape[1], axis_size(seq_axes))
    if reach is None:
        k, v = (jax.lax.all_gather(x, seq_axes, axis=1, tiled=True)
                for x in (k, v))  # [B, S, Hkv, D]
        kv_tokens = gather_tokens(kv_tokens, seq_axes)
    else:
        k, v, kv_tokens = halo.gather_window(seq_axes, reach, k, v, kv_tokens)  # [B, W+S/P, ..]
    out, lse = with_sinks(*options.attention(q, k, v, q_tokens, kv_tokens), sinks)
    return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)  # [B, S/P, H, Dv]
