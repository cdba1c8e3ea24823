"""Ulysses' exchange pipelined along the sequence: chunks of every device's tokens.

Each device cuts its ``L = S/P`` local tokens into ``c`` chunks of doubling length
(:func:`jax_seqpar.strategies.heads.chunk_sizes`: ``L/2^(c-1)`` twice, then
``2L/2^(c-1)``, ...). Chunk ``i``'s all-to-all brings the ``P * s_i`` tokens of chunk
``i`` of every device, for this device's ``H/P`` heads (their positions and segment ids
travel with them: any token order is exact). Attention runs on pairs (query chunk,
key chunk) with the online softmax across key chunks (the kernels' ``accumulate=``):

* forward, step ``i``: chunk ``i + 1`` travels while the kernel runs every pair that
  chunk ``i`` completes (its queries against key chunks ``0..i``, the earlier queries
  against key chunk ``i``). A query chunk is final once every key chunk it sees has
  arrived; at the last step the largest chunk's queries finish first and each query
  chunk's output leaves while the next one's last pair runs, the smallest last.
* backward (``custom_vjp``): every query's K/V are there (saved heads-sharded), so the
  query chunks' ``dout`` arrive one a step and each step runs its chunk's pairs against
  every key chunk: its dq leaves while the next chunk runs; at the last step each key
  chunk's dK/dV leaves once its last pair has run.

What cannot hide is the first chunk's q/k/v, the last output piece, the first ``dout``
and the last gradients: ``1/2^(c-1)`` of the bytes with doubling chunks (``c = 5``:
6.25 %). The buffers are those of one whole exchange (every chunk's q, k, v and the
float32 row accumulators, as one kernel call over all of them holds) plus one pair's
result in flight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_seqpar.core import compat as _compat
from jax_seqpar.core.merge import with_sinks
from jax_seqpar.strategies.head_pipeline import (heads_to_seq, no_gradient, seq_to_heads,
                                                 sink_cotangents, sink_gradient)
from jax_seqpar.strategies.inputs import Operands, axis_size

__all__ = ["chunk_pipeline"]


def chunk_pipeline(axis_name, options, q, k, v, operands: Operands, *, sizes: tuple,
                   return_lse: bool = False):
    """Ulysses' exchange around the local kernel, pipelined over sequence chunks.

    Args:
      axis_name: the all-to-all's mesh axis (or axes), of size P.
      options: the call's :class:`jax_seqpar.kernels.options.Options`.
      q: ``[B, L, H, Dqk]``; k, v: ``[B, L, Hkv', D]`` local sequence shards (``Hkv'``
        a multiple of P: :func:`jax_seqpar.strategies.heads.kv_replication`).
      operands: the whole sequence's metadata ``[B, P*L]`` in device order
        (:func:`jax_seqpar.strategies.inputs.gather_tokens`) and the ``[H/P]`` sink logits
        of this device's heads, or None.
      sizes: local tokens per chunk, summing to ``L``
        (:func:`jax_seqpar.strategies.heads.chunk_sizes`).
      return_lse: also return the float32 ``[B, L, H]`` log-sum-exp.
    Returns:
      ``[B, L, H, Dv]`` in ``q.dtype`` (and the log-sum-exp).
    """
    if sum(sizes) != q.shape[1]:
        raise ValueError(f"chunk sizes {sizes} do not sum to the {q.shape[1]} local tokens.")
    # K/V travel in q's dtype; their gradients go back in k's (float32 for replicated K/V).
    config = (axis_name, options, tuple(sizes), bool(return_lse), jnp.dtype(k.dtype))
    out, lse = _pipeline(config, q, k, v, operands)
    return (out, lse) if return_lse else out


def _exchange(to_heads, to_seq, axis_name, size):
    """ONE all-to-all for pieces going both ways (XLA runs one asynchronous all-to-all at
    a time: two around a kernel would leave one exposed): :func:`seq_to_heads` of each
    ``[B, s, n, D]`` of ``to_heads`` (``-> [B, P*s, n/P, D]``) and :func:`heads_to_seq` of
    each ``[B, P*s, n, D]`` of ``to_seq`` (``-> [B, s, P*n, D]``), every piece flattened
    per destination device and packed along the features. Pieces of different dtypes
    go in one all-to-all per dtype."""
    arrays = [*to_heads, *to_seq]
    if not arrays:
        return [], []
    if len({x.dtype for x in arrays}) > 1:
        return ([seq_to_heads(x, axis_name) for x in to_heads],
                [heads_to_seq(x, axis_name) for x in to_seq])
    b = arrays[0].shape[0]
    flat = [jnp.moveaxis(x.reshape(b, x.shape[1], size, -1), 2, 1).reshape(b, size, -1)
            for x in to_heads]  # [B, P (destination), s * n/P * D]
    flat += [x.reshape(b, size, -1) for x in to_seq]  # [B, P (destination), s * n * D]
    widths = [x.shape[-1] for x in flat]
    packed = jax.lax.all_to_all(jnp.concatenate(flat, axis=-1), axis_name, split_axis=1,
                                concat_axis=1, tiled=True)  # [B, P (source), sum of widths]
    parts = jnp.split(packed, [sum(widths[:i]) for i in range(1, len(widths))], axis=-1)
    heads = [part.reshape(b, size * x.shape[1], x.shape[2] // size, x.shape[3])
             for part, x in zip(parts, to_heads)]  # source-major: the device order
    seq = [jnp.moveaxis(part.reshape(b, size, x.shape[1] // size, *x.shape[2:]), 1, 2)
           .reshape(b, x.shape[1] // size, size * x.shape[2], x.shape[3])
           for part, x in zip(parts[len(to_heads):], to_seq)]
    return heads, seq


def _offsets(sizes):
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _cut(x, size, sizes):
    """``[B, P*L, ...]`` in device order -> every chunk's ``[B, P * s_i, ...]``: the order
    chunk ``i``'s all-to-all concatenates the devices' tokens in."""
    b, rest = x.shape[0], x.shape[2:]
    x = x.reshape(b, size, -1, *rest)  # [B, P, L, ...]
    return [x[:, :, o:o + s].reshape(b, size * s, *rest) for o, s in zip(_offsets(sizes), sizes)]


def _chunk_tokens(tokens, size, sizes):
    """Every chunk's ``[B, P * s_i]`` metadata from the ``[B, P*L]`` device-ordered one."""
    parts = jax.tree.map(lambda x: _cut(x, size, sizes), tokens)
    return [jax.tree.map(lambda p, i=i: p[i], parts, is_leaf=lambda x: isinstance(x, list))
            for i in range(len(sizes))]


