"""All-gather attention: every device gathers the whole K/V and attends with its queries.

Megatron-LM's ``all_gather`` context parallelism; Llama 3 (arXiv:2407.21783) uses
it for long-context training. K/V memory is O(S) per device; zigzag balances causal
work. A window or chunks on the contiguous split gather only the mask's reach
(:func:`jax_seqpar.core.reach.mask_reach`): nothing where every chunk fits a shard.

**Gathered in pieces** (``attention_in_pieces``): each device cuts its ``S/P`` K/V
tokens into ``C`` slices, and piece ``c`` is the all-gather of every device's slice
``c`` (K and V as one collective). A loop attends to piece ``c`` while piece ``c + 1``
is gathered, merging the partial results in float32 as the ring's steps do; only the
first piece waits, so ``(C - 1) / C`` of the gathered bytes can hide behind the kernel.
The pieces are kept (the O(S) K/V every all-gather keeps) for the backward, a
``custom_vjp`` shaped like the ring's: in ``P`` steps a device computes the
gradients of source device ``d - r``'s K/V (read from the kept pieces), adds the
dK/dV accumulator that arrived from device ``d - 1`` and sends it on; the last hop
takes it home. So the backward's transfers are collective-permutes that overlap the
next step's kernel on every backend (XLA:TPU compiles the reduce-scatter an
all-gather's autodiff backward would need as a synchronous all-reduce, twice the
bytes), and ``(P - 1) / P`` of them hide: all but the trip home. The accumulators
travel and are summed in float32 (as the ring's) and are cast once, for the last hop
home: rounded to bf16 at every hop, dK/dV's error grew with P (2.9x P=1's at P=8,
S=256); a float32 hop is twice a bf16 one's bytes.

XLA:TPU runs all-gathers synchronously unless compiled with the async collective
fusion options of :data:`jax_seqpar.tools.targets.COMPILE_OPTIONS` (the package's
target compiles pass them; pass them to your own compile too); XLA:GPU needs none.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable, Literal

import jax
import jax.numpy as jnp

from jax_seqpar import kernels
from jax_seqpar.core import compat as _compat
from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.core.merge import merge_results
from jax_seqpar.strategies import halo
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.strategies.gathered_pieces import default_pieces, resolve_gathered_pieces
from jax_seqpar.strategies.wire import Wire, rotated, wire_bytes
from jax_seqpar.strategies.inputs import (Metadata, Options, axis_size, describe, finish,
                                          gather_tokens, max_logit_over, nothing_seen,
                                          shard_operands)
from jax_seqpar.strategies.ring import shift, shift_during
from jax_seqpar.strategies.traffic import (INDEX_BYTES, NO_MASK, accumulator_bytes, halo_bytes,
                                           layer_reach)

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.core.masks import MaskSpec
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.kernels.options import BlockSizes, KernelName

__all__ = ["ENTRY", "allgather_attention", "allgather_bytes", "attend", "exchange_steps",
           "gathered_memory"]

def allgather_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, seq_axes: str | tuple[str, ...],
                        causal: bool = False, segment_ids: jax.Array | None = None,
                        positions: jax.Array | None = None, window: int | tuple[int, int] | None = None,
                        scale: float | None = None, kernel: KernelName = "auto",
                        block_sizes: BlockSizes | None = None, softcap: float | None = None,
                        compute_dtype: ComputeLike = None, sinks: jax.Array | None = None,
                        kv_segment_ids: jax.Array | None = None, chunk_size: int | None = None,
                        bidirectional_ids: jax.Array | None = None, mask_fn: Callable | None = None,
                        return_lse: bool = False, max_document_shards: int | None = None,
                        pieces: int | Literal["auto"] = "auto", return_max_logit: bool = False):
    """Exact attention of a sequence sharded over ``seq_axes`` (call inside ``shard_map``).

    Args:
      q: ``[B, S/P, H, Dqk]``; k: ``[B, S/P, Hkv, Dqk]``; v: ``[B, S/P, Hkv, Dv]``.
      seq_axes, causal, window, chunk_size, mask_fn, segment_ids, positions,
        bidirectional_ids, scale, kernel, block_sizes, softcap, compute_dtype, sinks, kv_segment_ids,
        return_lse, return_max_logit: as in :func:`jax_seqpar.strategies.ring.ring_attention`.
      pieces: how many pieces K/V are gathered in (see the module docstring; a divisor
        of ``S/P``). ``"auto"`` (default,
        :func:`~jax_seqpar.strategies.gathered_pieces.default_pieces`): up to 16, each
        device's slice of a piece at least 128 tokens. Pieces cost no memory (the gathered K/V are
        written in place into the buffer the backward reads); each is one more kernel
        call. ``1``: one all-gather before one kernel call. A window on the contiguous
        split gathers only its halo, in one piece.

    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype`` (then lse, then max logit ``[H]``, as the ring).

    .. code-block:: python

        out = jax.shard_map(functools.partial(allgather_attention, seq_axes="sp"),
                            mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
    """
    options, metadata = describe(
        q, k, v, local=True, causal=causal, window=window, chunk_size=chunk_size, mask_fn=mask_fn,
        scale=scale, kernel=kernel, block_sizes=block_sizes, softcap=softcap,
        compute_dtype=compute_dtype, return_lse=return_lse, segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        positions=positions, bidirectional_ids=bidirectional_ids, sinks=sinks,
        max_document_shards=max_document_shards, return_max_logit=return_max_logit)
    return max_logit_over(options, attend(q, k, v, options, metadata, seq_axes=seq_axes,
                                          pieces=pieces), seq_axes)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, options: Options, metadata: Metadata,
           *, seq_axes: str | tuple[str, ...], pieces: int | Literal['auto'] = "auto"):
    """The all-gather on described inputs (:func:`allgather_attention` after its checks), the core the global
    view runs inside ``shard_map``: ``options`` and the local, checked ``metadata``
    (:func:`jax_seqpar.strategies.inputs.describe`)."""
    shard = shard_operands(q, options, metadata, seq_axes)
    options, q, k = rotated(options, q, k)  # the rotation, once: rotated K travels
    pieces = resolve_gathered_pieces(pieces, q.shape[1])
    reach = halo.mask_reach(options.spec, q.shape[1], axis_size(seq_axes),  # the halo's
                            bidirectional=shard.q_tokens.bidirectional_ids is not None,
                            contiguous=metadata.positions is None)
    if reach is None:
        result = attention_in_pieces(seq_axes, options, q, k, v, shard.q_tokens,
                                     shard.kv_tokens, pieces=pieces)
    else:
        result = halo.window_attention(seq_axes, options, reach, q, k, v, shard.q_tokens,
                                       shard.kv_tokens)
    return finish(options, q, result, shard)  # [B, S/P, H, Dv] (, lse, row max logits)


def attention_in_pieces(axis_name, options, q, k, v, q_tokens, kv_tokens, *, pieces: int):
    """The all-gather in pieces on prepared inputs (see the module docstring).

    Args:
      axis_name: the gather's mesh axis (or axes); options: the call's ``Options``.
      q, k, v: ``[B, S/P, H|Hkv, D]`` local shards; q_tokens, kv_tokens: their metadata.
      pieces: a divisor of ``S/P``.
    Returns:
      ``out float32[B, S/P, H, Dv]`` and ``lse float32[B, S/P, H]`` (and the row max
      logits), differentiable in q, k, v (the backward accepts the ``lse`` cotangent).
    """
    # K/V travel in the call's compute dtype; the backward reads the gathered pieces
    # as kept, so in a wire that serves both passes.
    wire = Wire.of(options.compute, k.dtype, saved=True)
    return _in_pieces((axis_name, options, int(pieces), wire), q, k, v, q_tokens, kv_tokens)


def _packs(k, v) -> bool:
    """K and V travel as one collective (stacked on a new major axis) when they can."""
    return k.shape == v.shape


def _gather_piece(axis_name, pieces, k, v, all_tokens, c):
    """Piece ``c`` (a traced index): every device's slice ``c`` of K and V, gathered.

    Returns ``(kv, tokens)``: ``kv`` the raw gathered ``[2, B, P*n, Hkv, D]`` (K and V
    stacked) or the pair ``([B, P*n, Hkv, Dqk], [B, P*n, Hkv, Dv])``; ``tokens`` the
    piece's slice of the whole sequence's metadata ``all_tokens``.
    """
    n = k.shape[1] // pieces
    ks, vs = (jax.lax.dynamic_slice_in_dim(x, c * n, n, axis=1) for x in (k, v))
    if _packs(k, v):
        kv = jax.lax.all_gather(jnp.stack([ks, vs]), axis_name, axis=2, tiled=True)
    else:
        kv = tuple(jax.lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (ks, vs))
    size = axis_size(axis_name)

    def piece_of(t):  # [B, S] device-major -> [B, P*n] of slice c
        t = t.reshape(t.shape[0], size, pieces, n)
        return jax.lax.dynamic_index_in_dim(t, c, axis=2, keepdims=False).reshape(
            t.shape[0], -1)

    return kv, jax.tree.map(piece_of, all_tokens)


def _unpack(kv):
    """``(k, v)`` of a gathered piece's raw ``kv``."""
    return (kv[0], kv[1]) if not isinstance(kv, tuple) else kv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _in_pieces(config, q, k, v, q_tokens, kv_tokens):
    return _in_pieces_forward(config, q, k, v, q_tokens, kv_tokens)[0]


def _in_pieces_forward(config, q, k, v, q_tokens, kv_tokens):
    axis_name, options, pieces, wire = config
    all_tokens = gather_tokens(kv_tokens, axis_name)  # [B, S], once
    d_v = v.shape[-1]
    k, v = wire.encode(k), wire.encode(v)

    def attend(acc, piece):
        # The kernel continues the running (out, lse), as the ring's steps do (Mosaic in
        # the kernel, in place; the XLA and Pallas kernels merge after).
        kc, vc = wire.decode_kv(_unpack(piece[0]))
        return kernels.forward(options, q, kc, vc, q_tokens, piece[1], accumulate=acc)

    def attend_during(acc, piece, upcoming):
        """``attend(acc, piece)`` while ``upcoming``'s gather is in flight: the result and
        the gather pass one barrier. Where lowered for a GPU the kernel's own result
        passes it and the merge comes after: XLA:GPU otherwise counts the merge's
        fusions as cover enough and starts the gather after the kernel (h100, 16384
        tokens a device: nothing hidden)."""
        def in_kernel():
            return jax.lax.optimization_barrier((attend(acc, piece), upcoming))

        def merge_after():
            kc, vc = wire.decode_kv(_unpack(piece[0]))
            result = kernels.forward(options, q, kc, vc, q_tokens, piece[1])
            result, before, arrived = jax.lax.optimization_barrier((result, acc, upcoming))
            return merge_results(before, result), arrived

        return jax.lax.platform_dependent(cuda=merge_after, rocm=merge_after,
                                          default=in_kernel)

    def keep(kept, piece, c):  # the pieces the backward reads, written in place
        return jax.tree.map(lambda xs, x: jax.lax.dynamic_update_index_in_dim(xs, x, c, 0),
                            kept, piece[0])

    acc = _compat.match_varying(nothing_seen(options, q, d_v), q)
    piece = _gather_piece(axis_name, pieces, k, v, all_tokens, 0)
    kept = jax.tree.map(lambda x: jnp.zeros((pieces, *x.shape), x.dtype), piece[0])
    kept = _compat.match_varying(kept, (q, piece[0]))
    if pieces > 1:
        def step(carry, c):
            acc, piece, kept = carry
            upcoming = _gather_piece(axis_name, pieces, k, v, all_tokens, c + 1)
            # The kernel's result and the next piece's arrival (its raw gather) pass one
            # barrier: the gather is left to run while this piece's kernel computes.
            acc, upcoming = attend_during(acc, piece, upcoming)
            return (acc, upcoming, keep(kept, piece, c)), None

        carry = _compat.match_varying((acc, piece, kept), (acc, piece, kept))
        (acc, piece, kept), _ = jax.lax.scan(step, carry, jnp.arange(pieces - 1))
    acc = attend(acc, piece)
    return acc, (keep(kept, piece, pieces - 1), all_tokens)


def _in_pieces_fwd(config, q, k, v, q_tokens, kv_tokens):
    result, (kept, all_tokens) = _in_pieces_forward(config, q, k, v, q_tokens, kv_tokens)
    out, lse = result[:2]  # q, the pieces (the whole K/V, input dtype), out and lse saved
    return result, (q, q_tokens, all_tokens, kept, out.astype(q.dtype), lse)


def _in_pieces_bwd(config, residuals, cotangents):
    axis_name, options, pieces, wire = config
    q, q_tokens, all_tokens, kept, out, lse = residuals
    dout, dlse = cotangents[:2]
    delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(jnp.float32),
                       out.astype(jnp.float32)) - dlse
    dout = dout.astype(q.dtype)
    size, me = axis_size(axis_name), jax.lax.axis_index(axis_name)
    local_len = q.shape[1]
    n = local_len // pieces
    kept_kv = (kept[:, 0], kept[:, 1]) if not isinstance(kept, tuple) else kept

    def source(j):
        """Device ``j``'s K/V (its own token order) and metadata, from the kept pieces."""
        def of(x):  # [C, B, P*n, ...] -> [B, C*n, ...] of device j
            x = x.reshape(pieces, x.shape[1], size, n, *x.shape[3:])
            x = jax.lax.dynamic_index_in_dim(x, j, axis=2, keepdims=False)  # [C, B, n, ...]
            return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], local_len, *x.shape[3:])

        kj, vj = wire.decode_kv(tuple(of(x) for x in kept_kv))
        tj = jax.tree.map(lambda t: jax.lax.dynamic_slice_in_dim(t, j * local_len, local_len,
                                                                  axis=1), all_tokens)
        return kj, vj, tj

    def fresh(dq, r):
        """``dq`` plus step ``r``'s, and the float32 dK/dV of source ``d - r``."""
        kj, vj, tj = source((me - r) % size)
        zeros = _compat.match_varying(tuple(jnp.zeros(x.shape, jnp.float32) for x in (kj, vj)),
                                      q)
        dq, dk, dv = kernels.backward(options, q, kj, vj, q_tokens, tj, lse, delta, dout,
                                      accumulate=(dq, *zeros))
        return dq, (dk, dv)

    # The accumulators travel and are summed in float32 and cast once, at home: rounded
    # to the inputs' dtype at every hop, their error would grow with P.
    dq = _compat.match_varying(jnp.zeros(q.shape, jnp.float32), q)
    dq, dkv = fresh(dq, 0)
    if size > 1:
        def step(carry, r):
            dq, dkv = carry
            # dK/dV from device d - 1, in flight during this step's kernel
            (dq, new), arrived = shift_during(lambda: fresh(dq, r), dkv, axis_name)
            return (dq, tuple(a + b for a, b in zip(arrived, new))), None

        (dq, dkv), _ = jax.lax.scan(step, (dq, dkv), jnp.arange(1, size))
        # The last hop home in the input dtype: the sums are done, so rounding before
        # the hop is rounding after it, at half the bytes (bf16).
        dk, dv = shift(tuple(x.astype(wire.like) for x in dkv), axis_name)
    else:
        dk, dv = dkv
    no_grad = jax.tree.map(lambda _: None, (q_tokens, all_tokens))  # kv_tokens' structure
    return (dq.astype(q.dtype), dk.astype(wire.like), dv.astype(wire.like), *no_grad)


