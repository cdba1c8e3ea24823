"""Ulysses' exchange pipelined along the sequence: the keys first, then the queries.

Each device cuts its ``L = S/P`` local tokens twice (``u = L/2^(c-1)``,
:func:`jax_seqpar.strategies.heads.chunk_sizes`): its K/V into ``2^(c-1)`` pieces of ``u``
tokens, its queries into pieces ``u, L/4, L/4, L/4, L/8, ..., 2u, u`` (halving from ``L/2``,
pieces over ``L/4`` cut into quarters). A piece's all-to-all brings the ``P``
devices' piece for this device's ``H/P`` heads (their positions and segment ids travel with
them: any token order is exact).

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

from jax_seqpar.core.merge import with_sinks
from jax_seqpar.strategies.head_pipeline import (heads_to_seq, no_gradient, seq_to_heads,
                                                 sink_cotangents, sink_gradient)
from jax_seqpar.strategies.inputs import Operands, Options, axis_size

__all__ = ["chunk_pipeline"]


def chunk_pipeline(axis_name: str | tuple[str, ...], options: Options, q: jax.Array, k: jax.Array,
                   v: jax.Array, operands: Operands, *, sizes: tuple,
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
      sizes: local tokens of each query piece, summing to ``L``; the K/V pieces have
        ``sizes[0]`` each (:func:`jax_seqpar.strategies.heads.chunk_sizes`).
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


def _send(to_heads, to_seq, axis_name, size):
    """ONE all-to-all for pieces going both ways (XLA runs one asynchronous all-to-all at
    a time: two around a kernel would leave one exposed): :func:`seq_to_heads` of each
    ``[B, s, n, D]`` of ``to_heads`` (``-> [B, P*s, n/P, D]``) and :func:`heads_to_seq` of
    each ``[B, P*s, n, D]`` of ``to_seq`` (``-> [B, s, P*n, D]``), every piece flattened
    per destination device and packed along the features. Pieces of different dtypes
    go in one all-to-all per dtype.

    Returns ``(raw, unpack)``: what the all-to-all returned and ``unpack(raw) -> (heads,
    seq)``. The pipelines pass ``raw`` through the barrier that closes a step and unpack
    after it: nothing reads the transfer before the barrier, so its end is scheduled
    after the step's kernel.
    """
    arrays = [*to_heads, *to_seq]
    if not arrays:
        return [], lambda raw: ([], [])
    if len({x.dtype for x in arrays}) > 1:
        raw = ([seq_to_heads(x, axis_name) for x in to_heads]
               + [heads_to_seq(x, axis_name) for x in to_seq])
        return raw, lambda raw: (raw[:len(to_heads)], raw[len(to_heads):])
    b = arrays[0].shape[0]
    flat = [jnp.moveaxis(x.reshape(b, x.shape[1], size, -1), 2, 1).reshape(b, size, -1)
            for x in to_heads]  # [B, P (destination), s * n/P * D]
    flat += [x.reshape(b, size, -1) for x in to_seq]  # [B, P (destination), s * n * D]
    widths = [x.shape[-1] for x in flat]
    shapes = [x.shape for x in to_heads], [x.shape for x in to_seq]
    # Sent as [P, rows, 128]: the buffers tile without padding on TPU (a [B, P, width]
    # buffer with B = 1 pads its unit dimension there).
    packed = jnp.moveaxis(jnp.concatenate(flat, axis=-1), 1, 0)  # [P, B, sum of widths]
    lanes = 128 if packed[0].size % 128 == 0 else packed.shape[-1]
    packed = jax.lax.all_to_all(packed.reshape(size, -1, lanes), axis_name, split_axis=0,
                                concat_axis=0, tiled=True)  # [P (source), rows, lanes]

    def unpack(raw):
        got = jnp.moveaxis(raw[0].reshape(size, b, -1), 0, 1)  # [B, P (source), widths]
        parts = jnp.split(got, [sum(widths[:i]) for i in range(1, len(widths))], axis=-1)
        heads = [part.reshape(b, size * x[1], x[2] // size, x[3])
                 for part, x in zip(parts, shapes[0])]  # source-major: the device order
        seq = [jnp.moveaxis(part.reshape(b, size, x[1] // size, *x[2:]), 1, 2)
               .reshape(b, x[1] // size, size * x[2], x[3])
               for part, x in zip(parts[len(shapes[0]):], shapes[1])]
        return heads, seq

    return [packed], unpack


def _exchange(to_heads, to_seq, axis_name, size):
    """:func:`_send`, unpacked at once: ``(heads, seq)``."""
    raw, unpack = _send(to_heads, to_seq, axis_name, size)
    return unpack(raw)


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


def _concat(pieces):
    """Pieces along the sequence (axis 1), arrays or Tokens pytrees of them."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *pieces)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipeline(config, q, k, v, operands):
    return _pipeline_fwd(config, q, k, v, operands)[0]


