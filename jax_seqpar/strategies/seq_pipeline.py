"""Ulysses' exchange pipelined along the sequence: the keys first, then the queries.

The pieces (:mod:`jax_seqpar.strategies.pieces`): each device's K/V in ``2^(c-1)`` pieces
of ``u = L/2^(c-1)`` tokens, its queries in pieces ``u, L/4, L/4, L/4, L/8, ..., 2u, u``.

* forward: the first query piece and the first K/V piece arrive together (exposed).
  Then each K/V piece travels while the kernel attends the first query piece to the
  K/V piece before it (the online softmax across pieces: the kernels' ``accumulate=``),
  and the second query piece while it meets the last. Once every key is there, each
  further query piece is attended to all of them in ONE kernel call (final at once, no
  running accumulator): the next query piece comes in and the previous output leaves
  while it runs, in one all-to-all. Exposed: the first query and K/V pieces and the last
  output piece, ``1/2^(c-1)`` of the bytes (``c = 5``: 6.25 %).
* backward (``custom_vjp``): dq first, then dK/dV (the kernels compute them in two
  kernels: a call whose other result is unused runs only one). The query pieces' ``dout``
  arrives smallest first and each piece's dq comes from one call against every key,
  leaving while the next piece runs; then each K/V piece's dK/dV comes from one call
  against every query, final at once, leaving while the next piece runs. Exposed: the
  first ``dout`` piece and the last dK/dV piece. Nothing accumulates across calls.

Memory: the buffers of one whole exchange (the keys of every piece, concatenated once
they are all there; in a training step, the queries kept for the backward), one piece's
float32 result and the pieces in flight: no float32 result or gradient of the whole
sequence (only the first, smallest query piece accumulates, in the forward).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_seqpar import kernels
from jax_seqpar.core.merge import with_sinks
from jax_seqpar.strategies.head_pipeline import no_gradient
from jax_seqpar.strategies.heads import held_max_logit
from jax_seqpar.strategies.wire import Wire
from jax_seqpar.strategies.inputs import Operands, Options, axis_size
from jax_seqpar.strategies.pieces import (Pieces, RowCotangents, concat, exchange, keys_first,
                                          local, put, send)

__all__ = ["seq_pipeline"]


def seq_pipeline(axis_name: str | tuple[str, ...], options: Options, q: jax.Array, k: jax.Array,
                   v: jax.Array, operands: Operands, *, sizes: tuple,
                   return_lse: bool = False):
    """Ulysses' exchange around the local kernel, pipelined over sequence pieces.

    Args:
      axis_name: the all-to-all's mesh axis (or axes), of size P.
      options: the call's :class:`jax_seqpar.kernels.options.Options`.
      q: ``[B, L, H, Dqk]``; k, v: ``[B, L, Hkv', D]`` local sequence shards (``Hkv'``
        a multiple of P: :func:`jax_seqpar.strategies.heads.kv_replication`).
      operands: the whole sequence's metadata ``[B, P*L]`` in device order
        (:func:`jax_seqpar.strategies.inputs.gather_tokens`) and the ``[H/P]`` sink logits
        of this device's heads, or None.
      sizes: local tokens of each query piece, summing to ``L``; the K/V pieces have
        ``sizes[0]`` each (:func:`jax_seqpar.strategies.heads.piece_sizes`).
      return_lse: also return the float32 ``[B, L, H]`` log-sum-exp.
    Returns:
      ``[B, L, H, Dv]`` in ``q.dtype`` (and the log-sum-exp); with
      ``options.return_max_logit`` last the max logits of this device's heads as rows
      ``float32[B, L, H]`` (:func:`~jax_seqpar.strategies.heads.held_max_logit`: nothing
      sent for them; no gradient).
    """
    if sum(sizes) != q.shape[1]:
        raise ValueError(f"chunk sizes {sizes} do not sum to the {q.shape[1]} local tokens.")
    # K/V travel in q's dtype; their gradients go back in k's (float32 for replicated K/V).
    config = (axis_name, options, tuple(sizes), bool(return_lse), jnp.dtype(k.dtype))
    out, lse, *high = _pipeline(config, q, k, v, operands)
    result = (out,) + ((lse,) if return_lse else ()) + tuple(high)
    return result if len(result) > 1 else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipeline(config, q, k, v, operands):
    return _pipeline_fwd(config, q, k, v, operands)[0]


def _pipeline_fwd(config, q, k, v, operands):
    axis_name, options, sizes, return_lse, _ = config
    like = q.dtype
    # q, k, v travel in the call's compute dtype (kept for the backward: one that serves
    # both passes), decoded on arrival.
    wire = Wire.of(options.compute, like, saved=True)
    local_len = q.shape[1]
    q, k, v = (wire.encode(x.astype(like)) for x in (q, k, v))
    size = axis_size(axis_name)
    cut = Pieces.of(axis_name, sizes, operands, local_len)
    sizes, q_tokens, c, sinks = cut.sizes, cut.q_tokens, len(cut.sizes), operands.sinks

    def finished(result):
        """A query piece's kernel result -> what leaves (output, lse) and its lse."""
        out, lse = result[:2]
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)
        return [out.astype(like)] + ([lse[..., None]] if return_lse else []), result[1]

    qs: list[Any] = [None] * c  # every query piece as it arrived (heads-sharded)
    acc, (qs[0], qs[1]), keys, values, shards = keys_first(axis_name, options, q, k, v, cut,
                                                           wire)
    kv_all = concat(cut.kv_tokens)
    # Then the queries: piece j + 1 comes in and piece j - 1's output leaves while piece
    # j is attended to every key in one kernel call.
    pending, lse = finished(acc)
    highs = list(acc[2:])  # the query pieces' row max logits (return_max_logit)
    lses: list[Any] = [lse] + [None] * (c - 1)
    sent: list[Any] = [None] * c  # per query piece: its output (and lse) as it arrived
    for j in range(1, c):
        ins = [local(shards[0], sizes, j + 1)] if j + 1 < c else []
        raw, unpack = send(ins, pending, axis_name, size)
        result = kernels.forward(options, qs[j], keys, values, q_tokens[j], kv_all)
        result, raw, shards = jax.lax.optimization_barrier((result, raw, shards))
        got_in, got_out = unpack(raw)
        sent[j - 1] = got_out
        if ins:
            qs[j + 1] = wire.decode(got_in[0])
        pending, lses[j] = finished(result)
        highs += result[2:]
    sent[c - 1] = exchange([], pending, axis_name, size)[1]
    out = concat([s[0] for s in sent])  # [B, L, H, Dv]
    lse = concat([s[1] for s in sent])[..., 0] if return_lse else None
    high = (held_max_logit(highs, axis_name, out.shape[:3]),) if highs else ()
    return (out, lse, *high), (concat(qs), keys, values, lses, operands, out)