_in_pieces.defvjp(_in_pieces_fwd, _in_pieces_bwd)


# The model: the bytes the all-gather sends, its latency steps, pieces and memory.

def _gather_bytes(*, batch, seq_len, num_kv_heads, head_dim, v_head_dim, axis_size,
                  dtype_bytes, backward, with_segment_ids, spec, compute=None) -> float:
    """all_gather of k, v and positions to ``[B, S, Hkv, .]`` (K/V in pieces, the same
    bytes); the backward sends dK/dV home around the ring: ``[B, S/P, Hkv, Dqk + Dv]``
    ``P`` ppermutes as the ring's do, ``P - 1`` in float32, the last (home) in the input
    dtype. Where the mask's reach is bounded only the halo is gathered; its float32
    gradient goes back. ``compute``: K/V travel in its wire (kept for the backward)."""
    reach = layer_reach(spec, seq_len, axis_size)
    if axis_size == 1:
        return 0.0
    if reach is not None:
        return halo_bytes(batch=batch, reach=reach, kv_heads=num_kv_heads, head_dim=head_dim,
                          v_head_dim=v_head_dim, dtype_bytes=dtype_bytes, backward=backward,
                          with_segment_ids=with_segment_ids, gradient_bytes=4,
                          positions_travel=spec.max_document_shards is not None,
                          compute=compute)
    fraction = (axis_size - 1) / axis_size
    kv_elements = batch * seq_len * num_kv_heads * (head_dim + v_head_dim)
    kv = sum(wire_bytes(compute, dtype_bytes, batch * seq_len * num_kv_heads, d, saved=True)
             for d in (head_dim, v_head_dim))
    metadata = batch * seq_len * INDEX_BYTES * (2 if with_segment_ids else 1)
    sent = fraction * (kv + metadata)
    if backward:
        sent += accumulator_bytes(kv_elements // axis_size, axis_size, dtype_bytes)
    return sent


def allgather_bytes(sizes: tuple[int, ...], *, num_heads: int, seq_len: int,
                    spec: MaskSpec = NO_MASK, **shape: Any) -> float:
    """The all-gather over all ``sizes`` devices (the halo only where a window or chunks
    bound the mask's reach; nothing at reach ``(0, 0)``)."""
    return _gather_bytes(seq_len=seq_len, axis_size=math.prod(sizes), spec=spec, **shape)


def exchange_steps(size: int, shape: LayerShape) -> int:
    """Latency steps of the all-gather strategy: K, V, positions (and segment ids)
    gathered, ``size - 1`` steps each; backward: dK/dV passed ``size`` hops around the
    ring."""
    gathered = 3 + shape.segment_ids
    return (size - 1) * gathered + (size if shape.backward else 0)


def gathered_memory(shape: LayerShape, ring: int, ulysses: int) -> float:
    """Bytes the all-gather holds beyond the layer's arrays: every device's K/V and
    positions, O(S), and with backward their float32 gradients."""
    kv = shape.num_kv_heads * (shape.head_dim + (shape.v_head_dim or shape.head_dim))
    tokens = shape.batch * shape.seq_len
    return tokens * (kv * shape.dtype_bytes + 4) + (tokens * kv * 4 if shape.backward else 0.0)


def _pieces(shape: LayerShape, ring: int, ulysses: int) -> tuple[int, int]:
    """Forward: K/V gathered in
    :func:`~jax_seqpar.strategies.gathered_pieces.default_pieces` pieces; backward: dK/dV passed
    around the ring, a hop a piece."""
    return default_pieces(-(-shape.seq_len // ring)), ring


#: The all-gather's registry entry (:mod:`jax_seqpar.strategies.registry`).
ENTRY = Strategy("allgather", allgather_attention, allgather_bytes, zigzag_balances=True,
                 exchanges=("all-gather", "collective-permute"), exchange_steps=exchange_steps,
                 gathers_kv=True, kv_memory=gathered_memory, pieces=_pieces, attend=attend,
                 pipelining=("pieces",))
