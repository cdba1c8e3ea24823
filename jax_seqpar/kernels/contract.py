"""The kernel contract, in one place: what every local attention kernel takes and returns.

A kernel (:mod:`.xla`, :mod:`.pallas`, :mod:`.mosaic`; :mod:`jax_seqpar.kernels.lowering`
calls the one of the platform lowered for) is a :class:`Kernel`:

* ``forward(q, k, v, q_tokens, kv_tokens, options, accumulate=None)`` -> ``(out
  float32[B, Sq, H, Dv], lse float32[B, Sq, H])``, where ``options`` is the call's
  :class:`~jax_seqpar.kernels.options.Options` (the mask ``spec``, ``scale``, ``softcap``, ``block_sizes``; a kernel
  ignores ``options.kernel``); a query row that sees no key gets zeros and
  ``lse = EMPTY_LSE``. ``accumulate``: the ``(out, lse)`` of earlier keys (a ring's
  running result); the result is then attention over both, exactly
  :func:`jax_seqpar.core.merge.merge` of the two. The Mosaic kernel continues it in the
  kernel, in place (its online softmax starts from it: no float32 result per step, no
  merge pass); the XLA and Pallas kernels merge after the kernel
  (:func:`merge_accumulated`);
* ``backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, accumulate=None)``
  takes the (final) ``lse`` and ``delta = sum(dout * out, -1) - dlse`` and returns
  float32 ``(dq, dk, dv)``, added to ``accumulate`` when given; strategies that
  merge partial results (the ring) call it with the statistics of the merged result;
* ``attention(q, k, v, q_tokens, kv_tokens, options)`` is both, wired by
  :func:`differentiable` as a ``custom_vjp`` that accepts cotangents for ``out`` AND ``lse``, so any composition of merges
  differentiates exactly;
* non-finite numbers in keys and values stay in the rows that see them: a query that
  sees a key whose value (or key) holds NaN or inf gets a NaN ``out`` row (and so does
  a query whose own q does); every other row and its gradients are exact, whatever the
  keys and values it cannot see hold. Every kernel's ``forward``, ``backward`` and
  ``attention`` apply :func:`isolated` / :func:`isolated_grads` to their operands
  (selects over the tokens, none per tile), and the backward kernels select ``-inf``
  into ``s - lse`` of invisible pairs. A non-finite q or ``dout`` row is not isolated
  in the backward: it may reach the ``dk, dv`` of keys its row does not see;
* ``options.softcap``: logits ``s = scale * q.k`` become ``softcap * tanh(s / softcap)``
  before masking (Gemma 2, arXiv:2408.00118);
* ``options.return_max_logit`` (QK-Clip): ``forward`` (and ``attention``) return a third
  result, ``max_logit float32[B, Sq, H]``: per query row, the largest ``s = scale * q.k``
  BEFORE the soft-cap over the keys the mask lets it see (FP8: of the products the kernel
  computed), ``-inf`` for a row that sees none; ``accumulate`` is then the triple too,
  merged by ``maximum``. It has no gradient (its cotangent is ignored). Every kernel
  computes it, as a running max of its own beside the softmax's (a static branch: nothing
  more without the flag); the Mosaic kernel continues an ``accumulate``'s max logit in
  the kernel like its softmax, the XLA and Pallas kernels merge it after;
* ``options.block_sizes``: one :class:`~jax_seqpar.kernels.options.BlockSizes` for every kernel; a size left
  ``None`` is the kernel's default for the head dims and dtype (its
  ``default_block_sizes``); :meth:`~jax_seqpar.kernels.options.Options.resolved` completes them.

Shapes: ``q [B, Sq, H, Dqk]``, ``k [B, Sk, Hkv, Dqk]``, ``v [B, Sk, Hkv, Dv]``,
``H % Hkv == 0`` (GQA/MQA), token metadata (:class:`jax_seqpar.core.masks.Tokens`)
``[B, Sq]`` and ``[B, Sk]``. This module also holds the checks the kernels share
(:func:`check_operands`, :func:`~jax_seqpar.kernels.options.check_softcap`, :func:`check_backward_operands`).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core.masks import Tokens
from jax_seqpar.kernels.options import (GPU_MIN_TILE, TPU_LANES, BlockSizes, Options,
                                        check_softcap, resolve_block_sizes)

__all__ = ["GPU_MIN_TILE", "TPU_LANES", "BlockSizes", "F32", "Kernel", "add_accumulated", "check_accumulated",
           "check_backward_operands", "check_operands", "check_softcap",
           "differentiable", "folds_vmap", "isolated", "isolated_grads", "merge_accumulated",
           "resolve_block_sizes"]

F32 = jnp.float32


def check_operands(q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens, *,
                   dtypes: Optional[Sequence] = None, kernel_name: str) -> None:
    """Raise ``ValueError`` unless the operands form one kernel call.

    Args:
      q: ``[B, Sq, H, Dqk]``; k: ``[B, Sk, Hkv, Dqk]``; v: ``[B, Sk, Hkv, Dv]``,
        ``H % Hkv == 0``.
      q_tokens, kv_tokens: metadata, each field None or ``[B, Sq]`` / ``[B, Sk]``.
      dtypes: the dtypes the kernel takes (q, k and v share one of them); None:
        any, unchecked.
      kernel_name: the kernel, for the messages.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, dim]. Got {q.shape=}, "
                         f"{k.shape=}, {v.shape=}.")
    (batch, q_len, heads, d_qk), (kv_len, kv_heads) = q.shape, k.shape[1:3]
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != d_qk:
        raise ValueError(f"k must be [{batch}, kv_seq, kv_heads, {d_qk}] and v "
                         f"[{batch}, kv_seq, kv_heads, d_v]. Got {k.shape=}, {v.shape=}.")
    if heads % kv_heads:
        raise ValueError(f"{heads=} must be a multiple of {kv_heads=} (GQA/MQA).")
    if dtypes is not None:
        dtypes = [jnp.dtype(d) for d in dtypes]
        if not q.dtype == k.dtype == v.dtype or q.dtype not in dtypes:
            raise ValueError(f"q, k, v must share one of {[str(d) for d in dtypes]} (the "
                             f"dtypes {kernel_name} takes). Got {q.dtype=}, {k.dtype=}, "
                             f"{v.dtype=}; cast them first.")
    for name, tokens, shape in (("q", q_tokens, (batch, q_len)),
                                ("kv", kv_tokens, (batch, kv_len))):
        for field in ("positions", "segment_ids", "bidirectional_ids"):
            x = getattr(tokens, field)
            if x is not None and x.shape != shape:
                raise ValueError(f"{name}_tokens.{field} must have shape {shape}. Got {x.shape}.")