def _pieces(config, operands: Operands, local_len: int):
    """``(query piece sizes, K/V piece sizes, every query piece's [B, P*s] metadata,
    every K/V piece's)``."""
    axis_name, _, sizes = config[:3]
    kv_sizes = (sizes[0],) * (local_len // sizes[0])
    size = axis_size(axis_name)
    return (sizes, kv_sizes, _chunk_tokens(operands.q_tokens, size, sizes),
            _chunk_tokens(operands.kv_tokens, size, kv_sizes))


def _pipeline_fwd(config, q, k, v, operands):
    axis_name, options, sizes, return_lse, _ = config
    k, v = (x.astype(q.dtype) for x in (k, v))
    size = axis_size(axis_name)
    sizes, kv_sizes, q_tokens, kv_tokens = _pieces(config, operands, q.shape[1])
    c, sinks = len(sizes), operands.sinks

    def exchange_in(pieces):
        return _exchange(pieces, [], axis_name, size)[0]

    def finished(result):
        """A query piece's kernel result -> what leaves (output, lse) and its lse."""
        out, lse = result
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)
        return [out.astype(q.dtype)] + ([lse[..., None]] if return_lse else []), result[1]

    # The local shards pass every barrier: piece i + 1's transfer cannot start before
    # step i - 1's kernels are done (one piece in flight, not all of them at once).
    local = (q, k, v)
    qs = [None] * c  # every query piece as it arrived (heads-sharded)
    q0, k0, v0 = exchange_in([_local(q, sizes, 0), _local(k, kv_sizes, 0),
                              _local(v, kv_sizes, 0)])
    qs[0], ks, vs = q0, [k0], [v0]
    # The keys first: piece m + 1 travels while the first query piece meets piece m.
    acc = None
    for m in range(len(kv_sizes)):
        last = m + 1 == len(kv_sizes)
        raw, unpack = _send([_local(x, kv_sizes, m + 1) for x in local[1:]] if not last
                            else [_local(local[0], sizes, 1)], [], axis_name, size)
        acc = options.forward(q0, ks[m], vs[m], q_tokens[0], kv_tokens[m], accumulate=acc)
        acc, raw, local = jax.lax.optimization_barrier((acc, raw, local))
        upcoming = unpack(raw)[0]
        if last:
            qs[1] = upcoming[0]
        else:
            ks.append(upcoming[0])
            vs.append(upcoming[1])
    keys, values, kv_all = _concat(ks), _concat(vs), _concat(kv_tokens)
    del ks, vs
    # Then the queries: piece j + 1 comes in and piece j - 1's output leaves while piece
    # j is attended to every key in one kernel call.
    pending, lse = finished(acc)
    lses: list[Any] = [lse] + [None] * (c - 1)
    sent: list[Any] = [None] * c  # per query piece: its output (and lse) as it arrived
    for j in range(1, c):
        ins = [_local(local[0], sizes, j + 1)] if j + 1 < c else []
        raw, unpack = _send(ins, pending, axis_name, size)
        result = options.forward(qs[j], keys, values, q_tokens[j], kv_all)
        result, raw, local = jax.lax.optimization_barrier((result, raw, local))
        got_in, got_out = unpack(raw)
        sent[j - 1] = got_out
        if ins:
            qs[j + 1] = got_in[0]
        pending, lses[j] = finished(result)
    sent[c - 1] = _exchange([], pending, axis_name, size)[1]
    out = _concat([s[0] for s in sent])  # [B, L, H, Dv]
    lse = _concat([s[1] for s in sent])[..., 0] if return_lse else None
    return (out, lse), (_concat(qs), keys, values, lses, operands, out)


