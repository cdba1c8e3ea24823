"""Attention on the caller's devices, no sequence split: the one local path.

Every entry point that runs without a mesh (``sequence_parallel_attention(mesh=None)``,
``dot_product_attention`` without ``mesh=``, the Flax ``attention_fn`` with
``mesh=None``) comes here: the same kernels, masks and sinks as the strategies, on
whole arrays (the blockwise kernel, memory O(block), never the dense reference).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from jax_seqpar import kernels
from jax_seqpar.strategies.inputs import Call, check_ids, check_qkv, empty_result
from jax_seqpar.core import checks
from jax_seqpar.core.masks import Tokens
from jax_seqpar.core.merge import check_sinks, with_sinks


def _tokens(positions, segment_ids, bidirectional_ids) -> Tokens:
    """The metadata of a run of tokens (positions None: ``arange``, filled in staged)."""
    return Tokens(*(None if x is None else jnp.asarray(x)
                    for x in (positions, segment_ids, bidirectional_ids)))


def _positioned(tokens: Tokens, batch: int, length: int) -> Tokens:
    if tokens.positions is not None:
        return tokens
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return dataclasses.replace(tokens, positions=positions)


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    segment_ids: Optional[jax.Array] = None,
                    kv_segment_ids: Optional[jax.Array] = None,
                    positions: Optional[jax.Array] = None,
                    kv_positions: Optional[jax.Array] = None, window=None,
                    scale: Optional[float] = None, kernel: str = "auto", block_sizes=None,
                    softcap: Optional[float] = None, sinks: Optional[jax.Array] = None,
                    return_lse: bool = False, chunk_size: Optional[int] = None,
                    bidirectional_ids: Optional[jax.Array] = None,
                    kv_bidirectional_ids: Optional[jax.Array] = None, mask_fn=None):
    """Exact attention of ``q`` against ``k, v`` on whole arrays (queries and keys may
    differ in length).

    Args:
      q: ``[B, T, H, Dqk]``; k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` (one dtype).
      causal, window: the mask on token positions (see ``masks.MaskSpec``).
      segment_ids: ``int32[B, T]`` the queries' documents, or None.
      kv_segment_ids: ``int32[B, S]`` the keys' documents, or None (``segment_ids``
        when ``T == S``).
      positions: ``int32[B, T]`` the queries' positions (default ``arange(T)``);
        kv_positions: ``int32[B, S]`` the keys' (default ``arange(S)``).
      scale, kernel, block_sizes, softcap, sinks: as in
        :func:`jax_seqpar.sequence_parallel_attention`.
      return_lse: also return the ``float32[B, T, H]`` log-sum-exp (sinks included).
      chunk_size, mask_fn: as in :func:`jax_seqpar.sequence_parallel_attention`.
      bidirectional_ids: ``int32[B, T]`` the queries' bidirectional ids (needs
        ``causal``), or None; kv_bidirectional_ids: ``int32[B, S]`` the keys' (default
        ``bidirectional_ids`` when ``T == S``).

    Returns:
      ``[B, T, H, Dv]`` in ``q.dtype`` (softmax in float32); with ``return_lse``,
      ``(out, lse)``. A query that sees no key gets zeros.
    """
    check_qkv(q, k, v)
    call = Call.make(causal=causal, window=window, chunk_size=chunk_size, mask_fn=mask_fn,
                     scale=scale, kernel=kernel, block_sizes=block_sizes, softcap=softcap,
                     return_lse=return_lse)
    spec = call.spec
    batch, q_len, heads = q.shape[:3]
    kv_len = k.shape[1]
    if kv_segment_ids is None and segment_ids is not None:
        if q_len != kv_len:
            raise ValueError(f"segment_ids of {q_len} queries cannot serve {kv_len} keys; "
                             "pass kv_segment_ids= for the keys.")
        kv_segment_ids = segment_ids
    if segment_ids is None and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids needs segment_ids for the queries too (a query "
                         "sees a key when their segment ids are equal).")
    positions = check_ids("positions", positions, batch, q_len)
    segment_ids = check_ids("segment_ids", segment_ids, batch, q_len, segments=True)
    kv_positions = check_ids("kv_positions", kv_positions, batch, kv_len)
    kv_segment_ids = check_ids("kv_segment_ids", kv_segment_ids, batch, kv_len, segments=True)
    if kv_bidirectional_ids is None and bidirectional_ids is not None:
        if q_len != kv_len:
            raise ValueError(f"bidirectional_ids of {q_len} queries cannot serve {kv_len} keys; "
                             "pass kv_bidirectional_ids= for the keys.")
        kv_bidirectional_ids = bidirectional_ids
    if (bidirectional_ids is None) != (kv_bidirectional_ids is None):
        raise ValueError("kv_bidirectional_ids needs bidirectional_ids for the queries too (a "
                         "query and a key see each other both ways when their ids match).")
    bidirectional_ids = checks.bidirectional_ids(bidirectional_ids, batch, q_len, spec.causal)
    kv_bidirectional_ids = checks.bidirectional_ids(kv_bidirectional_ids, batch, kv_len,
                                                    spec.causal, name="kv_bidirectional_ids")
    checks.mask_fn(spec, batch, q_len, kv_len)
    sinks = check_sinks(sinks, heads)
    if not (batch and q_len and kv_len):  # nothing to attend: jax.nn's empty result
        out, lse = empty_result(q, v, True)
        lse = with_sinks(out, lse, sinks)[1]
        return (out, lse) if call.return_lse else out
    call.options(q)  # refuses a bad kernel or tile sizes here, not in the program
    dynamic = (_tokens(positions, segment_ids, bidirectional_ids),
               _tokens(kv_positions, kv_segment_ids, kv_bidirectional_ids),
               None if sinks is None else jnp.asarray(sinks))
    out, lse = _staged(q, k, v, dynamic, call=call)
    return (out, lse) if call.return_lse else out


# One program per signature: called eagerly, the kernel's scan and its closures would
# otherwise be traced and compiled anew on every call.
@functools.partial(jax.jit, static_argnames="call")
def _staged(q, k, v, dynamic, *, call: Call):
    """``(out, lse)`` of ``call`` on whole arrays; ``dynamic``: ``(q_tokens, kv_tokens,
    sinks)``."""
    q_tokens, kv_tokens, sinks = dynamic
    dynamic = (_positioned(q_tokens, *q.shape[:2]), _positioned(kv_tokens, *k.shape[:2]), sinks)
    options = call.options(q)

    def attend(q, k, v, dynamic):
        q_tokens, kv_tokens, sinks = dynamic
        out, lse = options.attention(q, k, v, q_tokens, kv_tokens)  # f32 [B, T, H, Dv], [B, T, H]
        out, lse = with_sinks(out, lse, sinks)
        return out.astype(q.dtype), lse

    return _per_shard(attend, call, q, k, v, dynamic)


def _per_shard(attend, call: Call, q, k, v, dynamic):
    """``attend(q, k, v, dynamic)`` on arrays typed with an Explicit sharding (``dynamic``:
    ``(q_tokens, kv_tokens, sinks)``): each device attends its own batch rows and heads
    (``shard_map`` over q's batch and head axes; the sequence gathered whole), and the
    output keeps q's sharding, as ``jax.nn`` gives it. Unsharded or Auto-mesh arrays are
    attended as they are."""
    sharding = getattr(jax.typeof(q), "sharding", None)
    spec = tuple(getattr(sharding, "spec", None) or ())
    mesh = getattr(sharding, "mesh", None)
    if not any(spec) or not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return attend(q, k, v, dynamic)
    spec = (spec + (None,) * 4)[:4]
    batch_entry, head_entry = spec[0], spec[2]
    kv_spec = [tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ())
               for x in (k, v)]
    if head_entry is not None and any((s + (None,) * 3)[2] != head_entry for s in kv_spec):
        head_entry = None  # q's head split alone would pair local heads with wrong K/V heads
    qkv, ids = P(batch_entry, None, head_entry, None), P(batch_entry, None)
    dynamic_specs = (*(jax.tree.map(lambda _: ids, t) for t in dynamic[:2]), P(head_entry))
    placed = [jax.reshard(x, qkv) for x in (q, k, v)]
    q_tokens, kv_tokens, sinks = dynamic
    placed.append((*(jax.tree.map(lambda x: jax.reshard(x, ids), t) for t in (q_tokens, kv_tokens)),
                   None if sinks is None else jax.reshard(sinks, P(head_entry))))
    out, lse = jax.shard_map(
        attend, mesh=mesh, in_specs=(qkv,) * 3 + (dynamic_specs,),
        out_specs=(qkv, P(batch_entry, None, head_entry)),
        check_vma=not kernels.may_interpret(call.kernel))(*placed)
    return jax.reshard(out, P(*spec[:3], None)), jax.reshard(lse, P(*spec[:3]))