def check_backward_operands(q: jax.Array, v: jax.Array, lse: jax.Array, delta: jax.Array,
                            dout: jax.Array) -> None:
    """Raise ``ValueError`` unless ``lse, delta`` are ``[B, Sq, H]`` and ``dout``
    ``[B, Sq, H, Dv]`` for ``q [B, Sq, H, Dqk]`` and ``v [.., Dv]``."""
    rows, dout_shape = q.shape[:3], q.shape[:3] + v.shape[3:]
    if lse.shape != rows or delta.shape != rows or dout.shape != dout_shape:
        raise ValueError(f"lse and delta must be {rows} and dout {dout_shape}. Got "
                         f"{lse.shape=}, {delta.shape=}, {dout.shape=}.")


def check_accumulated(q: jax.Array, v: jax.Array, accumulate: tuple[jax.Array, ...] | None,
                      options: Options) -> None:
    """Raise ``ValueError`` unless ``accumulate`` is None or a forward's running result
    ``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])`` for ``q`` and ``v``, with
    ``max_logit float32[B, Sq, H]`` last exactly when ``options.return_max_logit``."""
    if accumulate is None:
        return
    rows = q.shape[:3]
    shapes: tuple = (rows + v.shape[3:], rows)
    names = "(out float32{}, lse float32{})"
    if options.return_max_logit:
        shapes, names = (*shapes, rows), "(out float32{}, lse float32{}, max_logit float32{})"
    if (not isinstance(accumulate, (tuple, list)) or len(accumulate) != len(shapes)
            or any(tuple(x.shape) != shape or x.dtype != F32
                   for x, shape in zip(accumulate, shapes))):
        got = [(tuple(x.shape), str(x.dtype)) for x in accumulate] if isinstance(
            accumulate, (tuple, list)) else accumulate
        raise ValueError(
            f"accumulate must be {names.format(*(list(x) for x in shapes))}, the result over "
            f"earlier keys of a call with options.return_max_logit="
            f"{options.return_max_logit}. Got {got}.")


