"""Ulysses' exchange pipelined over head groups, around a stage (a kernel, or the ring).

The ``H/P`` heads a device receives after the all-to-all are cut into ``G`` groups, each
with its own all-to-alls and kernel call, so the exchange of group ``g + 1``'s inputs and of
group ``g - 1``'s output run while the kernel works on group ``g``. What cannot hide is the
first group's inputs, the last group's output and, when fewer K/V heads arrive than groups
(one K/V head serving several groups), the K/V exchanged once ahead of group 0:
``(G - 1) / G`` of the traffic with a K/V head per group, less with shared K/V (2 query heads and 1 K/V
head per device, ``G = 2``: a third of the forward's bytes). The backward (a ``custom_vjp``)
is the reverse pipeline: ``dout`` of group ``g + 1`` and the gradients of group ``g - 1``
travel while the kernel computes group ``g``'s. It saves each group's heads-sharded q, k, v
and log-sum-exp and the sequence-sharded output as returned (input dtype); the kernel's
``delta`` comes from ``<dout, out>`` of the rows, computed sequence-sharded and sent
(float32, every group's in one exchange ahead of group 0's ``dout``) instead of keeping a
heads-sharded copy of the output.

XLA:TPU runs all-to-alls synchronously unless compiled with
``xla_tpu_enable_async_all_to_all=true`` (:data:`jax_seqpar.tools.targets.COMPILE_OPTIONS`,
which the package's target compiles pass; pass them to your own
``jax.jit(...).lower(...).compile(compiler_options=...)`` or ``LIBTPU_INIT_ARGS``), and
for every group's exchange to enclose a kernel it needs
:data:`jax_seqpar.tools.targets.TPU_HEAD_GROUP_OPTIONS` besides (not a default: it
raises the sequence pieces' memory). XLA:GPU's all-to-all is asynchronous by default.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, cast

import jax
import jax.numpy as jnp

from jax_seqpar import kernels
from jax_seqpar.core import compat as _compat
from jax_seqpar.core.masks import Tokens
from jax_seqpar.core.merge import with_sinks
from jax_seqpar.strategies.heads import head_group_counts, held_max_logit
from jax_seqpar.strategies.inputs import Operands, Options, axis_size
from jax_seqpar.strategies.wire import Wire

__all__ = ["KernelStage", "head_pipeline", "heads_to_seq", "no_gradient",
           "seq_to_heads", "sink_cotangents", "sink_gradient"]


def seq_to_heads(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """``[B, S/P, h, D] -> [B, S, h/P, D]`` (all-to-all over ``axis_name``)."""
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """``[B, S, h/P, D] -> [B, S/P, h, D]`` (all-to-all over ``axis_name``)."""
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


@dataclasses.dataclass(frozen=True)
class KernelStage:
    """The attention one head group runs between its all-to-alls: the local kernel.

    A stage has ``forward(q, k, v, q_tokens, kv_tokens) -> ((out f32, lse f32),
    residuals)`` and ``backward(residuals, q_tokens, kv_tokens, dout, dlse, delta) ->
    (dq, dk, dv)`` on ``[B, S, h, D]`` heads-sharded operands, where ``delta = sum(dout *
    out, -1) - dlse`` comes from the pipeline when the stage's ``takes_delta`` (the
    output is then not among its residuals: the pipeline computes it from the
    sequence-sharded output it returns, which the caller holds anyway), else None. The
    hybrid's stage is the ring.
    """

    options: Options
    takes_delta = True

    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
                kv_tokens: Tokens):
        result = kernels.forward(self.options, q, k, v, q_tokens, kv_tokens)
        return result, (q, k, v, result[1])  # (out, lse[, row max logits]), residuals

    def backward(self, residuals: tuple, q_tokens: Tokens, kv_tokens: Tokens, dout: jax.Array,
                 dlse: Optional[jax.Array], delta: jax.Array):
        q, k, v, lse = residuals
        return kernels.backward(self.options, q, k, v, q_tokens, kv_tokens, lse, delta,
                                     dout.astype(q.dtype))


def head_pipeline(axis_name: str | tuple[str, ...], stage: Any, q: jax.Array, k: jax.Array,
                  v: jax.Array, operands: Operands, *, groups: int, return_lse: bool = False):
    """Ulysses' exchange around ``stage``, pipelined over ``groups`` head groups.

    Args:
      axis_name: the all-to-all's mesh axis (or axes), of size P.
      stage: what runs on each group's heads-sharded operands (:class:`KernelStage`, or
        the hybrid's ring).
      q: ``[B, S/P, H, Dqk]``; k, v: ``[B, S/P, Hkv', D]`` with ``Hkv'`` a multiple of P
        (replicated with :func:`jax_seqpar.strategies.heads.kv_replication`) local sequence shards.
      operands: the whole sequence's metadata
        (:func:`jax_seqpar.strategies.inputs.gather_tokens`) and the ``[H/P]`` sink
        logits of this device's heads (:func:`jax_seqpar.strategies.heads.local_heads`),
        or None.
      groups: a count of :func:`jax_seqpar.strategies.heads.head_group_counts`.
      return_lse: also return the float32 ``[B, S/P, H]`` log-sum-exp.
    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype`` (and the log-sum-exp), differentiable in q, k, v
      and ``sinks``; last, where the stage returns them (``return_max_logit``), the max
      logits of this device's heads as rows ``float32[B, S/P, H]``
      (:func:`~jax_seqpar.strategies.heads.held_max_logit`: nothing sent for them; no
      gradient).
    """
    layout = _HeadGroups.of(q, k, axis_size(axis_name), groups)
    config = (axis_name, stage, layout, bool(return_lse))
    out, lse, *high = _pipeline(config, q, k, v, operands)
    result = (out,) + ((lse,) if return_lse else ()) + tuple(high)
    return result if len(result) > 1 else out


@dataclasses.dataclass(frozen=True)
class _HeadGroups:
    """How the local heads split into groups: ``size`` devices, ``groups`` groups of
    ``q_group`` query heads; ``kv_group`` K/V heads per group, or 0 when the K/V heads
    are shared by several groups (exchanged once; group ``g`` reads K/V head
    ``g // (groups // kv_local)``); ``kv_dtype``: the dtype of the K/V given (sent in
    q's dtype; their gradients go back in ``kv_dtype``: float32 for replicated K/V)."""

    size: int
    groups: int
    q_group: int
    kv_local: int
    kv_dtype: object = None

    @classmethod
    def of(cls, q, k, size, groups):
        q_local, kv_local = q.shape[2] // size, k.shape[2] // size
        allowed = head_group_counts(q.shape[2], k.shape[2], size)  # k: replicated
        if groups not in allowed:
            raise ValueError(f"groups={groups} does not split the {q_local} query heads and "
                             f"{kv_local} K/V head(s) per device into whole GQA groups; use "
                             f"one of {allowed} (head_group_counts).")
        return cls(size, groups, q_local // groups, kv_local, jnp.dtype(k.dtype))

    @property
    def kv_group(self) -> int:
        return self.kv_local // self.groups if self.kv_local % self.groups == 0 else 0

    def kv_head(self, g: int) -> int:
        """The shared K/V head group ``g`` reads (``kv_group == 0``)."""
        return g // (self.groups // self.kv_local)

    def take(self, x, g):
        """Group ``g``'s heads of every destination of a sequence shard ``[B, S/P, N, ...]``:
        ``[B, S/P, P * N / (P G), ...]`` (the all-to-all then sends each device its own)."""
        if self.groups == 1:
            return x
        b, s, n = x.shape[:3]
        x = x.reshape(b, s, self.size, self.groups, n // (self.size * self.groups),
                      *x.shape[3:])
        return x[:, :, :, g].reshape(b, s, n // self.groups, *x.shape[5:])

    def put(self, parts):
        """Inverse of :meth:`take`: every group's ``[B, S/P, N/G, ...]`` -> ``[B, S/P, N, ...]``."""
        if self.groups == 1:
            return parts[0]
        b, s, n = parts[0].shape[:3]
        rest = parts[0].shape[3:]
        parts = [p.reshape(b, s, self.size, n // self.size, *rest) for p in parts]
        return jnp.stack(parts, axis=3).reshape(b, s, n * self.groups, *rest)


def _exchange_in(axis_name, layout, g, q, k, v, shared_kv):
    """Group ``g``'s heads-sharded ``(q, k, v)`` (``shared_kv``: the K/V already there),
    as they travel (:class:`~jax_seqpar.strategies.wire.Wire`: decoded where used)."""
    qg = seq_to_heads(layout.take(q, g), axis_name)
    if shared_kv is None:
        return (qg, *(seq_to_heads(layout.take(x, g), axis_name) for x in (k, v)))
    j = layout.kv_head(g)
    return (qg, *(x[:, :, j:j + 1] for x in shared_kv))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipeline(config, q, k, v, operands):
    return _pipeline_fwd(config, q, k, v, operands)[0]


def _pipeline_fwd(config, q, k, v, operands):
    axis_name, stage, layout, return_lse = config
    q_tokens, kv_tokens, sinks = operands.q_tokens, operands.kv_tokens, operands.sinks
    # The wire and the stage: q's dtype, or the call's compute dtype (the stage keeps
    # what arrived for the backward, so in one that serves both passes).
    wire = Wire.of(stage.options.compute, q.dtype, saved=True)
    like = q.dtype
    q, k, v = (wire.encode(x.astype(like)) for x in (q, k, v))
    shared_kv = None
    if not layout.kv_group:  # every group reads them: exchanged once, ahead of group 0
        shared_kv = (seq_to_heads(k, axis_name), seq_to_heads(v, axis_name))
    arrived = _exchange_in(axis_name, layout, 0, q, k, v, shared_kv)
    outs: list[Any] = []
    lses: list[Any] = []
    saved: list[Any] = []
    sent: Any = None  # the previous group's output (and lse) on its way back
    highs: list[Any] = []  # each group's row max logits (return_max_logit), kept here
    for g in range(layout.groups):
        stage_result, residuals = stage.forward(*(wire.decode(x) for x in arrived),
                                                q_tokens, kv_tokens)
        (out, lse), highs = stage_result[:2], highs + list(stage_result[2:])
        if sinks is not None:
            group_sinks = sinks[g * layout.q_group:(g + 1) * layout.q_group]
            saved.append((residuals, lse))
            out, lse = with_sinks(out, lse, group_sinks)
        else:
            saved.append((residuals, None))
        result = (out.astype(like), lse if return_lse else None)
        upcoming = None
        if g + 1 < layout.groups:
            upcoming = _exchange_in(axis_name, layout, g + 1, q, k, v, shared_kv)
        # The kernel's result, the next group's arrival and the last group's way back
        # pass one barrier: nothing but this group's kernel is left to schedule between
        # those transfers' starts and their ends.
        result, upcoming, sent = jax.lax.optimization_barrier((result, upcoming, sent))
        if sent is not None:
            outs.append(sent[0])
            lses.append(sent[1])
        sent = (heads_to_seq(result[0], axis_name),
                None if result[1] is None else heads_to_seq(result[1][..., None], axis_name))
        arrived = upcoming
    outs.append(sent[0])
    lses.append(sent[1])
    out = layout.put(outs)  # [B, S/P, H, Dv]
    lse = layout.put(lses)[..., 0] if return_lse else None
    high = (held_max_logit(highs, axis_name, out.shape[:3], groups=True),) if highs else ()
    # The output is saved as returned (sequence-sharded, input dtype): what the caller
    # holds anyway, and all the backward needs of it.
    return (out, lse, *high), (saved, operands, out)


def _pipeline_bwd(config, residuals, cotangents):
    axis_name, stage, layout, return_lse = config
    saved, operands, out = residuals
    q_tokens, kv_tokens, sinks = operands.q_tokens, operands.kv_tokens, operands.sinks
    # Nothing of the backward before the whole forward: a group's backward needs only
    # its own residuals, and where the cotangent does not depend on the output (a
    # given cotangent, as in a benchmark's program) XLA would otherwise interleave the
    # two passes and hold both passes' buffers at once.
    cotangents, saved = jax.lax.optimization_barrier((cotangents, saved))
    dout, dlse = cotangents[:2]
    dtype, kv_dtype = dout.dtype, layout.kv_dtype
    # <dout, out> of the output rows, sequence-sharded (out as returned): the kernel's
    # delta and the sinks' gradient. With the lse's cotangent, the float32 row
    # statistics of every group travel in ONE small exchange, ahead of group 0's dout
    # (exposed anyway), so that only dout itself is in flight while a kernel runs.
    rowdot = None
    if stage.takes_delta or sinks is not None:
        rowdot = jnp.einsum("bshd,bshd->bsh", dout.astype(jnp.float32),
                            out.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    stats = {name: x for name, x in (("rowdot", rowdot),
                                     ("dlse", dlse if return_lse else None)) if x is not None}
    if stats:
        stacked = seq_to_heads(jnp.stack(list(stats.values()), axis=-1),
                               axis_name)  # [B, S, H/P, len(stats)]
        rows = dict(zip(stats, jnp.moveaxis(stacked, -1, 0)))  # name -> [B, S, H/P]

    def rows_of(name, g):  # this group's [B, S, h] of a row statistic, or None
        if name not in stats:
            return None
        return rows[name][:, :, g * layout.q_group:(g + 1) * layout.q_group]

    wire = Wire.of(stage.options.compute, dtype, backward=True)  # dout, as the kernel takes it
    sending = wire.encode(dout)  # once: each group sends its heads of it

    def exchange_in(g):
        return seq_to_heads(layout.take(sending, g), axis_name)

    arrived = exchange_in(0)
    back: list[Any] = []
    row_dsinks: list[jax.Array] = []  # the sinks' gradient of each group
    sent: Any = None  # the previous group's gradients on their way back
    shared: list[Any] = [None] * layout.kv_local
    for g in range(layout.groups):
        # The previous group's dK/dV sums are done before this group's kernel starts:
        # two float32 pairs are never live at once.
        arrived, shared = jax.lax.optimization_barrier((arrived, shared))
        dout_g, dlse_g, rowdot_g = wire.decode(arrived), rows_of("dlse", g), rows_of("rowdot", g)
        stage_residuals, lse_g = saved[g]
        if dlse_g is None:
            dlse_g = _compat.match_varying(jnp.zeros(dout_g.shape[:3], jnp.float32), dout_g)
        delta_g = None if rowdot_g is None else rowdot_g - dlse_g
        if sinks is not None:
            heads = slice(g * layout.q_group, (g + 1) * layout.q_group)
            dout_g, dlse_g, delta_g, dsink = sink_cotangents(dout_g, dlse_g, rowdot_g, lse_g,
                                                             operands, heads)
            row_dsinks.append(dsink)
        grads = stage.backward(stage_residuals, q_tokens, kv_tokens, dout_g, dlse_g,
                               delta_g if stage.takes_delta else None)  # float32
        upcoming = exchange_in(g + 1) if g + 1 < layout.groups else None
        # As in the forward: group g+1's dout arrives and group g-1's gradients leave
        # while this group's backward kernel runs. The barrier takes the kernel's RAW
        # result: with a cast between kernel and barrier, XLA:TPU hides the transfers
        # behind the cast instead of the kernel.
        grads, upcoming, sent = jax.lax.optimization_barrier((grads, upcoming, sent))
        if sent is not None:
            back.append(sent)
        if layout.kv_group:
            result = (grads[0].astype(dtype), *(x.astype(kv_dtype) for x in grads[1:]))
        else:
            # A shared K/V head's gradients, summed over the groups it serves: each sum in
            # float32, kept between groups in the K/V's dtype (as the reduction an
            # autodiff backward would run on the cotangents).
            result = (grads[0].astype(dtype),)
            j = layout.kv_head(g)
            shared[j] = tuple((x if total is None else x + total.astype(jnp.float32)).astype(
                kv_dtype) for x, total in zip(grads[1:], shared[j] or (None, None)))
        sent = tuple(heads_to_seq(x, axis_name) for x in result)
        arrived = upcoming
    back.append(sent)
    dq = layout.put([x[0] for x in back])
    if layout.kv_group:
        dk, dv = layout.put([x[1] for x in back]), layout.put([x[2] for x in back])
    else:  # the shared K/V's gradients go back once, after the last group
        dk, dv = (heads_to_seq(jnp.concatenate([s[i] for s in shared], axis=2).astype(kv_dtype),
                               axis_name) for i in (0, 1))
    dsinks = None if sinks is None else sink_gradient(jnp.concatenate(row_dsinks), operands)
    return dq, dk, dv, no_gradient(operands, dsinks)


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)


def sink_cotangents(dout: jax.Array, dlse: jax.Array, rowdot: jax.Array, lse: jax.Array,
                    operands: Operands, heads: slice = slice(None)):
    """The kernel's cotangents of rows whose result went through
    :func:`jax_seqpar.core.merge.with_sinks`, and the sinks' gradient of these rows.

    ``out' = w out``, ``lse' = logaddexp(lse, sink)``, ``w = exp(lse - lse')``: ``d out =
    w d out'``, ``d lse = w d lse' + (1 - w) <d out', out'>``, so ``delta = <d out, out> -
    d lse = w (<d out', out'> - d lse')``; ``d sink`` sums ``(1 - w) (d lse' - <d out',
    out'>)`` over the rows.

    Args:
      dout: ``[B, S, h, Dv]`` cotangent of the output with sinks; dlse, rowdot, lse:
        float32 ``[B, S, h]`` (``rowdot = <dout, out'>``, ``lse`` without sinks);
      operands: their sink logits, of which ``heads`` are these rows' ``[h]``.
    Returns:
      ``(dout float32, dlse, delta, dsinks float32[h])`` for the kernel without sinks.
    """
    sink = cast(jax.Array, operands.sinks)[heads].astype(jnp.float32)
    w = jnp.exp(lse - jnp.logaddexp(lse, sink.reshape(1, 1, -1)))
    dsinks = jnp.sum((1 - w) * (dlse - rowdot), axis=(0, 1))
    return (dout.astype(jnp.float32) * w[..., None], w * dlse + (1 - w) * rowdot,
            w * (rowdot - dlse), dsinks)


def sink_gradient(dsinks: jax.Array, operands: Operands) -> jax.Array:
    """The gradient of ``operands.sinks`` summed over every row: this device's, and those
    of the devices that share its heads along the axes the sinks do not vary over (the
    hybrid's ring, a batch axis), as the transpose of an implicit pvary would; in the
    sinks' dtype."""
    sinks = cast(jax.Array, operands.sinks)  # only called where the call has sinks
    extra = _compat.varying_axes(dsinks) - _compat.varying_axes(sinks)
    if extra:
        dsinks = jax.lax.psum(dsinks, tuple(sorted(extra)))
    return dsinks.astype(sinks.dtype)


def no_gradient(operands: Operands, dsinks: Optional[jax.Array]) -> Operands:
    """The cotangent of ``operands``: none for the token metadata, ``dsinks`` for the sinks."""
    return Operands(jax.tree.map(lambda _: None, operands.q_tokens),
                    jax.tree.map(lambda _: None, operands.kv_tokens), dsinks)
