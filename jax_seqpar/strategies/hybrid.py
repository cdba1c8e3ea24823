"""Hybrid attention: Ulysses inside the fast axis, the ring across the slow one.

Papers: USP, Fang & Zhao, arXiv:2405.07719; Megatron-LM's ``a2a+p2p`` context
parallelism.

The sequence is sharded over ``(ring_axis, ulysses_axis)`` jointly
(``P(None, (outer, inner))``). An all-to-all over the inner (ICI/NVLink) axis
turns ``[B, S/(O*I), H, D]`` into ``[B, S/O, H/I, D]``; the ring (with its own
O(S/P)-memory backward) then runs over the outer (DCN) axis on that
sub-sequence; a second all-to-all returns the output to sequence shards. K/V
heads are replicated only as far as the inner all-to-all needs; the ring
circulates exactly the heads each device holds after it.

The inner exchange is pipelined along the sequence
(:mod:`jax_seqpar.strategies.ring_pieces`: the pieces' transfers behind the ring's first
and last steps; the default where each device holds enough tokens) or over head groups
(:func:`jax_seqpar.strategies.head_pipeline.head_pipeline`: the ring runs once per head
group, and group ``g + 1``'s all-to-all, and group ``g - 1``'s output's, travel while the
ring of group ``g`` computes). The ring's own K/V hops hide behind its step kernels as in
:mod:`jax_seqpar.strategies.ring`, forward and backward. A window or chunks on the contiguous
split shrink the ring to a halo exchange (the mask's reach over the outer axis), cut into
pieces the same way (the halo in flight where the ring's first hop would be, its dK/dV
back behind the own keys' backward); where the reach over all devices is ``(0, 0)``
(chunks that fit a shard) the hybrid attends locally and sends nothing.

Causal balance: with the zigzag order over all ``O*I`` shards (what
``sequence_parallel_attention`` applies), every ring step gives every device the
same number of visible key blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.strategies import halo
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.strategies.seq_pipeline import seq_pipeline
from jax_seqpar.strategies.head_pipeline import head_pipeline
from jax_seqpar.strategies.heads import (piece_sizes, default_pieces, kv_replication, local_heads,
                                         resolve_pieces)
from jax_seqpar.strategies.wire import rotated
from jax_seqpar.strategies.inputs import (Metadata, Operands, Options, axis_size, describe,
                                          finish, gather_tokens, max_logit_over, shard_operands)
from jax_seqpar.strategies.ring import ENTRY as RING, in_flight_memory, ring_over, rotation_bytes
from jax_seqpar.strategies.pieces import KernelCall, kernel_calls as seq_kernel_calls
from jax_seqpar.strategies.ring_pieces import kernel_calls as ring_kernel_calls, ring_pieces
from jax_seqpar.strategies.traffic import NO_MASK, replicated_kv_heads, layer_reach
from jax_seqpar.strategies.ulysses import (ENTRY as ULYSSES, auto_pieces, exchange_bytes,
                                           exchange_pieces)

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.kernels.options import BlockSizes, KernelName

__all__ = ["ENTRY", "attend", "hybrid_attention", "hybrid_bytes", "outer_ring"]


def hybrid_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, seq_axes: str | tuple[str, ...],
                     causal: bool = False, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None, window: int | tuple[int, int] | None = None,
                     scale: float | None = None, kernel: KernelName = "auto",
                     block_sizes: BlockSizes | None = None, softcap: float | None = None,
                     compute_dtype: ComputeLike = None,
                     sinks: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                     chunk_size: int | None = None, bidirectional_ids: jax.Array | None = None,
                     mask_fn: Callable | None = None, return_lse: bool = False,
                     max_document_shards: int | None = None,
                     overlap: bool | Literal["auto"] = "auto", pieces: int | Literal["auto"] = "auto",
                     head_groups: int | Literal["auto"] = "auto", return_max_logit: bool = False):
    """Exact attention of a sequence sharded over ``seq_axes=(outer, inner)`` (in ``shard_map``).

    Args:
      q: ``[B, S/(O*I), H, Dqk]``; k: ``[B, S/(O*I), Hkv, Dqk]``; v: ``[B, S/(O*I), Hkv, Dv]``
        this device's shard; ``H`` must be divisible by the inner size ``I``.
      seq_axes: ``(outer, inner)`` mesh axes: the ring runs over the outer (slow) axis,
        of size ``O``, Ulysses over the inner (fast) one, of size ``I``.
      causal, window, chunk_size, mask_fn, segment_ids, positions, bidirectional_ids,
        scale, kernel, block_sizes, softcap, compute_dtype, sinks, kv_segment_ids, return_lse,
        return_max_logit: as in :func:`jax_seqpar.strategies.ring.ring_attention` (the
        max logit's ``pmax`` over both axes); default positions are
        the contiguous split over ``(outer, inner)``, with which a
        window shrinks the ring part to a halo exchange.
      overlap: False: the inner exchange whole, one ring; True / ``"auto"``: pipelined,
        in ``pieces`` sequence pieces where the local length allows, else in
        ``head_groups`` (:func:`jax_seqpar.strategies.heads.resolve_pieces`).
      pieces: how many query pieces (as in
        :func:`jax_seqpar.strategies.ulysses.ulysses_attention`; over the inner axis);
        ``"auto"``: :func:`~jax_seqpar.strategies.heads.default_pieces` (a ring that is a
        halo exchange, a window on the contiguous split, is cut alike).
      head_groups: the inner exchange's head groups when the sequence is not cut into pieces (as in
        :func:`jax_seqpar.strategies.ulysses.ulysses_attention`; the ring runs once per
        group). ``"auto"`` (default): the largest count up to
        :data:`~jax_seqpar.strategies.heads.MAX_AUTO_HEAD_GROUPS` that gives every
        group its own K/V heads, else 1 (a K/V head shared by several groups would ride
        the ring once per group: more bytes on the slow axis than the groups hide on the
        fast one).

    Returns:
      ``[B, S/(O*I), H, Dv]`` in ``q.dtype``, then the lse and the ``[H]`` max logit when
      asked for, as the ring.

    >>> f = functools.partial(hybrid_attention, seq_axes=("dcn", "ici"))
    >>> out = jax.shard_map(f, mesh=mesh, in_specs=P(None, ("dcn", "ici")),
    ...                     out_specs=P(None, ("dcn", "ici")))(q, k, v)
    """
    options, metadata = describe(
        q, k, v, local=True, causal=causal, window=window, chunk_size=chunk_size, mask_fn=mask_fn,
        scale=scale, kernel=kernel, block_sizes=block_sizes, softcap=softcap,
        compute_dtype=compute_dtype,
        return_lse=return_lse, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
        positions=positions, bidirectional_ids=bidirectional_ids, sinks=sinks,
        max_document_shards=max_document_shards, return_max_logit=return_max_logit)
    return max_logit_over(options, attend(q, k, v, options, metadata, seq_axes=seq_axes,
                                          overlap=overlap, pieces=pieces,
                                          head_groups=head_groups),
                          seq_axes if isinstance(seq_axes, str) else tuple(seq_axes))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, options: Options, metadata: Metadata,
           *, seq_axes: str | tuple[str, ...], overlap: bool | Literal["auto"] = "auto",
           pieces: int | Literal["auto"] = "auto",
           head_groups: int | Literal["auto"] = "auto"):
    """The hybrid on described inputs (:func:`hybrid_attention` after its checks), the core the global
    view runs inside ``shard_map``: ``options`` and the local, checked ``metadata``
    (:func:`jax_seqpar.strategies.inputs.describe`)."""
    ring_axis, ulysses_axis = _outer_inner(seq_axes)
    shard = shard_operands(q, options, metadata, (ring_axis, ulysses_axis))
    options, q, k = rotated(options, q, k)  # the rotation, once: rotated K travels
    contiguous = metadata.positions is None
    local = halo.local_or_none((ring_axis, ulysses_axis), options, q, k, v, shard.q_tokens,
                               shard.kv_tokens, contiguous=contiguous)
    if local is not None:  # the mask's reach is (0, 0): nothing to exchange
        return finish(options, q, local, shard)
    inner = axis_size(ulysses_axis)
    try:
        repeats = kv_replication(q.shape[2], k.shape[2], inner)
    except ValueError:
        raise ValueError(
            f"num_heads={q.shape[2]} is not divisible by the ulysses (inner) axis "
            f"{ulysses_axis!r} of size {inner}; choose an inner axis size that divides the heads "
            f"(e.g. {_divisor_hint(q.shape[2], inner)}) and put the rest on the ring axis, "
            f'or use strategy="ring".') from None
    # A window or chunks on the contiguous split make the ring a halo exchange of the
    # mask's reach over the ring groups; a reach of (0, 0) leaves no ring: Ulysses' pipeline.
    reach = _outer_reach(options.spec, inner * q.shape[1], axis_size(ring_axis),
                         contiguous=contiguous,
                         bidirectional=shard.q_tokens.bidirectional_ids is not None,
                         shard_len=q.shape[1])
    pieces, groups = resolve_pieces(overlap, pieces, head_groups, q.shape[2], k.shape[2],
                                    inner, q.shape[1], shared_kv=False)
    if repeats > 1:
        # Replicated in float32: the replicas' gradients, on different devices, come back
        # and sum in float32 and round once (the pipeline sends K/V in q.dtype).
        k, v = (x.astype(jnp.float32).repeat(repeats, axis=2) for x in (k, v))
    tokens = gather_tokens((shard.q_tokens, shard.kv_tokens), ulysses_axis)  # [B, S/O]
    # Default positions: each ring shard holds S/O contiguous tokens.
    stage = RingStage(ring_axis, options, contiguous, q.shape[1])
    q_tokens, kv_tokens = tokens
    operands = Operands(q_tokens, kv_tokens, local_heads(shard.sinks, ulysses_axis))
    if pieces > 1:
        pipeline = (functools.partial(seq_pipeline, ulysses_axis) if reach == (0, 0)  # Ulysses
                    else functools.partial(ring_pieces, ulysses_axis, ring_axis,
                                           reach=None if reach == "ring" else reach))
        return pipeline(options, q, k, v, operands, sizes=piece_sizes(q.shape[1], pieces),
                        return_lse=options.return_lse)
    return head_pipeline(ulysses_axis, stage, q, k, v, operands, groups=groups,
                         return_lse=options.return_lse)


@dataclasses.dataclass(frozen=True)
class RingStage:
    """The hybrid's work on one head group between its all-to-alls: the ring over the
    outer axis (:func:`jax_seqpar.strategies.ring.ring_over`), a stage of
    :func:`jax_seqpar.strategies.head_pipeline.head_pipeline` (its backward is the ring's)."""

    axis_name: str | tuple[str, ...]
    options: Options
    contiguous: bool
    shard_len: int  # the devices' own shards, which max_document_shards counts
    takes_delta = False  # the ring's backward computes it from its own residuals

    def forward(self, q, k, v, q_tokens, kv_tokens):
        def ring(q, k, v):  # the row max logits (return_max_logit): no gradient, aux
            result = ring_over(self.axis_name, self.options, q, k, v, q_tokens, kv_tokens,
                               contiguous=self.contiguous, shard_len=self.shard_len)
            return result[:2], tuple(result[2:])

        result, grads, high = jax.vjp(ring, q, k, v, has_aux=True)
        return (*result, *high), grads

    def backward(self, residuals, q_tokens, kv_tokens, dout, dlse, delta):
        return residuals((dout.astype(jnp.float32), dlse))


def outer_ring(spec: MaskSpec, ring_len: int, ring_size: int, *, contiguous: bool = True,
               bidirectional: bool = False, shard_len: int | None = None
               ) -> Literal["none", "halo", "ring"]:
    """How the hybrid's ring over ``ring_size`` groups of ``ring_len`` tokens runs:
    ``"none"`` (one group, or a mask whose reach over the groups is ``(0, 0)``: each
    group attends its own tokens, Ulysses alone), ``"halo"`` (the reach bounded: a halo
    exchange, :func:`jax_seqpar.core.reach.mask_reach`; ``shard_len``: the devices'
    shards, which ``max_document_shards`` counts) or ``"ring"`` (every step)."""
    reach = _outer_reach(spec, ring_len, ring_size, contiguous=contiguous,
                         bidirectional=bidirectional, shard_len=shard_len)
    return "ring" if reach == "ring" else "none" if reach == (0, 0) else "halo"


def _outer_reach(spec: MaskSpec, ring_len: int, ring_size: int, *, contiguous: bool,
                 bidirectional: bool, shard_len: int | None
                 ) -> Literal["ring"] | tuple[int, int]:
    """The mask's reach over the hybrid's ring groups (as :func:`outer_ring`): ``(0, 0)``
    with one group, ``"ring"`` where nothing bounds it."""
    if ring_size == 1:
        return 0, 0
    reach = halo.mask_reach(spec, ring_len, ring_size, bidirectional=bidirectional,
                            contiguous=contiguous, shard_len=shard_len)
    return "ring" if reach is None else reach


def _divisor_hint(heads: int, inner: int) -> int:
    """The largest inner size <= ``inner`` that divides ``heads``."""
    return max(d for d in range(1, inner + 1) if heads % d == 0)


def _outer_inner(seq_axes) -> tuple:
    """``(ring_axis, ulysses_axis)`` from ``seq_axes=(outer, inner)``."""
    if isinstance(seq_axes, str) or len(seq_axes) != 2 or seq_axes[0] == seq_axes[1]:
        raise ValueError(f"hybrid attention needs seq_axes=(outer, inner): two different mesh "
                         f"axes, the ring over the outer and Ulysses over the inner. Got "
                         f"{seq_axes!r}.")
    return tuple(seq_axes)


# The model: Ulysses' terms (ulysses.py) over the inner axis, around the ring's (ring.py)
# over the outer one.

def hybrid_bytes(sizes: tuple[int, ...], *, num_heads: int, num_kv_heads: int, seq_len: int,
                 spec: MaskSpec = NO_MASK, **shape: Any) -> float:
    """Ulysses over the inner axis of ``sizes=(outer, inner)`` on the local shard, then
    the ring over the outer one on ``lcm(Hkv, inner)/inner`` K/V heads (a halo exchange
    where the mask bounds its reach). Pipelined along the sequence (the default where the
    local length allows), the backward also sends the float32 ``<dout, out>`` rows (the
    ring's own backward does not need them)."""
    if len(sizes) != 2:
        raise ValueError(f"hybrid needs axis_sizes=(outer, inner). Got {sizes!r}.")
    outer, inner = sizes
    shard_len = seq_len // (outer * inner)
    if halo.is_local(spec, shard_len, outer * inner):
        return 0.0  # the mask's reach is (0, 0): attended locally
    if num_heads % inner:
        raise ValueError(f"num_heads={num_heads} is not divisible by the ulysses (inner) "
                         f"axis size {inner}; use strategy='ring' or swap the axes.")
    kv_heads_after_ulysses = replicated_kv_heads(num_kv_heads, inner) // inner
    reach = layer_reach(spec, seq_len, outer, shard_len=shard_len)
    pieces = default_pieces(shard_len, inner)
    return (exchange_bytes(seq_len=seq_len // outer, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, axis_size=inner,
                           row_statistic=pieces > 1, **shape)
            + rotation_bytes(seq_len=seq_len, kv_heads=kv_heads_after_ulysses, axis_size=outer,
                             reach=reach, positions_travel=spec.max_document_shards is not None,
                             **shape))


def _pieces(shape: LayerShape, ring: int, ulysses: int) -> tuple[int, int]:
    """The inner exchange's pieces: cut along the sequence (around a ring or its halo
    exchange alike); head groups only where each has its own K/V heads."""
    pieces = exchange_pieces(shape, ring, ulysses, shared_kv=False)
    return pieces, pieces


def _kernel_calls(shape: LayerShape, ring: int, ulysses: int, shards: np.ndarray,
                  group: int) -> list[list[KernelCall]] | None:
    """Ring group ``group``'s kernel calls per ring step over the ``[P, L]`` ``shards``
    positions, with the inner exchange in sequence pieces (:func:`ring_pieces.kernel_calls`;
    Ulysses' pipeline alone where the mask's reach over the groups is ``(0, 0)``), or None
    where it is not cut along the sequence (head groups), its ring is a halo exchange (its
    pieces' calls are not listed here: the count takes one call a step) or nothing is
    exchanged (local attention)."""
    shard_len = shards.shape[1]
    if halo.is_local(shape.mask, shard_len, ring * ulysses):
        return None
    kind = outer_ring(shape.mask, shard_len * ulysses, ring, shard_len=shard_len)
    pieces, _ = auto_pieces(shape, ring, ulysses, shared_kv=False, local_len=shard_len)
    if pieces == 1 or kind == "halo":  # a halo's calls: one a step (not listed call by call)
        return None
    sizes = piece_sizes(shard_len, pieces)
    groups = shards.reshape(ring, -1)  # each group's tokens, its devices in order
    if kind == "none":  # no ring: Ulysses' pipeline over the group
        return [seq_kernel_calls(groups[group], ulysses, sizes)] + [[]] * (ring - 1)
    blocks = [groups[(group - step) % ring] for step in range(ring)]
    return ring_kernel_calls(blocks, ulysses, sizes)


#: The hybrid's registry entry (:mod:`jax_seqpar.strategies.registry`).
ENTRY = Strategy("hybrid", hybrid_attention, hybrid_bytes, num_seq_axes=2, splits_heads=True,
                 zigzag_balances=True, preference=1, parts=(RING.name, ULYSSES.name),
                 kv_memory=in_flight_memory, pieces=_pieces, kernel_calls=_kernel_calls,
                 attend=attend,
                 pipelining=("overlap", "pieces", "head_groups"))