def isolated(q: jax.Array, k: jax.Array, v: jax.Array):
    """``(q, k, v)`` as a forward computes them: a key whose value holds a non-finite
    number gets value zero and key NaN.

    A tile computes ``P @ V`` for every pair, and ``0 * NaN`` is NaN: a bad value would
    reach rows that cannot see it (other documents). A NaN key instead makes the scores
    of the rows that see it NaN, and only theirs (invisible scores are selected away):
    those rows' outputs are NaN, every other row is exact. One select over the keys
    (``O(Sk * D)``), nothing per tile; finite inputs are unchanged.
    """
    return (q, *isolated_keys(k, v))


def isolated_keys(k: jax.Array, v: jax.Array):
    """``(k, v)`` of :func:`isolated`, for any leading shape (``[..., Sk, D]``: whole
    arrays, or a Mosaic kernel's tile in VMEM, hence compare and broadcast only)."""
    bad = jnp.max(jnp.where(jnp.abs(v.astype(jnp.float32)) < jnp.inf, 0.0, 1.0), axis=-1,
                  keepdims=True)  # 1 where a value of the key is not finite
    return (jnp.where(jnp.broadcast_to(bad, k.shape) > 0, jnp.asarray(jnp.nan, k.dtype), k),
            jnp.where(jnp.broadcast_to(bad, v.shape) > 0, jnp.zeros((), v.dtype), v))


def finite(x: jax.Array) -> jax.Array:
    """``x`` with its non-finite numbers at zero (the backward's k and v)."""
    return jnp.where(jnp.abs(x.astype(jnp.float32)) < jnp.inf, x, jnp.zeros((), x.dtype))


def isolated_stats(lse: jax.Array, delta: jax.Array):
    """``(lse, delta)`` of :func:`isolated_grads`: a row where either is non-finite gets
    ``lse = NaN``, ``delta = 0`` (any shape: whole arrays or a kernel's tile)."""
    bad = ~((jnp.abs(lse) < jnp.inf) & (jnp.abs(delta) < jnp.inf))
    return jnp.where(bad, jnp.nan, lse), jnp.where(bad, 0.0, delta)


def isolated_grads(k: jax.Array, v: jax.Array, lse: jax.Array, delta: jax.Array):
    """``(k, v, lse, delta)`` as a backward computes them: non-finite numbers of k and v
    at zero; a query row whose ``lse`` or ``delta`` is non-finite (its output was NaN:
    it saw a non-finite value) gets ``lse = NaN`` and ``delta = 0``.

    The backward's products (``dO @ V^T``, ``dS @ K``) multiply the zeros of invisible
    pairs by every key of the tile, so k and v enter them finite; the kernels select
    ``-inf`` into ``s - lse`` of invisible pairs before ``exp``, so a NaN ``lse`` makes
    NaN exactly the probabilities of the pairs its row sees, and with ``delta = 0``
    ``dS = P * (dP - delta)`` is zero off them. That row's ``dq`` and the ``dk, dv`` of
    the keys it sees are NaN, every other gradient is exact. Selects over the keys and
    the rows' statistics, nothing per tile; finite inputs are unchanged.
    """
    return (finite(k), finite(v), *isolated_stats(lse, delta))


def merge_accumulated(result: tuple[jax.Array, jax.Array],
                      accumulate: tuple[jax.Array, jax.Array] | None):
    """A forward's ``(out, lse)`` merged with ``accumulate`` (earlier keys') when given."""
    if accumulate is None:
        return result
    from jax_seqpar.core.merge import merge_results

    return merge_results(tuple(accumulate), tuple(result))


