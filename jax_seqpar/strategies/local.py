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
from jax_seqpar.core.masks import Tokens
from jax_seqpar.core.merge import with_sinks
from jax_seqpar.kernels.options import Options
from jax_seqpar.strategies.inputs import Operands, empty_result, max_logit_over
from jax_seqpar.strategies.wire import rotated

__all__ = ["local_attention"]


def _positioned(tokens: Tokens, batch: int, length: int) -> Tokens:
    if tokens.positions is not None:
        return tokens
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return dataclasses.replace(tokens, positions=positions)


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, options: Options,
                    operands: Operands):
    """Exact attention of ``q`` against ``k, v`` on whole arrays (queries and keys may
    differ in length), on inputs the entry point has checked.

    Args:
      q: ``[B, T, H, Dqk]``; k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` (one dtype).
      options: what the call computes (:class:`~jax_seqpar.kernels.options.Options`).
      operands: ``q_tokens``: the queries' ``int32[B, T]`` fields, ``kv_tokens``: the
        keys' ``int32[B, S]`` fields (each None where not given, the two sides
        consistent); ``sinks``: ``[H]`` or None. Positions left None are ``arange``
        of their length.

    Returns:
      ``[B, T, H, Dv]`` in ``q.dtype`` (softmax in float32); with ``options.return_lse``
      then the ``float32[B, T, H]`` log-sum-exp (sinks included); with
      ``options.return_max_logit`` then the ``float32[H]`` max logit (the largest
      visible ``scale * q.k`` before the soft-cap, ``-inf`` where none; no gradient).
      A query that sees no key gets zeros.
    """
    if not (q.shape[0] and q.shape[1] and k.shape[1]):  # nothing to attend: jax.nn's result
        out, lse, high = empty_result(q, v, True, True)
        result = (out, with_sinks(out, lse, operands.sinks)[1], high)
    else:
        inner, q_in, k_in = rotated(options, q, k)  # the Hadamard rotation, as strategies do
        result = _staged(q_in, k_in, v, operands, options=inner)
    rest = result[1:2] if options.return_lse else ()
    rest += result[2:] if options.return_max_logit else ()
    return (result[0], *rest) if rest else result[0]


# One program per signature: called eagerly, the kernel's scan and its closures would
# otherwise be traced and compiled anew on every call.
@functools.partial(jax.jit, static_argnames="options")
def _staged(q, k, v, operands: Operands, *, options: Options):
    """``(out, lse)`` of ``options`` on whole arrays (``operands`` checked)."""
    operands = Operands(_positioned(operands.q_tokens, *q.shape[:2]),
                        _positioned(operands.kv_tokens, *k.shape[:2]), operands.sinks)

    def attend(q, k, v, operands: Operands):
        result = kernels.attention(options, q, k, v, operands.q_tokens,
                                   operands.kv_tokens)  # f32 [B, T, H, Dv], [B, T, H] (, [B, T, H])
        out, lse = with_sinks(result[0], result[1], operands.sinks)
        return max_logit_over(options, (out.astype(q.dtype), lse, *result[2:]), None)

    return _per_shard(attend, options, q, k, v, operands)


def _per_shard(attend, options: Options, q, k, v, operands: Operands):
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
    high = (P(head_entry),) if options.return_max_logit else ()
    out, lse, *high = jax.shard_map(
        _over_batch(attend, options, batch_entry), mesh=mesh,
        in_specs=(qkv,) * 3 + (operand_specs,),
        out_specs=(qkv, P(batch_entry, None, head_entry), *high),
        check_vma=not kernels.may_interpret(options.kernel))(*placed)
    return (jax.reshard(out, P(*spec[:3], None)), jax.reshard(lse, P(*spec[:3])),
            *(jax.reshard(x, P(spec[2])) for x in high))


def _over_batch(attend, options: Options, batch_entry):
    """``attend`` with its ``[H]`` max logit (``options.return_max_logit``) the max over
    every device's batch rows (a ``pmax`` over ``batch_entry``'s mesh axes)."""
    if not options.return_max_logit or batch_entry is None:
        return attend

    def over_batch(*args):
        *result, high = attend(*args)
        return (*result, jax.lax.pmax(high, batch_entry))

    return over_batch
