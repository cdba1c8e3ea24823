"""Ring attention: K/V blocks travel around the ring, queries stay.

Paper: Liu et al., Ring Attention with Blockwise Transformers, arXiv:2310.01889.

Every device keeps its query shard and, in P steps, sees every K/V shard: at
each step it sends its current K/V shard (with the shard's token metadata) to
the next device and computes attention against it, merging the partial result
into a float32 ``(out, lse)`` carry (the kernel continues the carry; see the
``accumulate`` argument of :mod:`jax_seqpar.kernels.contract`). Each step's result and
the next shard's arrival pass one ``optimization_barrier`` (:func:`shift_during`; on GPU
the shard's arrays travel as one byte buffer), so the transfer is scheduled around the
step's kernel on every backend. The backward is a second ring (a
``custom_vjp``): the forward saves only ``q, k, v, out, lse``; the backward
re-rotates K/V and carries float32 dK/dV accumulators around the ring (the
sums all in float32, so the gradients' error does not grow with P) and home, in
the input dtype once they are done, so memory stays O(S/P) per device. Each backward step computes its own fresh
dK/dV and only then adds the accumulator that arrived, so the accumulator's hop
overlaps the step's kernel. Only the ``Hkv`` heads given are sent.

With a sliding window or chunks on the contiguous split (the default positions), the
ring becomes a halo exchange (:mod:`jax_seqpar.strategies.halo`): a device receives just
the ``left`` / ``right`` tokens the mask reaches (:func:`~jax_seqpar.core.reach.mask_reach`),
not all P-1 shards, and nothing (no collective, forward or backward) where every chunk
fits a shard.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp

from jax_seqpar.core.quant import ComputeLike
from jax_seqpar import kernels
from jax_seqpar.core import compat as _compat
from jax_seqpar.strategies import halo
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.strategies.inputs import (Metadata, axis_size, describe, finish, max_logit_over,
                                          nothing_seen, shard_operands)
from jax_seqpar.strategies.wire import Wire, packed, rotated, wire_bytes
from jax_seqpar.strategies.traffic import (INDEX_BYTES, NO_MASK, accumulator_bytes, halo_bytes,
                                           layer_reach)

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.core.masks import MaskSpec, Tokens
    from jax_seqpar.core.quant import Compute
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.kernels.options import BlockSizes, KernelName, Options

__all__ = ["ENTRY", "attend", "backward_steps", "forward_steps", "in_flight_memory",
           "ring_attention", "ring_bytes", "ring_over", "rotation_bytes", "shift",
           "shift_during"]


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, seq_axes: str | tuple[str, ...],
                   causal: bool = False, segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None, window: int | tuple[int, int] | None = None,
                   scale: float | None = None, kernel: KernelName = "auto",
                   block_sizes: BlockSizes | None = None, softcap: float | None = None,
                   compute_dtype: ComputeLike = None,
                   sinks: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                   chunk_size: int | None = None, bidirectional_ids: jax.Array | None = None,
                   mask_fn: Callable | None = None, return_lse: bool = False,
                   max_document_shards: int | None = None, return_max_logit: bool = False):
    """Exact attention of a sequence sharded over ``seq_axes`` (call inside ``shard_map``).

    Args:
      q: ``[B, S/P, H, Dqk]`` this device's queries.
      k: ``[B, S/P, Hkv, Dqk]``; v: ``[B, S/P, Hkv, Dv]`` this device's keys/values.
      seq_axes: mesh axis (or tuple of axes) along which the sequence is split.
      causal, window, chunk_size, mask_fn: the mask (see
        :class:`jax_seqpar.core.masks.MaskSpec`), on global positions.
      segment_ids: ``int32[B, S/P]`` document ids of the local tokens, or None.
      positions: ``int32[B, S/P]`` global positions of the local tokens; default
        (None) is the contiguous split, and only then does a window or chunks shrink the
        ring to a halo exchange (given positions are honoured with the full ring).
      bidirectional_ids: ``int32[B, S/P]`` (needs ``causal``): tokens of one non-zero
        id see each other both ways (prefix-LM, images), or None.
      scale: defaults to ``1/sqrt(Dqk)``.
      kernel: ``"auto"``, ``"xla"``, ``"pallas"`` or ``"mosaic"`` (see
        :mod:`jax_seqpar.kernels.lowering`); block_sizes: the kernel's tiles.
      softcap: logits become ``softcap * tanh(s / softcap)`` before masking, or None.
      compute_dtype: the products' dtype, as in
        :func:`jax_seqpar.sequence_parallel_attention` (None: the inputs').
      sinks: ``[H]`` float logits of a zero-valued virtual key per head (gpt-oss),
        or None. Pass it replicated (``P()``); its gradient sums over the shards.
      kv_segment_ids: ``int32[B, S/P]`` the keys' own segment ids where they differ
        from the queries' (e.g. padded keys), or None: ``segment_ids``.
      return_lse: also return the float32 ``[B, S/P, H]`` log-sum-exp of each row
        (sinks included), for callers that merge partial results.
      return_max_logit: also return the ``float32[H]`` max logit (QK-Clip, as in
        :func:`jax_seqpar.sequence_parallel_attention`) of its rows, pmax over ``seq_axes``.

    The keywords are checked once and read into the call's
    :class:`~jax_seqpar.kernels.options.Options` and
    :class:`~jax_seqpar.strategies.inputs.Metadata`
    (:func:`jax_seqpar.strategies.inputs.describe`), then :func:`attend` runs.

    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype`` (softmax statistics and carries in float32),
      then the log-sum-exp (``return_lse``), then the max logit (``return_max_logit``).

    .. code-block:: python

        out = jax.shard_map(functools.partial(ring_attention, seq_axes="sp", causal=True),
                            mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
    """
    options, metadata = describe(
        q, k, v, local=True, causal=causal, window=window, chunk_size=chunk_size, mask_fn=mask_fn,
        scale=scale, kernel=kernel, block_sizes=block_sizes, softcap=softcap,
        compute_dtype=compute_dtype,
        return_lse=return_lse, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
        positions=positions, bidirectional_ids=bidirectional_ids, sinks=sinks,
        max_document_shards=max_document_shards, return_max_logit=return_max_logit)
    return max_logit_over(options, attend(q, k, v, options, metadata, seq_axes=seq_axes),
                          seq_axes)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, options: Options, metadata: Metadata,
           *, seq_axes: str | tuple[str, ...]):
    """The ring on described inputs (:func:`ring_attention` after its checks), the core the global
    view runs inside ``shard_map``: ``options`` and the local, checked ``metadata``
    (:func:`jax_seqpar.strategies.inputs.describe`)."""
    operands = shard_operands(q, options, metadata, seq_axes)
    options, q, k = rotated(options, q, k)  # the rotation, once: rotated K travels
    result = ring_over(seq_axes, options, q, k, v, operands.q_tokens, operands.kv_tokens,
                       contiguous=metadata.positions is None)
    return finish(options, q, result, operands)


def ring_over(axis_name: str | tuple[str, ...], options: Options, q: jax.Array, k: jax.Array,
              v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens, *, contiguous: bool = False,
              shard_len: int | None = None):
    """The ring core on prepared inputs (used by :func:`ring_attention` and the hybrid).

    Args:
      axis_name: the ring's mesh axis; options: the call's static ``Options``.
      q, k, v: ``[B, S/P, H|Hkv, D]`` local shards; q_tokens, kv_tokens: their
        metadata (the keys' travels with them).
      contiguous: the tokens' positions are known to be the contiguous split
        (``axis_index * S/P + arange``), so a window or chunks may skip unreachable
        shards (:func:`~jax_seqpar.core.reach.mask_reach`; ``max_document_shards``
        does in any order).
      shard_len: the shards ``max_document_shards`` counts (default ``S/P``).
    Returns:
      ``out float32[B, S/P, H, Dv]`` and ``lse float32[B, S/P, H]``, both
      differentiable (the backward accepts the ``lse`` cotangent); then the row max logits
      ``float32[B, S/P, H]`` with ``options.return_max_logit`` (steps merged; no gradient).
    """
    reach = halo.mask_reach(options.spec, q.shape[1], axis_size(axis_name),
                            bidirectional=q_tokens.bidirectional_ids is not None,
                            contiguous=contiguous, shard_len=shard_len)
    if reach is not None:
        return halo.halo_attention(axis_name, options, reach, q, k, v, q_tokens, kv_tokens)
    return _ring(axis_name, options, q, k, v, q_tokens, kv_tokens)


def shift(tree: Any, axis_name: str | tuple[str, ...]) -> Any:
    """Send every array in ``tree`` to the next device of the ring."""
    size = axis_size(axis_name)
    perm = [(i, (i + 1) % size) for i in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def shift_during(compute: Callable[[], Any], tree: Any, axis_name: str | tuple[str, ...]
                 ) -> tuple[Any, Any]:
    """``(compute(), shift(tree))``, the hop in flight while ``compute``'s kernels run.

    The hop's arrival and ``compute``'s result pass one ``optimization_barrier`` before
    either is used, so nothing but ``compute`` can be scheduled between the hop's start
    and its done (XLA:TPU otherwise starts the hop after a Mosaic call and hides it
    behind the merge only). Where the program is lowered for a GPU, ``tree``'s arrays
    travel as one byte buffer, passed through the barrier raw and unpacked after it:
    XLA:GPU keeps one asynchronous collective in flight at a time, so a second array's
    transfer would wait for the first's and run exposed (K and V, or K/V beside the
    dK/dV accumulator, at 16384 local tokens), and it ends a transfer whose unpacking
    feeds the barrier before the kernel. Elsewhere each array travels as it is.
    """
    def each():
        return jax.lax.optimization_barrier((compute(), shift(tree, axis_name)))

    def as_one_buffer():
        raw, unpack = packed(tree)
        result, raw = jax.lax.optimization_barrier((compute(), shift(raw, axis_name)))
        return result, unpack(raw)

    if len(jax.tree.leaves(tree)) < 2:
        return each()
    return jax.lax.platform_dependent(cuda=as_one_buffer, rocm=as_one_buffer, default=each)


def forward_steps(attend: Callable[[Any, Any], Any], acc: Any, kv: Any,
                  axis_name: str | tuple[str, ...], steps: int) -> tuple[Any, Any]:
    """``steps`` steps of a ring's forward (a scan): each ``acc = attend(acc, kv)`` while
    ``kv`` hops on (:func:`shift_during`). Returns ``(acc, kv)`` after them: the last
    block arrived, not yet attended to."""
    def step(carry, _):
        acc, kv = carry
        return shift_during(functools.partial(attend, acc, kv), kv, axis_name), None

    return jax.lax.scan(step, (acc, kv), length=steps)[0]


def backward_steps(grads: Callable[[Any, Any], Any], dq: Any, kv: Any, dkv: Any,
                   axis_name: str | tuple[str, ...], steps: int) -> tuple[Any, Any, Any]:
    """``steps`` steps of a ring's backward (a scan): each computes fresh float32 dK/dV
    (``(dq, (dk, dv)) = grads(dq, kv)``) while ``kv`` hops on and the accumulator ``dkv``
    arrives from the previous device, then adds it. Returns ``(dq, kv, dkv)``."""
    def step(carry, _):
        dq, kv, dkv = carry
        (dq, fresh), (next_kv, arrived) = shift_during(functools.partial(grads, dq, kv),
                                                       (kv, dkv), axis_name)
        return (dq, next_kv, tuple(x + y for x, y in zip(fresh, arrived))), None

    return jax.lax.scan(step, (dq, kv, dkv), length=steps)[0]


def _ring_forward(axis_name, options, q, k, v, q_tokens, kv_tokens):
    wire = Wire.of(options.compute, k.dtype)

    def attend(carry, kv):
        # The kernel continues the running (out, lse): Mosaic in the kernel, in place;
        # the XLA and Pallas kernels merge after (see jax_seqpar.kernels.contract).
        return kernels.forward(options, q, wire.decode(kv[0]), wire.decode(kv[1]), q_tokens,
                               kv[2], accumulate=carry)

    acc = _compat.match_varying(nothing_seen(options, q, v.shape[-1]), q)
    # The barrier's results vary over every axis any of its operands varies over: so
    # must the K/V carry from the start (a dp x sp mesh: K/V vary over dp, acc too).
    kv = (wire.encode(k), wire.encode(v), kv_tokens)  # K/V travel in the compute dtype
    kv = _compat.match_varying(kv, (acc, *kv))
    acc, kv = forward_steps(attend, acc, kv, axis_name, axis_size(axis_name) - 1)
    return attend(acc, kv)


def _ring_fwd(axis_name, options, q, k, v, q_tokens, kv_tokens):
    result = _ring_forward(axis_name, options, q, k, v, q_tokens, kv_tokens)
    out, lse = result[:2]  # a third result, the row max logits, has no gradient
    # The output is kept in the input dtype: what the caller returns, at its memory cost.
    return result, (q, k, v, q_tokens, kv_tokens, out.astype(q.dtype), lse)


def _ring_bwd(axis_name, options, residuals, cotangents):
    q, k, v, q_tokens, kv_tokens, out, lse = residuals
    dout, dlse = cotangents[:2]
    delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(jnp.float32),
                       out.astype(jnp.float32)) - dlse
    dout = dout.astype(q.dtype)
    # K/V serve the backward's products and its recomputed scores: one dtype for both.
    wire = Wire.of(options.compute, k.dtype, backward=True, saved=True)

    def grads(dq, kv, dkv):
        """``(dq, dkv)`` plus this step's gradients (``dkv``: float32 accumulators)."""
        dq, *dkv = kernels.backward(options, q, wire.decode(kv[0]), wire.decode(kv[1]),
                                    q_tokens, kv[2], lse, delta, dout, accumulate=(dq, *dkv))
        return dq, tuple(dkv)

    # The schedule follows the platform the program is lowered for: where collectives
    # run asynchronously (GPU, TPU) the dK/dV hop overlaps the next kernel, at the cost
    # of one more float32 dK/dV pair; XLA:CPU's collectives are synchronous, so there
    # the kernel accumulates in place.
    loop = functools.partial(_backward_ring, axis_name, grads, wire)
    dq, dk, dv = jax.lax.platform_dependent(
        q, k, v, kv_tokens, cpu=functools.partial(loop, overlap=False),
        default=functools.partial(loop, overlap=True))
    no_grad = jax.tree.map(lambda _: None, (q_tokens, kv_tokens))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad


def _backward_ring(axis_name, grads, wire, q, k, v, kv_tokens, *, overlap: bool):
    """``(dq, dk, dv)``: K/V travel the ring again (``wire``-encoded), float32 dK/dV
    accumulators follow them and take a last hop home in the input dtype (float32 dq).

    ``overlap=False``: each step accumulates into the dK/dV that arrived, then sends
    it (compute -> send -> compute). ``overlap=True``: each step computes fresh dK/dV
    while the accumulator is in flight and adds it after the kernel.
    """
    zeros = _compat.match_varying(tuple(jnp.zeros(x.shape, jnp.float32) for x in (k, v)), q)
    dq = _compat.match_varying(jnp.zeros(q.shape, jnp.float32), q)
    kv, size = (wire.encode(k), wire.encode(v), kv_tokens), axis_size(axis_name)
    if size == 1:
        dq, (dk, dv) = grads(dq, kv, zeros)
        return dq, dk, dv
    if not overlap:
        def serial_step(carry, _):
            dq, kv, dkv = carry
            next_kv = shift(kv, axis_name)
            dq, dkv = grads(dq, kv, dkv)
            return (dq, next_kv, shift(dkv, axis_name)), None

        (dq, kv, dkv), _ = jax.lax.scan(serial_step, (dq, kv, zeros), length=size - 1)
        dq, dkv = grads(dq, kv, dkv)
        return (dq, *_home(dkv, (k, v), axis_name))

    # The transfers in flight during each step's kernel (under jax.grad, XLA:TPU
    # otherwise ends them around the fusions only): K/V onward, the accumulator in.
    (dq, dkv), next_kv = shift_during(lambda: grads(dq, kv, zeros), kv, axis_name)
    dq, kv, dkv = backward_steps(lambda dq, kv: grads(dq, kv, zeros), dq, next_kv, dkv,
                                 axis_name, size - 2)
    (dq, fresh), arrived = shift_during(lambda: grads(dq, kv, zeros), dkv, axis_name)
    dkv = tuple(x + y for x, y in zip(fresh, arrived))
    return (dq, *_home(dkv, (k, v), axis_name))


def _home(dkv, like, axis_name):
    """The accumulators' last hop home, in ``like``'s dtypes: the sums are done, so
    rounding before the hop is rounding after it, at the input dtype's bytes."""
    return shift(tuple(x.astype(y.dtype) for x, y in zip(dkv, like)), axis_name)


_ring = jax.custom_vjp(_ring_forward, nondiff_argnums=(0, 1))
_ring.defvjp(_ring_fwd, _ring_bwd)


# The model: the bytes the ring sends and the K/V it holds (the hybrid's outer ring too).

def rotation_bytes(*, batch: int, seq_len: int, kv_heads: int, head_dim: int, v_head_dim: int,
                   axis_size: int, dtype_bytes: float, backward: bool, with_segment_ids: bool,
                   reach: tuple[int, int] | None = None, positions_travel: bool = False,
                   compute: Compute | None = None) -> float:
    """The ring over ``axis_size`` devices on K/V of ``kv_heads`` heads.

    Forward: ``P-1`` ppermutes of the local k ``[B, S/P, Hkv, Dqk]`` and v
    ``[B, S/P, Hkv, Dv]``, with their int32 positions ``[B, S/P]`` (and segment
    ids). Backward (custom_vjp, the forward is not re-run): the same ``P-1``
    rotations of k, v and metadata, plus ``P - 1`` ppermutes of the float32 dk, dv
    accumulators and one in the input dtype (the sums done, it brings them home). With
    a ``reach`` (a window or chunks, contiguous split): a halo exchange; the backward
    re-uses the saved halo and sends float32 dK/dV back; ``(0, 0)``: nothing
    (``positions_travel``: documents bound the reach, the halo's positions travel).
    ``compute``: K/V travel in its wire (:func:`jax_seqpar.strategies.wire.wire_bytes`).
    """
    if axis_size == 1:
        return 0.0
    if reach is not None:
        return halo_bytes(batch=batch, reach=reach, kv_heads=kv_heads, head_dim=head_dim,
                          v_head_dim=v_head_dim, dtype_bytes=dtype_bytes, backward=backward,
                          with_segment_ids=with_segment_ids, gradient_bytes=4,
                          positions_travel=positions_travel, compute=compute)
    local_tokens = batch * seq_len // axis_size
    rows = local_tokens * kv_heads
    metadata = local_tokens * INDEX_BYTES * (2 if with_segment_ids else 1)

    def rotation(backward: bool) -> float:
        kv = sum(wire_bytes(compute, dtype_bytes, rows, d, backward=backward, saved=backward)
                 for d in (head_dim, v_head_dim))
        return (axis_size - 1) * (kv + metadata)

    if not backward:
        return float(rotation(False))
    kv_elements = rows * (head_dim + v_head_dim)
    return float(rotation(False) + rotation(True)
                 + accumulator_bytes(kv_elements, axis_size, dtype_bytes))


def ring_bytes(sizes: tuple[int, ...], *, num_heads: int, num_kv_heads: int, seq_len: int,
               spec: MaskSpec = NO_MASK, **shape: Any) -> float:
    """The ring over all ``sizes`` devices (a halo exchange where a window or chunks bound
    the mask's reach)."""
    devices = math.prod(sizes)
    return rotation_bytes(seq_len=seq_len, kv_heads=num_kv_heads, axis_size=devices,
                          reach=layer_reach(spec, seq_len, devices),
                          positions_travel=spec.max_document_shards is not None, **shape)


def in_flight_memory(shape: LayerShape, ring: int, ulysses: int) -> float:
    """Bytes a ring of ``ring`` groups of ``ulysses`` devices holds beyond the layer's
    arrays: the K/V block a step computes on and the next one in flight (the K/V heads a
    device keeps after the inner head split), and with backward their float32 dK/dV
    accumulators; nothing without a ring."""
    if ring == 1:
        return 0.0
    d_qk, d_v = shape.head_dim, shape.v_head_dim or shape.head_dim
    kv_heads = math.lcm(shape.num_kv_heads, ulysses) // ulysses
    kv_local = shape.batch * shape.seq_len / ring * kv_heads * (d_qk + d_v)
    return 2 * kv_local * shape.dtype_bytes + (2 * kv_local * 4 if shape.backward else 0.0)


#: The ring's registry entry (:mod:`jax_seqpar.strategies.registry`).
ENTRY = Strategy("ring", ring_attention, ring_bytes, zigzag_balances=True, preference=2,
                 kv_memory=in_flight_memory, attend=attend)