def add_accumulated(grads: tuple[jax.Array, ...],
                    accumulate: tuple[jax.Array, ...] | None) -> tuple[jax.Array, ...]:
    """``grads`` (float32, e.g. ``(dq, dk, dv)`` or ``(dk, dv)``) plus ``accumulate``
    (as many arrays, same shapes) when it is given."""
    if accumulate is None:
        return grads
    return tuple(total + g for total, g in zip(accumulate, grads))


def _has_arrays(tree) -> bool:
    return any(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree.leaves(tree))


_DYNAMIC = object()  # an operand's place among the static arguments


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _traced_once(impl, statics, static_items, dynamic_args, dynamic_kwargs):
    """``impl`` called with its static arguments in place, traced once per operand
    shapes and static arguments (``jit``'s cache: a pipeline's pieces of one size, and
    the branches ``platform_dependent`` stages for every platform, trace each kernel
    once, not once per call)."""
    merged = (given if static is _DYNAMIC else static
              for static, given in zip(statics, dynamic_args))
    return impl(*merged, **dynamic_kwargs, **dict(static_items))


def folds_vmap(impl: Callable) -> Callable:
    """``impl`` whose array operands all lead with the batch axis (``[B, ...]``), made to
    fold a ``jax.vmap`` axis into that batch axis: one kernel call on ``[V*B, ...]``.

    Without it ``vmap`` would batch the kernel's internals: a Pallas call by a loop (whose
    carry, inside ``shard_map``, fails the varying-axes check), the XLA kernel's tile
    ``switch`` by computing every branch (no tile skipped). Arguments holding arrays
    (``accumulate`` too) are operands; the others (the :class:`~jax_seqpar.kernels.options.Options`, flags, None)
    are static.
    """

    @functools.wraps(impl)
    def folded(*args, **kwargs):
        is_dynamic = tuple(_has_arrays(x) for x in args)
        dynamic_args = tuple(x if dynamic else None for x, dynamic in zip(args, is_dynamic))
        dynamic_kwargs = {name: x for name, x in kwargs.items() if _has_arrays(x)}
        static_kwargs = {name: x for name, x in kwargs.items() if name not in dynamic_kwargs}

        statics = tuple(_DYNAMIC if dynamic else x for x, dynamic in zip(args, is_dynamic))
        static_items = tuple(sorted(static_kwargs.items()))

        def apply(fn, dynamic_args, dynamic_kwargs):
            if fn is impl and _hashable((statics, static_items)):
                return _traced_once(impl, statics, static_items, dynamic_args, dynamic_kwargs)
            merged = (given if dynamic else x
                      for x, given, dynamic in zip(args, dynamic_args, is_dynamic))
            return fn(*merged, **dynamic_kwargs, **static_kwargs)

        # Unbatched, the kernel is traced once per signature (no frame in between).
        once = _hashable((statics, static_items))
        call = jax.custom_batching.custom_vmap(
            functools.partial(_traced_once, impl, statics, static_items) if once else
            functools.partial(apply, impl))

        @call.def_vmap
        def rule(axis_size, in_batched, *operands):
            operands = jax.tree.map(
                lambda x, batched: x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)),
                operands, tuple(in_batched))
            operands = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), operands)
            out = apply(folded, *operands)  # [V*B, ...]; nested vmaps fold again
            out = jax.tree.map(lambda x: x.reshape(axis_size, -1, *x.shape[1:]), out)
            return out, jax.tree.map(lambda _: True, out)

        return call(dynamic_args, dynamic_kwargs)

    return folded


