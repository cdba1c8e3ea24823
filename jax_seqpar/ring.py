"""Ring attention: K/V blocks travel around the ring, queries stay.

Paper: Liu et al., Ring Attention with Blockwise Transformers, arXiv:2310.01889.

Every device keeps its query shard and, in P steps, sees every K/V shard: at
each step it sends its current K/V shard (with the shard's token metadata) to
the next device and computes attention against it, merging the partial result
into a float32 ``(out, lse)`` carry. The backward is a second ring (a
``custom_vjp``): the forward saves only ``q, k, v, out, lse``; the backward
re-rotates K/V and carries float32 dK/dV accumulators around the ring and home,
so memory stays O(S/P) per device. Only the ``Hkv`` heads given are sent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_seqpar import _compat
from jax_seqpar._inputs import axis_size, prepare
from jax_seqpar.merge import merge
from jax_seqpar.masks import EMPTY_LSE


def ring_attention(q, k, v, *, axis_name, causal=False, segment_ids=None, positions=None,
                   window=None, scale=None, kernel="auto", block_sizes=None,
                   kv_segment_ids=None):
    """Exact attention of a sequence sharded over ``axis_name`` (call inside ``shard_map``).

    Args:
      q: ``[B, S/P, H, Dqk]`` this device's queries.
      k: ``[B, S/P, Hkv, Dqk]``; v: ``[B, S/P, Hkv, Dv]`` this device's keys/values.
      axis_name: mesh axis (or tuple of axes) along which the sequence is split.
      causal, window: mask (see :class:`jax_seqpar.masks.MaskSpec`), on global positions.
      segment_ids: ``int32[B, S/P]`` document ids of the local tokens, or None.
      positions: ``int32[B, S/P]`` global positions of the local tokens; default
        is the contiguous split (pass :mod:`jax_seqpar.layout` positions for zigzag).
      scale: defaults to ``1/sqrt(Dqk)``.
      kernel: ``"auto"``, ``"xla"`` or ``"pallas"``; block_sizes: the kernel's tiles.
      kv_segment_ids: ``int32[B, S/P]`` the keys' own segment ids when they differ
        from the queries' (e.g. padded keys), or None (``segment_ids``).

    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype`` (softmax statistics and carries in float32).

    >>> out = jax.shard_map(functools.partial(ring_attention, axis_name="sp", causal=True),
    ...                     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
    """
    q_tokens, kv_tokens, options = prepare(
        q, k, v, axis_name=axis_name, causal=causal, segment_ids=segment_ids,
        positions=positions, window=window, scale=scale, kernel=kernel,
        block_sizes=block_sizes, kv_segment_ids=kv_segment_ids)
    return ring_over(axis_name, options, q, k, v, q_tokens, kv_tokens)


def ring_over(axis_name, options, q, k, v, q_tokens, kv_tokens):
    """The ring core on prepared inputs (used by :func:`ring_attention` and the hybrid).

    Args:
      axis_name: the ring's mesh axis; options: the call's static ``Options``.
      q, k, v: ``[B, S/P, H|Hkv, D]`` local shards; q_tokens, kv_tokens: their
        metadata (the keys' travels with them).
    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype``.
    """
    return _ring(axis_name, options, q, k, v, q_tokens, kv_tokens)


def _shift(tree, axis_name):
    """Send every array in ``tree`` to the next device of the ring."""
    size = axis_size(axis_name)
    perm = [(i, (i + 1) % size) for i in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(axis_name, options, q, k, v, q_tokens, kv_tokens):
    out, _ = _ring_forward(axis_name, options, q, k, v, q_tokens, kv_tokens)
    return out


def _ring_forward(axis_name, options, q, k, v, q_tokens, kv_tokens):
    batch, local_len, heads, _ = q.shape
    d_v = v.shape[-1]

    def attend(carry, kv):
        o, lse = options.forward(q, kv[0], kv[1], q_tokens, kv[2])
        return merge(*carry, o, lse)

    def step(carry, _):
        acc, kv = carry
        next_kv = _shift(kv, axis_name)  # issued before the compute it can hide behind
        return (attend(acc, kv), next_kv), None

    acc = (jnp.zeros((batch, local_len, heads, d_v), jnp.float32),
           jnp.full((batch, local_len, heads), EMPTY_LSE, jnp.float32))
    acc = _compat.match_varying(acc, q)
    (acc, kv), _ = jax.lax.scan(step, (acc, (k, v, kv_tokens)),
                                length=axis_size(axis_name) - 1)
    out, lse = attend(acc, kv)
    return out.astype(q.dtype), lse


def _ring_fwd(axis_name, options, q, k, v, q_tokens, kv_tokens):
    out, lse = _ring_forward(axis_name, options, q, k, v, q_tokens, kv_tokens)
    return out, (q, k, v, q_tokens, kv_tokens, out, lse)


def _ring_bwd(axis_name, options, residuals, dout):
    q, k, v, q_tokens, kv_tokens, out, lse = residuals
    delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(jnp.float32), out.astype(jnp.float32))

    def grads(carry, kv):
        return options.backward(q, kv[0], kv[1], q_tokens, kv[2], lse, delta, dout,
                                accumulate=carry)

    def step(carry, _):
        dq, kv, dkv = carry
        next_kv = _shift(kv, axis_name)
        dq, *dkv = grads((dq, *dkv), kv)
        return (dq, next_kv, _shift(tuple(dkv), axis_name)), None

    zeros = _compat.match_varying(
        tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v)), q)
    (dq, kv, dkv), _ = jax.lax.scan(step, (zeros[0], (k, v, kv_tokens), zeros[1:]),
                                    length=axis_size(axis_name) - 1)
    dq, *dkv = grads((dq, *dkv), kv)
    dk, dv = _shift(tuple(dkv), axis_name)  # the accumulators' last hop brings them home
    no_grad = jax.tree.map(lambda _: None, (q_tokens, kv_tokens))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad


_ring.defvjp(_ring_fwd, _ring_bwd)