def _local(x, sizes, i):
    """Chunk ``i`` of a local ``[B, L, ...]`` shard: ``[B, s_i, ...]``."""
    o = _offsets(sizes)[i]
    return x[:, o:o + sizes[i]]


def _forward_order(c):
    """Per step, the pairs (query chunk, key chunk) it runs, in order: at step ``i < c-1``
    chunk ``i``'s queries against key chunks ``0..i``, then earlier queries against key
    chunk ``i``; the last step first finishes the largest query chunk, then every other
    query chunk's pair with the last key chunk, largest first."""
    steps = [[(i, m) for m in range(i + 1)] + [(j, i) for j in range(i)] for i in range(c - 1)]
    last = c - 1
    steps.append([(last, m) for m in range(c)] + [(j, last) for j in reversed(range(last))])
    return steps


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipeline(config, q, k, v, operands):
    return _pipeline_fwd(config, q, k, v, operands)[0]


def _chunks_of(operands: Operands, size: int, sizes):
    """Every chunk's ``[B, P * s_i]`` query and key metadata."""
    return (_chunk_tokens(t, size, sizes) for t in (operands.q_tokens, operands.kv_tokens))


def _pipeline_fwd(config, q, k, v, operands):
    axis_name, options, sizes, return_lse, _ = config
    c = len(sizes)
    k, v = (x.astype(q.dtype) for x in (k, v))

    size = axis_size(axis_name)
    q_chunks, kv_chunks = _chunks_of(operands, size, sizes)
    sinks = operands.sinks

    def exchange_in(i, local):
        return tuple(_exchange([_local(x, sizes, i) for x in local], [], axis_name, size)[0])

    # The local shards pass every barrier: chunk i + 1's transfer cannot start before
    # step i - 1's kernels are done (one chunk in flight, not all of them at once).
    local = (q, k, v)
    arrived, upcoming = [exchange_in(0, local)], None
    acc = [None] * c  # per query chunk: its running (out, lse), float32
    sent = [None] * c  # per query chunk: its output (and lse) on the way back
    lses = [None] * c  # per query chunk: final lse without sinks (for the backward)
    in_flight = leaving = None
    for i, pairs in enumerate(_forward_order(c)):
        upcoming = exchange_in(i + 1, local) if i + 1 < c else None
        # At the last step: the pair after which each query chunk is final.
        final = {j: max(n for n, (jj, _) in enumerate(pairs) if jj == j)
                 for j, _ in pairs} if i == c - 1 else {}
        for n, (j, m) in enumerate(pairs):
            qj = arrived[j][0]
            km, vm = arrived[m][1:]
            acc[j] = options.forward(qj, km, vm, q_chunks[j], kv_chunks[m], accumulate=acc[j])
            if final.get(j) == n:  # query chunk j is done: its output leaves
                # This pair's raw result and the transfer in flight pass one barrier: the
                # transfer's start and end enclose this pair's kernel.
                # Every accumulator passes it too: the next pairs' kernels run after it.
                acc, in_flight = jax.lax.optimization_barrier((acc, in_flight))
                if leaving is not None:  # what is returned is what passed the barrier
                    sent[leaving] = in_flight
                out_j, lse_j = acc[j]
                lses[j] = lse_j
                if sinks is not None:
                    out_j, lse_j = with_sinks(out_j, lse_j, sinks)
                sent[j] = (heads_to_seq(out_j.astype(q.dtype), axis_name),
                           heads_to_seq(lse_j[..., None], axis_name) if return_lse else None)
                in_flight, leaving = sent[j], j
        if i < c - 1:
            # The step's results and the next chunk's arrival pass one barrier: the next
            # chunk travels while this step's kernels run.
            acc, upcoming, local = jax.lax.optimization_barrier((acc, upcoming, local))
            arrived.append(upcoming)
    out = jnp.concatenate([s[0] for s in sent], axis=1)  # [B, L, H, Dv]
    lse = jnp.concatenate([s[1] for s in sent], axis=1)[..., 0] if return_lse else None
    residuals = (arrived, lses, operands, out)
    return (out, lse), residuals