def differentiable(forward_impl: Callable, backward_impl: Callable) -> Callable:
    """The kernels' ``attention``: ``forward_impl`` with ``backward_impl`` as its VJP.

    Args:
      forward_impl: ``(q, k, v, q_tokens, kv_tokens, *static) -> (out f32, lse f32)``,
        or ``(out, lse, max_logit f32)`` (``Options.return_max_logit``: the third has no
        gradient, its cotangent is ignored).
      backward_impl: ``(q, k, v, q_tokens, kv_tokens, lse, delta, dout, *static)
        -> float32 (dq, dk, dv)``.
    Returns:
      ``attention_impl(q, k, v, q_tokens, kv_tokens, *static) -> (out, lse)``,
      differentiable in q, k, v with cotangents for ``out`` AND ``lse``. ``static``
      (the resolved :class:`~jax_seqpar.kernels.options.Options`, and what else a kernel needs, such as Pallas'
      ``interpret``) must be hashable: both impls get it as given. The residuals are
      ``q, k, v``, the token metadata, ``out`` in the input dtype (half the activation
      memory of float32 in bf16 training) and ``lse`` in float32; the backward computes
      ``delta = sum(dout * out, -1) - dlse`` in float32, casts the gradients to the
      input dtypes, and gives the token metadata no gradient.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attention_vjp(static, q, k, v, q_tokens, kv_tokens):
        return forward_impl(*isolated(q, k, v), q_tokens, kv_tokens, *static)

    def attention_fwd(static, q, k, v, q_tokens, kv_tokens):
        result = forward_impl(*isolated(q, k, v), q_tokens, kv_tokens, *static)
        out, lse = result[:2]  # a third result, the max logit, has no gradient
        return result, (q, k, v, q_tokens, kv_tokens, out.astype(q.dtype), lse)

    def attention_bwd(static, residuals, cotangents):
        q, k, v, q_tokens, kv_tokens, out, lse = residuals
        dout, dlse = cotangents[:2]
        delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(F32), out.astype(F32),
                           precision=jax.lax.Precision.HIGHEST) - dlse
        k_clean, v_clean, lse, delta = isolated_grads(k, v, lse, delta)
        dq, dk, dv = backward_impl(q, k_clean, v_clean, q_tokens, kv_tokens, lse, delta, dout,
                                   *static)
        no_grad = jax.tree.map(lambda _: None, (q_tokens, kv_tokens))
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad)

    attention_vjp.defvjp(attention_fwd, attention_bwd)

    def attention_impl(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *static):
        return attention_vjp(static, q, k, v, q_tokens, kv_tokens)

    return attention_impl


class Kernel(Protocol):
    """What a kernel module offers (:mod:`jax_seqpar.kernels.xla`,
    :mod:`jax_seqpar.kernels.gpu.pallas`, :mod:`jax_seqpar.kernels.tpu.mosaic`), which
    :mod:`jax_seqpar.kernels.lowering` calls for the platform a program is lowered for.

    Every kernel reads its options from one :class:`~jax_seqpar.kernels.options.Options` (``softcap=None``: no
    soft-capping) and ignores ``options.kernel``; kernels may take more keywords (the
    Pallas kernel's ``interpret``).
    """

    # Read-only members: a kernel module's constants, or a per-platform choice's
    # properties.
    @property
    def BlockSizes(self) -> type[BlockSizes]:  # noqa: N802 - the modules' class name
        """The tile-size class, :class:`~jax_seqpar.kernels.options.BlockSizes` for every kernel."""

    @property
    def DTYPES(self) -> Optional[tuple]:  # noqa: N802 - the modules' constant
        """The input dtypes the kernel takes (q, k and v share one); None for any float."""

    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
                options: Options, accumulate: tuple[jax.Array, jax.Array] | None = None):
        """``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])`` of ``q [B, Sq, H, Dqk]``
        against ``k [B, Sk, Hkv, Dqk]``, ``v [B, Sk, Hkv, Dv]`` under ``options`` (the
        call's :class:`jax_seqpar.kernels.options.Options`), merged with ``accumulate``
        (the ``(out, lse)`` of earlier keys) when given; with
        ``options.return_max_logit`` the triple ``(out, lse, max_logit float32[B, Sq,
        H])``, ``accumulate`` too."""

    def backward(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
                 kv_tokens: Tokens, lse: jax.Array, delta: jax.Array, dout: jax.Array,
                 options: Options, accumulate: tuple[jax.Array, jax.Array] | None = None):
        """float32 ``(dq [B, Sq, H, Dqk], dk [B, Sk, Hkv, Dqk], dv [B, Sk, Hkv, Dv])``
        given ``lse, delta float32[B, Sq, H]`` (``delta = sum(dout * out, -1) - dlse``)
        and ``dout [B, Sq, H, Dv]``, plus ``accumulate`` when given."""

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
                  kv_tokens: Tokens, options: Options):
        """Differentiable :meth:`forward` (cotangents for ``out`` and ``lse``)."""