def _pipeline_bwd(config, residuals, cotangents):
    axis_name, options, sizes, return_lse, kv_dtype = config
    queries, keys, values, lses, operands, out = residuals
    size = axis_size(axis_name)
    cut = Pieces.of(axis_name, sizes, operands, out.shape[1])
    sizes, kv_sizes, q_tokens, kv_tokens = cut
    c = len(sizes)
    q_all, kv_all = concat(q_tokens), concat(kv_tokens)
    # Nothing of the backward before the whole forward (as in the head pipeline).
    cotangents, queries, keys, values = jax.lax.optimization_barrier(
        (cotangents, queries, keys, values))
    dout, dlse = cotangents[:2]
    dtype = dout.dtype
    rows = RowCotangents.of(axis_name, cut, operands, out, dout, dlse, lses, return_lse)
    q_parts = cut.parts(size)
    cotangents_of = functools.partial(rows.of_piece, dtype=queries.dtype)
    # dq: the query pieces smallest first, each against every key in one kernel call (its
    # dK/dV part unused: the dq kernel alone runs), the next piece's dout coming in and
    # the previous dq leaving meanwhile.
    order = [0, *reversed(range(1, c))]
    wire = Wire.of(options.compute, dtype, backward=True)  # dout, as the kernel takes it
    dout = wire.encode(dout)
    upcoming = wire.decode(exchange([local(dout, sizes, order[0])], [], axis_name, size)[0][0])
    deltas: list[Any] = [None] * c
    sent_q: list[Any] = [None] * c
    pending: list[jax.Array] = []
    # The gathered dout, written piece by piece (the dK/dV pass reads it whole).
    dout_all = jnp.zeros(queries.shape[:3] + (out.shape[3],), queries.dtype)
    for n, j in enumerate(order):
        dout_j, deltas[j] = cotangents_of(j, upcoming)
        dout_all = put(dout_all, q_parts[j], dout_j)
        dq = kernels.backward(options, queries[:, q_parts[j]], keys, values, q_tokens[j], kv_all,
                              lses[j], deltas[j], dout_j)[0]
        ins = [local(dout, sizes, order[n + 1])] if n + 1 < c else []
        raw, unpack = send(ins, pending, axis_name, size)
        # The barrier takes the kernel's raw result (a cast between would be what XLA:TPU
        # hides the transfers behind, not the kernel).
        dq, raw, dout = jax.lax.optimization_barrier((dq, raw, dout))
        got_in, got_out = unpack(raw)
        if pending:
            sent_q[order[n - 1]] = got_out[0]
        if ins:
            upcoming = wire.decode(got_in[0])
        pending = [dq.astype(dtype)]
    # dK/dV: one K/V piece at a time against every query (the dK/dV kernel alone), each
    # final at once and leaving while the next runs (the last dq with the first).
    delta_all, lse_all = concat(deltas), concat(lses)
    unit = size * kv_sizes[0]
    leaving = ("q", order[-1])
    sent_kv: list[Any] = [None] * len(kv_sizes)
    for m in range(len(kv_sizes)):
        raw, unpack = send([], pending, axis_name, size)
        part = slice(m * unit, (m + 1) * unit)
        _, dk, dv = kernels.backward(options, queries, keys[:, part], values[:, part], q_all,
                                     kv_tokens[m], lse_all, delta_all, dout_all)
        # The keys pass the barrier too: the next piece's kernel runs after it (else
        # XLA:TPU runs every piece's kernel ahead of the transfers).
        dk, dv, raw, keys, values = jax.lax.optimization_barrier((dk, dv, raw, keys, values))
        got_out = unpack(raw)[1]
        if leaving[0] == "q":
            sent_q[leaving[1]] = got_out[0]
        else:
            sent_kv[leaving[1]] = got_out
        pending, leaving = [dk.astype(kv_dtype), dv.astype(kv_dtype)], ("kv", m)
    sent_kv[-1] = exchange([], pending, axis_name, size)[1]
    dq = concat(sent_q)
    dk, dv = (concat([s[i] for s in sent_kv]) for i in (0, 1))
    return dq, dk, dv, no_gradient(operands, rows.sinks_gradient())


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)