def _pipeline_bwd(config, residuals, cotangents):
    axis_name, options, sizes, return_lse, kv_dtype = config
    arrived, lses, operands, out = residuals
    c = len(sizes)
    q_chunks, kv_chunks = _chunks_of(operands, axis_size(axis_name), sizes)
    sinks = operands.sinks
    # Nothing of the backward before the whole forward (as in the head pipeline).
    cotangents, arrived = jax.lax.optimization_barrier((cotangents, arrived))
    dout, dlse = cotangents
    dtype = dout.dtype
    # <dout, out> of the rows and the lse's cotangent: float32 row statistics of every
    # chunk, sent in ONE small exchange ahead of chunk 0's dout.
    rowdot = jnp.einsum("bshd,bshd->bsh", dout.astype(jnp.float32), out.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    stats = [rowdot] + ([dlse] if return_lse else [])
    stats = jnp.stack(stats, axis=-1)  # [B, L, H, n]
    rows = _cut(seq_to_heads(stats, axis_name), axis_size(axis_name), sizes)  # [B, P*s_j, h, n]

    size = axis_size(axis_name)
    # Query chunks smallest first (the first dout is exposed), the other smallest last
    # (its dq and the last key chunk's dK/dV are exposed).
    order = [0, *range(2, c), 1] if c > 2 else list(range(c))
    dkv = [None] * c
    sent = {}  # ("q", j) / ("kv", m) -> the gradient piece, sequence-sharded
    dsinks = [None] * c
    # In flight while a step's kernels run: the next chunk's dout coming in and the
    # previous chunk's dq going out, in ONE all-to-all (``leaving`` names what goes out).
    upcoming = _exchange([_local(dout, sizes, order[0])], [], axis_name, size)[0][0]
    piece = leaving = pending = None
    for step, j in enumerate(order):
        dout_j = upcoming
        last = step == c - 1
        ins = [] if last else [_local(dout, sizes, order[step + 1])]
        outs = [] if pending is None else [pending.astype(dtype)]
        got_in, got_out = _exchange(ins, outs, axis_name, size)
        upcoming = got_in[0] if ins else None
        if outs:
            piece, leaving = got_out[0], ("q", order[step - 1])
        rowdot_j = rows[j][..., 0]
        dlse_j = rows[j][..., 1] if return_lse else _compat.match_varying(
            jnp.zeros(rowdot_j.shape, jnp.float32), dout_j)
        lse_j = lses[j]
        delta_j = rowdot_j - dlse_j
        if sinks is not None:
            dout_j, dlse_j, delta_j, dsinks[j] = sink_cotangents(dout_j, dlse_j, rowdot_j,
                                                                 lse_j, operands)
        qj = arrived[j][0]
        dq = None
        # At the last step the key chunks largest first: their dK/dV leave earliest.
        for m in (reversed(range(c)) if last else range(c)):
            km, vm = arrived[m][1:]
            dq_acc = (_compat.match_varying(jnp.zeros(qj.shape, jnp.float32), qj)
                      if dq is None else dq)
            dk_acc, dv_acc = dkv[m] or tuple(
                _compat.match_varying(jnp.zeros(x.shape, jnp.float32), x) for x in (km, vm))
            dq, *dkv[m] = options.backward(qj, km, vm, q_chunks[j], kv_chunks[m], lse_j,
                                           delta_j, dout_j.astype(qj.dtype),
                                           accumulate=(dq_acc, dk_acc, dv_acc))
            dkv[m] = tuple(dkv[m])
            if last:  # key chunk m has seen every query chunk: its dK/dV leave
                # The barrier takes the kernel's raw result (a cast between would be
                # what XLA:TPU hides the transfers behind, not the kernel); dq and every
                # dK/dV pass it too: the next pairs' kernels run after it.
                dq, dkv, piece = jax.lax.optimization_barrier((dq, dkv, piece))
                if leaving is not None:  # returned as it passed the barrier
                    sent[leaving] = piece
                piece = tuple(_exchange([], [x.astype(kv_dtype) for x in dkv[m]], axis_name,
                                        size)[1])
                leaving = ("kv", m)
        dq, dkv, dout, upcoming, piece = jax.lax.optimization_barrier(
            (dq, dkv, dout, upcoming, piece))
        if leaving is not None:
            sent[leaving] = piece
        pending = dq
    sent[("q", order[-1])] = heads_to_seq(pending.astype(dtype), axis_name)
    sent_q = [sent[("q", j)] for j in range(c)]
    sent_kv = [sent[("kv", m)] for m in range(c)]
    dq = jnp.concatenate(sent_q, axis=1)
    dk = jnp.concatenate([s[0] for s in sent_kv], axis=1)
    dv = jnp.concatenate([s[1] for s in sent_kv], axis=1)
    dsinks = None if sinks is None else sink_gradient(sum(dsinks[1:], dsinks[0]), operands)
    return dq, dk, dv, no_gradient(operands, dsinks)


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)
