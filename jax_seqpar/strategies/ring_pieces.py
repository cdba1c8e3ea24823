"""The hybrid's exchange pipelined along the sequence, around its ring.

The inner all-to-all cuts each device's ``L`` local tokens into the pieces of
:mod:`jax_seqpar.strategies.pieces` (K/V in ``2^(c-1)`` pieces of ``u``, queries in
``u, L/4, ..., u``); the ring over the outer axis (``O`` devices) then passes the whole
block of keys a device gathered, ``[B, I*L, h_kv, D]``, as
:mod:`jax_seqpar.strategies.ring` does: the slow axis carries each K/V block once a step,
as unpipelined. The pieces' transfers hide behind the ring's first and last steps:

* forward. Step 0 (this device's own keys): the keys first (as Ulysses,
  :func:`jax_seqpar.strategies.pieces.keys_first`), then each further query piece
  attends to every key in one kernel call while the next piece comes in; the first
  hop of the ring travels during the last of these calls. Steps ``1 .. O-2``: every
  query against the block that arrived, one call, the next hop in flight (as the
  ring). Step ``O-1``: one call per query piece against the last block, final at once,
  each piece's output leaving while the next piece's call runs. Exposed: the first
  query and K/V pieces and the last output piece, ``1/2^(c-1)`` of the inner bytes
  (the ring's hops all hide).
* backward (``custom_vjp``): step 0, each piece's ``dout`` arrives (smallest first)
  while the previous piece's dq against the own keys is computed, then the own keys'
  dK/dV from every query (the next block's hop in flight); steps ``1 .. O-1`` as the
  ring's backward (dq accumulates here, float32 dK/dV accumulators follow their block);
  the last step's dK/dV take the hop home while the first query piece's last dq is
  computed, then leave through the inner axis with the dq pieces, one piece's dq
  behind each further call. Exposed: the first ``dout`` piece and the last dq piece.

With a ``reach`` (a window or chunks on the contiguous split, or documents that bound it:
:func:`jax_seqpar.core.reach.mask_reach` over the outer axis) the ring is the halo
exchange of :mod:`jax_seqpar.strategies.halo`, scheduled where the ring's hops are: the
halo's K/V (only the ``left + right`` tokens the mask reaches, from the neighbours the
reach needs, :func:`jax_seqpar.strategies.halo.pull`) come in during step 0's last call,
and the last step attends to them piece by piece; no middle steps. Backward: every
query's dK/dV of the halo first, sent back in float32
(:func:`jax_seqpar.strategies.halo.send_back`) while the own keys' dK/dV are computed;
then the last step's dq pieces against the halo as above (dK/dV already home). The
gathered keys are piece-major, so the halo is taken by rows
(:meth:`jax_seqpar.strategies.pieces.Pieces.kv_rows`).

Memory: the ring's own (float32 output or dq accumulators of the gathered queries, two
K/V blocks), plus the pieces in flight.

:func:`kernel_calls` lists what each of these kernel calls receives, per ring step, for the
time model.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar import kernels
from jax_seqpar.core import compat as _compat
from jax_seqpar.core.merge import with_sinks
from jax_seqpar.strategies import halo
from jax_seqpar.strategies.head_pipeline import no_gradient
from jax_seqpar.strategies.heads import held_max_logit
from jax_seqpar.strategies.wire import Wire
from jax_seqpar.strategies.inputs import Operands, Options, axis_size
from jax_seqpar.strategies.pieces import (KernelCall, Pieces, RowCotangents, concat,
                                          cut_positions, exchange, keys_first, local, put, send)
from jax_seqpar.strategies.ring import backward_steps, forward_steps, shift_during

__all__ = ["kernel_calls", "ring_pieces"]


def ring_pieces(inner_axis: str | tuple[str, ...], outer_axis: str | tuple[str, ...],
                options: Options, q: jax.Array, k: jax.Array, v: jax.Array,
                operands: Operands, *, sizes: tuple, return_lse: bool = False,
                reach: tuple[int, int] | None = None):
    """The hybrid's attention, its inner exchange pipelined over sequence pieces.

    Args:
      inner_axis: the all-to-all's mesh axis (size ``I``); outer_axis: the ring's
        (size ``O`` > 1).
      options: the call's :class:`jax_seqpar.kernels.options.Options`.
      q: ``[B, L, H, Dqk]``; k, v: ``[B, L, Hkv', D]`` local sequence shards (``Hkv'``
        a multiple of ``I``: :func:`jax_seqpar.strategies.heads.kv_replication`).
      operands: the inner group's metadata ``[B, I*L]`` in device order
        (:func:`jax_seqpar.strategies.inputs.gather_tokens` over the inner axis) and the
        ``[H/I]`` sink logits of this device's heads, or None.
      sizes: local tokens of each query piece
        (:func:`jax_seqpar.strategies.heads.piece_sizes`).
      return_lse: also return the float32 ``[B, L, H]`` log-sum-exp.
      reach: ``(left, right)`` tokens beyond the inner group's ``I*L`` that its queries
        see (:func:`jax_seqpar.core.reach.mask_reach` over the outer axis): the ring is
        then that halo exchange; None: the full ring.
    Returns:
      ``[B, L, H, Dv]`` in ``q.dtype`` (and the log-sum-exp); with
      ``options.return_max_logit`` last the max logits of this device's heads as rows
      ``float32[B, L, H]`` (:func:`~jax_seqpar.strategies.heads.held_max_logit`: nothing
      sent for them; no gradient).
    """
    config = (inner_axis, outer_axis, options, tuple(sizes), bool(return_lse),
              jnp.dtype(k.dtype), None if reach is None else tuple(reach))
    out, lse, *high = _pipeline(config, q, k, v, operands)
    result = (out,) + ((lse,) if return_lse else ()) + tuple(high)
    return result if len(result) > 1 else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipeline(config, q, k, v, operands):
    return _pipeline_fwd(config, q, k, v, operands)[0]


def _pipeline_fwd(config, q, k, v, operands):
    inner, outer, options, sizes, return_lse, _, reach = config
    like, local_len = q.dtype, q.shape[1]
    # The inner exchange's q, k, v are kept for the backward (a wire serving both
    # passes); the outer ring's blocks travel in the forward's (the halo's: saved).
    wire, ring_wire = _wires(options, like, reach)
    q, k, v = (wire.encode(x.astype(like)) for x in (q, k, v))
    size, steps = axis_size(inner), axis_size(outer)
    cut = Pieces.of(inner, sizes, operands, local_len)
    q_tokens, c, sinks = cut.q_tokens, len(sizes), operands.sinks
    qs: list[Any] = [None] * c  # every query piece as it arrived (heads-sharded)
    acc, (qs[0], qs[1]), keys, values, shards = keys_first(inner, options, q, k, v, cut, wire)
    tokens = concat(cut.kv_tokens)
    block = (ring_wire.encode(keys), ring_wire.encode(values), tokens)
    # Step 0, the queries: piece j + 1 comes in while piece j meets every own key; step
    # 1's block (or the halo) travels during the last call (one transfer in flight a call).
    accs = [acc] + [None] * (c - 1)
    for j in range(1, c):
        ins = [local(shards[0], sizes, j + 1)] if j + 1 < c else []

        def call(j=j):
            return kernels.forward(options, qs[j], keys, values, q_tokens[j], tokens)
        if ins:
            raw, unpack = send(ins, [], inner, size)
            accs[j], raw, shards = jax.lax.optimization_barrier((call(), raw, shards))
            qs[j + 1] = wire.decode(unpack(raw)[0][0])
        elif reach is None:
            accs[j], hop = shift_during(call, block, outer)
        else:
            accs[j], hop = jax.lax.optimization_barrier(
                (call(), halo.pull(outer, options, reach, keys, values, tokens,
                                   rows=cut.kv_rows(size))))
    queries, q_all = concat(qs), concat(q_tokens)
    del qs  # the pieces die here: the last step reads the gathered queries

    def attend(acc, kv):
        return kernels.forward(options, queries, *ring_wire.decode_kv(kv), q_all, kv[2],
                               accumulate=acc)

    acc, kv = _compat.match_varying((concat(accs), hop), (accs, hop, queries))
    if reach is None:
        acc, kv = forward_steps(attend, acc, kv, outer, steps - 2)  # the ring's middle steps
    # The last step: piece by piece, each final at once, its output leaving while the
    # next piece's call runs (the block passes each barrier: the calls stay in order).
    lses: list[Any] = [None] * c
    sent: list[Any] = [None] * c
    pending: list[Any] = []
    highs: list[Any] = []  # the pieces' row max logits (return_max_logit), kept here
    for j, part in enumerate(cut.parts(size)):
        raw, unpack = send([], pending, inner, size)
        result = kernels.forward(options, queries[:, part], *ring_wire.decode_kv(kv),
                                 q_tokens[j], kv[2],
                                 accumulate=jax.tree.map(lambda x: x[:, part], acc))
        result, raw, kv = jax.lax.optimization_barrier((result, raw, kv))
        if pending:
            sent[j - 1] = unpack(raw)[1]
        out, lse = result[:2]
        lses[j] = lse  # without the sinks: what the backward's kernels take
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)
        highs += result[2:]
        pending = [out.astype(like)] + ([lse[..., None]] if return_lse else [])
    sent[c - 1] = exchange([], pending, inner, size)[1]
    out = concat([s[0] for s in sent])  # [B, L, H, Dv]
    lse = concat([s[1] for s in sent])[..., 0] if return_lse else None
    high = (held_max_logit(highs, inner, out.shape[:3]),) if highs else ()
    return (out, lse, *high), (queries, keys, values, lses, operands, out,
                        None if reach is None else kv)  # the halo, kept


def _pipeline_bwd(config, residuals, cotangents):
    inner, outer, options, sizes, return_lse, kv_dtype, reach = config
    queries, keys, values, lses, operands, out, halo_block = residuals
    size, steps = axis_size(inner), axis_size(outer)
    cut = Pieces.of(inner, sizes, operands, out.shape[1])
    q_tokens, c = cut.q_tokens, len(sizes)
    q_all, parts = concat(q_tokens), cut.parts(size)
    cotangents, queries, keys, values = jax.lax.optimization_barrier(
        (cotangents, queries, keys, values))
    dout, dlse = cotangents[:2]
    dtype = dout.dtype
    rows = RowCotangents.of(inner, cut, operands, out, dout, dlse, lses, return_lse)
    # K/V around the outer ring serve the products and the recomputed scores: a wire for
    # both passes; dout's is the backward's.
    ring_wire = _wires(options, queries.dtype, reach, backward=True)[1]
    dout_wire = Wire.of(options.compute, dtype, backward=True)
    tokens = concat(cut.kv_tokens)
    block = (ring_wire.encode(keys), ring_wire.encode(values), tokens)
    # Step 0: the dout pieces smallest first, each piece's dq against the own keys while
    # the next comes in.
    order = [0, *reversed(range(1, c))]
    dout = dout_wire.encode(dout)
    upcoming = dout_wire.decode(exchange([local(dout, sizes, order[0])], [], inner, size)[0][0])
    deltas: list[Any] = [None] * c
    # The gathered dout, written piece by piece. The float32 dq pieces are kept and
    # joined once after the loop: written into a whole accumulator as they come, XLA:TPU
    # keeps two copies of it beside the pieces (v5p training step at 16384: 82.1 -> 74.1
    # MiB temp).
    dout_all = jnp.zeros(queries.shape[:3] + (out.shape[3],), queries.dtype)
    dqs: list[Any] = [None] * c
    for n, j in enumerate(order):
        dout_j, deltas[j] = rows.of_piece(j, upcoming, dtype=queries.dtype)
        dout_all = put(dout_all, parts[j], dout_j)
        dq_j = kernels.backward(options, queries[:, parts[j]], keys, values, q_tokens[j], tokens,
                                lses[j], deltas[j], dout_j)[0]
        ins = [local(dout, sizes, order[n + 1])] if n + 1 < c else []
        raw, unpack = send(ins, [], inner, size)
        dq_j, raw, dout = jax.lax.optimization_barrier((dq_j, raw, dout))
        dqs[j] = dq_j
        if ins:
            upcoming = dout_wire.decode(unpack(raw)[0][0])
    delta_all, lse_all = concat(deltas), concat(lses)
    dq = concat(dqs)

    def grads(kv, dq=None):
        """float32 ``(dq, dk, dv)`` of every query against ``kv`` (``dq``: added)."""
        accumulate = None
        if dq is not None:
            zeros = _compat.match_varying(tuple(jnp.zeros(x.shape, jnp.float32)
                                                for x in ring_wire.decode_kv(kv)), dq)
            accumulate = (dq, *zeros)
        return kernels.backward(options, queries, *ring_wire.decode_kv(kv), q_all, kv[2],
                                lse_all, delta_all, dout_all, accumulate=accumulate)

    if reach is None:
        # The own keys' dK/dV from every query, step 1's block in flight.
        dkv, hop = shift_during(lambda: tuple(grads(block)[1:]), block, outer)

        def step_grads(dq, kv):
            dq, *fresh = grads(kv, dq)
            return dq, tuple(fresh)

        dq, hop, dkv = _compat.match_varying((dq, hop, dkv), (dq, hop, dkv))
        dq, kv, dkv = backward_steps(step_grads, dq, hop, dkv, outer, steps - 2)  # middle steps
        # The last step: its block's dK/dV (the accumulator in flight), home during the
        # first piece's dq; then every dq piece, final at once, leaving while the next runs.
        fresh, arrived = shift_during(lambda: tuple(grads(kv)[1:]), dkv, outer)
    else:
        # The halo's dK/dV from every query, sent back in float32 (K and V joined: one
        # transfer a hop) while the own keys' dK/dV are computed; then the dq pieces
        # against the halo as the ring's last step.
        kv, split = halo_block, keys.shape[-1]
        halo_dkv = jnp.concatenate(grads(kv)[1:], axis=-1)  # [B, left+right, h, Dqk+Dv]
        fresh, (arrived,) = jax.lax.optimization_barrier((
            tuple(grads(block)[1:]),
            halo.send_back(outer, reach, (halo_dkv,), (jnp.concatenate([keys, values], -1),),
                           rows=cut.kv_rows(size))))
        arrived = (arrived[..., :split], arrived[..., split:])
    home = tuple((x + y).astype(kv_dtype) for x, y in zip(fresh, arrived))  # to send
    unit = size * cut.kv_sizes[0]
    sent_q: list[Any] = [None] * c
    pending: list[Any] = []
    for n, j in enumerate(reversed(range(c))):  # the smallest piece last
        raw, unpack = send([], pending, inner, size)

        def call(j=j, raw=raw, kv=kv):  # the block passes each barrier: calls in order
            return (kernels.backward(options, queries[:, parts[j]], *ring_wire.decode_kv(kv),
                                     q_tokens[j], kv[2], lses[j], deltas[j],
                                     dout_all[:, parts[j]])[0], raw, kv)
        if n == 0 and reach is None:  # dK/dV home during the first piece's call, summed
            # before it (else XLA:TPU runs the call first and starts the hop after it)
            home, kv = jax.lax.optimization_barrier((home, kv))
            (last, raw, kv), home = shift_during(lambda: call(kv=kv), home, outer)
        else:
            last, raw, kv = jax.lax.optimization_barrier(call())
        got = unpack(raw)[1]
        if n == 1:  # the first piece's dq and every K/V piece's dK/dV
            sent_q[c - 1], sent_kv = got[0], got[1:]
        elif n > 1:
            sent_q[c - n] = got[0]
        pending = [(dq[:, parts[j]] + last).astype(dtype)]
        if n == 0:
            pending += [x[:, m * unit:(m + 1) * unit] for m in range(len(cut.kv_sizes))
                        for x in home]
    sent_q[0] = exchange([], pending, inner, size)[1][0]
    dk, dv = (concat(sent_kv[i::2]) for i in (0, 1))
    return concat(sent_q), dk, dv, no_gradient(operands, rows.sinks_gradient())


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)


def _wires(options: Options, like, reach, backward: bool = False) -> tuple[Wire, Wire]:
    """``(inner, outer)``: how the inner exchange's q, k, v travel (kept for the
    backward) and how the outer ring's K/V blocks do (the halo's are decoded as they
    arrive and kept: :func:`jax_seqpar.strategies.halo.pull`; the ring's backward
    recomputes scores from its blocks, so serves both passes)."""
    inner = Wire.of(options.compute, like, saved=True)
    outer = Wire(None, inner.like) if reach is not None else Wire.of(
        options.compute, like, backward=backward, saved=backward)
    return inner, outer


def kernel_calls(blocks: list[np.ndarray], size: int, sizes: tuple[int, ...]
                 ) -> list[list[KernelCall]]:
    """The kernel calls of one ring group, per ring step, as :func:`ring_pieces` runs them.

    Args:
      blocks: per ring step ``s`` (``O`` of them), the ``int[I*L]`` positions (device
        order) of the group whose keys the step meets: ``blocks[0]`` the group's own,
        whose queries every step takes.
      size: the inner axis' ``I``; sizes: the query pieces' local tokens.
    Returns:
      per step, its :class:`~jax_seqpar.strategies.pieces.KernelCall` s (queries and keys
      piece-major, as gathered). Step 0: the keys first, then each query piece against
      every own key; its backward, each piece's dq, then the own keys' dK/dV from every
      query. Middle steps: every query against the block, both passes. Last step: each
      query piece against the block; backward, the block's dK/dV, then each piece's dq.
    """
    kv_sizes = (sizes[0],) * (sum(sizes) // sizes[0])
    queries = cut_positions(blocks[0], size, sizes)
    all_queries = np.concatenate(queries)
    own_keys = cut_positions(blocks[0], size, kv_sizes)
    steps = [[KernelCall(queries[0], kv, "forward") for kv in own_keys]
             + [KernelCall(q, np.concatenate(own_keys), "forward") for q in queries[1:]]
             + [KernelCall(q, np.concatenate(own_keys), "dq") for q in queries]
             + [KernelCall(all_queries, np.concatenate(own_keys), "dkv")]]
    for step, block in enumerate(blocks[1:], start=1):
        keys = np.concatenate(cut_positions(block, size, kv_sizes))
        if step < len(blocks) - 1:
            steps.append([KernelCall(all_queries, keys, "forward"),
                          KernelCall(all_queries, keys, "all")])
        else:
            steps.append([KernelCall(q, keys, "forward") for q in queries]
                         + [KernelCall(all_queries, keys, "dkv")]
                         + [KernelCall(q, keys, "dq") for q in queries])
    return steps
