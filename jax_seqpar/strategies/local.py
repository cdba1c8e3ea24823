"""Attention on the caller's devices, no sequence split: the one local path.

Every entry point that runs without a mesh (``sequence_parallel_attention(mesh=None)``,
``dot_product_attention`` without ``mesh=``, the Flax ``attention_fn`` with
``mesh=None``) comes here: the same kernels, masks and sinks as the strategies, on
whole arrays (the blockwise kernel, memory O(block), never the dense reference).
"""

from __future__ import annotations

import dataclasses
import functools
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from jax_seqpar import kernels
from jax_seqpar.strategies.inputs import Call, Operands, check_ids, check_qkv, empty_result
from jax_seqpar.core import checks
from jax_seqpar.core.masks import Tokens
from jax_seqpar.core.merge import check_sinks, with_sinks

__all__ = ["local_attention"]


def _positioned(tokens: Tokens, batch: int, length: int) -> Tokens:
    if tokens.positions is not None:
        return tokens
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return dataclasses.replace(tokens, positions=positions)


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, call: Call,
                    operands: Operands):
    """Exact attention of ``q`` against ``k, v`` on whole arrays (queries and keys may
    differ in length).

    Args:
      q: ``[B, T, H, Dqk]``; k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` (one dtype).
      call: the static call (:meth:`~jax_seqpar.strategies.inputs.Call.make`: mask, scale, kernel, tiles, softcap,
        return_lse); its global-view fields are unused.
      operands: ``q_tokens``: the queries' ``int32[B, T]`` fields, ``kv_tokens``: the
        keys' ``int32[B, S]`` fields (either may be None: no field given); ``sinks``:
        ``[H]`` or None. Positions left None are ``arange`` of their length; the keys'
        segment and bidirectional ids left None are the queries' when ``T == S``
        (``ValueError`` otherwise). Bidirectional ids need ``call.spec.causal``.

    Returns:
      ``[B, T, H, Dv]`` in ``q.dtype`` (softmax in float32); with ``call.return_lse``,
      ``(out, lse)``, the ``float32[B, T, H]`` log-sum-exp (sinks included). A query
      that sees no key gets zeros.
    """
    check_qkv(q, k, v)
    spec = call.spec
    batch, q_len, heads = q.shape[:3]
    kv_len = k.shape[1]
    q_tokens = operands.q_tokens or Tokens(None)
    kv_tokens = operands.kv_tokens or Tokens(None)
    segment_ids, kv_segment_ids = q_tokens.segment_ids, kv_tokens.segment_ids
    if kv_segment_ids is None and segment_ids is not None:
        if q_len != kv_len:
            raise ValueError(f"segment_ids of {q_len} queries cannot serve {kv_len} keys; "
                             "pass kv_segment_ids= for the keys.")
        kv_segment_ids = segment_ids
    if segment_ids is None and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids needs segment_ids for the queries too (a query "
                         "sees a key when their segment ids are equal).")
    positions = check_ids("positions", q_tokens.positions, batch, q_len)
    segment_ids = check_ids("segment_ids", segment_ids, batch, q_len, segments=True)
    kv_positions = check_ids("kv_positions", kv_tokens.positions, batch, kv_len)
    kv_segment_ids = check_ids("kv_segment_ids", kv_segment_ids, batch, kv_len, segments=True)
    bidirectional_ids = q_tokens.bidirectional_ids
    kv_bidirectional_ids = kv_tokens.bidirectional_ids
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
    sinks = check_sinks(operands.sinks, heads)
    if not (batch and q_len and kv_len):  # nothing to attend: jax.nn's empty result
        out, lse = empty_result(q, v, True)
        lse = with_sinks(out, lse, sinks)[1]
        return (out, lse) if call.return_lse else out
    call.options(q)  # refuses a bad kernel or tile sizes here, not in the program
    # Positions left None are arange, filled in the staged program.
    q_tokens, kv_tokens = (Tokens(*(None if x is None else jnp.asarray(x) for x in fields))
                           for fields in ((positions, segment_ids, bidirectional_ids),
                                          (kv_positions, kv_segment_ids, kv_bidirectional_ids)))
    operands = Operands(q_tokens, kv_tokens, None if sinks is None else jnp.asarray(sinks))
    out, lse = _staged(q, k, v, operands, call=call)
    return (out, lse) if call.return_lse else out


# One program per signature: called eagerly, the kernel's scan and its closures would
# otherwise be traced and compiled anew on every call.
@functools.partial(jax.jit, static_argnames="call")
def _staged(q, k, v, operands: Operands, *, call: Call):
    """``(out, lse)`` of ``call`` on whole arrays (``operands`` checked)."""
    operands = Operands(_positioned(operands.q_tokens, *q.shape[:2]),
                        _positioned(operands.kv_tokens, *k.shape[:2]), operands.sinks)
    options = call.options(q)

    def attend(q, k, v, operands: Operands):
        out, lse = options.attention(q, k, v, operands.q_tokens,
                                     operands.kv_tokens)  # f32 [B, T, H, Dv], [B, T, H]
        out, lse = with_sinks(out, lse, operands.sinks)
        return out.astype(q.dtype), lse

    return _per_shard(attend, call, q, k, v, operands)


def _per_shard(attend, call: Call, q, k, v, operands: Operands):
    """``attend(q, k, v, operands)`` on arrays typed with an Explicit sharding: each device attends its own batch rows and heads
    (``shard_map`` over q's batch and head axes; the sequence gathered whole), and the
    output keeps q's sharding, as ``jax.nn`` gives it. Unsharded or Auto-mesh arrays are
    attended as they are."""
    sharding = getattr(jax.typeof(q), "sharding", None)
    spec = tuple(getattr(sharding, "spec", None) or ())
    mesh = getattr(sharding, "mesh", None)
    if not any(spec) or not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return attend(q, k, v, operands)
    spec = (spec + (None,) * 4)[:4]
    batch_entry, head_entry = spec[0], spec[2]
    kv_spec = [tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ())
               for x in (k, v)]
    if head_entry is not None and any((s + (None,) * 3)[2] != head_entry for s in kv_spec):
        head_entry = None  # q's head split alone would pair local heads with wrong K/V heads
    qkv, ids = P(batch_entry, None, head_entry, None), P(batch_entry, None)
    tokens = (operands.q_tokens, operands.kv_tokens)
    specs = [jax.tree.map(lambda _: ids, t) for t in tokens]
    operand_specs = Operands(specs[0], specs[1], P(head_entry))
    placed = [jax.reshard(x, qkv) for x in (q, k, v)]
    sinks = operands.sinks
    q_tokens, kv_tokens = (jax.tree.map(lambda x: jax.reshard(x, ids), t) for t in tokens)
    placed.append(Operands(q_tokens, kv_tokens,
                           None if sinks is None else jax.reshard(sinks, P(head_entry))))
    out, lse = jax.shard_map(
        attend, mesh=mesh, in_specs=(qkv,) * 3 + (operand_specs,),
        out_specs=(qkv, P(batch_entry, None, head_entry)),
        check_vma=not kernels.may_interpret(call.kernel))(*placed)
    return jax.reshard(out, P(*spec[:3], None)), jax.reshard(lse, P(*spec[:3]))