def _pipeline_bwd(config, residuals, cotangents):
    axis_name, options, sizes, return_lse, kv_dtype = config
    queries, keys, values, lses, operands, out = residuals
    size = axis_size(axis_name)
    sizes, kv_sizes, q_tokens, kv_tokens = _pieces(config, operands, out.shape[1])
    c, sinks = len(sizes), operands.sinks
    q_all, kv_all = _concat(q_tokens), _concat(kv_tokens)
    # Nothing of the backward before the whole forward (as in the head pipeline).
    cotangents, queries, keys, values = jax.lax.optimization_barrier(
        (cotangents, queries, keys, values))
    dout, dlse = cotangents
    dtype = dout.dtype
    # <dout, out> of the rows and the lse's cotangent: float32 row statistics of every
    # piece, sent in ONE small exchange ahead of the first piece's dout.
    rowdot = jnp.einsum("bshd,bshd->bsh", dout.astype(jnp.float32), out.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    stats = jnp.stack([rowdot] + ([dlse] if return_lse else []), axis=-1)  # [B, L, H, n]
    rows = _cut(seq_to_heads(stats, axis_name), size, sizes)  # [B, P*s_j, h, n]
    q_parts = [slice(size * o, size * (o + s)) for o, s in zip(_offsets(sizes), sizes)]
    row_dsinks: list[jax.Array] = []  # the sinks' gradient of each query piece

    def cotangents_of(j, dout_j):
        """Query piece j's (dout in q's dtype, delta) for the kernel (sinks taken out)."""
        rowdot_j = rows[j][..., 0]
        dlse_j = rows[j][..., 1] if return_lse else jnp.zeros_like(rowdot_j)
        if sinks is None:
            return dout_j.astype(queries.dtype), rowdot_j - dlse_j
        dout_j, _, delta_j, ds = sink_cotangents(dout_j, dlse_j, rowdot_j, lses[j], operands)
        row_dsinks.append(ds)
        return dout_j.astype(queries.dtype), delta_j

    # dq: the query pieces smallest first, each against every key in one kernel call (its
    # dK/dV part unused: the dq kernel alone runs), the next piece's dout coming in and
    # the previous dq leaving meanwhile.
    order = [0, *reversed(range(1, c))]
    upcoming = _exchange([_local(dout, sizes, order[0])], [], axis_name, size)[0][0]
    douts: list[Any] = [None] * c
    deltas: list[Any] = [None] * c
    sent_q: list[Any] = [None] * c
    pending: list[jax.Array] = []
    for n, j in enumerate(order):
        douts[j], deltas[j] = cotangents_of(j, upcoming)
        dq = options.backward(queries[:, q_parts[j]], keys, values, q_tokens[j], kv_all,
                              lses[j], deltas[j], douts[j])[0]
        ins = [_local(dout, sizes, order[n + 1])] if n + 1 < c else []
        raw, unpack = _send(ins, pending, axis_name, size)
        # The barrier takes the kernel's raw result (a cast between would be what XLA:TPU
        # hides the transfers behind, not the kernel).
        dq, raw, dout = jax.lax.optimization_barrier((dq, raw, dout))
        got_in, got_out = unpack(raw)
        if pending:
            sent_q[order[n - 1]] = got_out[0]
        upcoming, pending = (got_in[0] if ins else None), [dq.astype(dtype)]
    # dK/dV: one K/V piece at a time against every query (the dK/dV kernel alone), each
    # final at once and leaving while the next runs (the last dq with the first).
    dout_all, delta_all, lse_all = _concat(douts), _concat(deltas), _concat(lses)
    del douts
    unit = size * kv_sizes[0]
    leaving = ("q", order[-1])
    sent_kv: list[Any] = [None] * len(kv_sizes)
    for m in range(len(kv_sizes)):
        raw, unpack = _send([], pending, axis_name, size)
        part = slice(m * unit, (m + 1) * unit)
        _, dk, dv = options.backward(queries, keys[:, part], values[:, part], q_all,
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
    sent_kv[-1] = _exchange([], pending, axis_name, size)[1]
    dq = _concat(sent_q)
    dk, dv = (_concat([s[i] for s in sent_kv]) for i in (0, 1))
    dsinks = None if sinks is None else sink_gradient(sum(row_dsinks[1:], row_dsinks[0]),
                                                      operands)
    return dq, dk, dv, no_gradient(operands, dsinks)


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)
