"""Ulysses attention: all-to-all from sequence shards to head shards and back.

Paper: Jacobs et al., DeepSpeed Ulysses, arXiv:2309.14509.

``[B, S/P, H, D] -all_to_all-> [B, S, H/P, D]``: each device then attends over
the whole sequence for H/P heads, and a second all-to-all returns the output to
sequence shards. Balanced by construction (every device has the same work for
any mask). When ``Hkv`` is not a multiple of P, K/V heads are replicated just
enough (``P / gcd(Hkv, P)`` times) for every device to hold the K/V heads of its
query heads.

Pipelined along the sequence (:mod:`jax_seqpar.strategies.seq_pipeline`: the keys
first, then the queries, each piece's transfer behind a kernel; the default where each
device holds enough tokens) or over head groups
(:mod:`jax_seqpar.strategies.head_pipeline`); ``overlap=False`` sends each exchange whole.

Where the mask's reach on the contiguous split (default positions) is ``(0, 0)``
(:func:`jax_seqpar.core.reach.mask_reach`: chunks that fit a shard) no exchange is
needed: every device attends its own tokens, all heads, with no collective.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core.quant import Compute, ComputeLike
from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.strategies import halo
from jax_seqpar.strategies.pieces import KernelCall, kernel_calls
from jax_seqpar.strategies.seq_pipeline import seq_pipeline
from jax_seqpar.strategies.head_pipeline import KernelStage, head_pipeline
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.strategies.heads import (piece_sizes, kv_replication, local_head_counts,
                                         local_heads, resolve_pieces)
from jax_seqpar.strategies.wire import rotated, wire_bytes
from jax_seqpar.strategies.inputs import (Metadata, Operands, axis_size, describe, finish,
                                          gather_tokens, max_logit_over, shard_operands)
from jax_seqpar.strategies.traffic import (INDEX_BYTES, NO_MASK, all_to_all_bytes,
                                           replicated_kv_heads)

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.kernels.options import BlockSizes, KernelName, Options

__all__ = ["ENTRY", "attend", "auto_pieces", "exchange_bytes", "exchange_pieces", "exchange_steps",
           "ulysses_attention", "ulysses_bytes"]


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, seq_axes: str | tuple[str, ...],
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
    """Exact attention of a sequence sharded over ``seq_axes`` (call inside ``shard_map``).

    Args:
      q: ``[B, S/P, H, Dqk]``; k: ``[B, S/P, Hkv, Dqk]``; v: ``[B, S/P, Hkv, Dv]``
        this device's shard. ``H`` must be divisible by P.
      seq_axes: mesh axis (or tuple of axes) along which the sequence is split.
      causal, window, chunk_size, mask_fn, segment_ids, positions, bidirectional_ids,
        scale, kernel, block_sizes, softcap, compute_dtype, sinks, kv_segment_ids, return_lse,
        return_max_logit: as in :func:`jax_seqpar.strategies.ring.ring_attention`
        (``sinks`` replicated).
      overlap: ``"auto"`` (default) or True: the exchange pipelined behind the kernel,
        in ``pieces`` sequence pieces where the local length allows, else in
        ``head_groups`` head groups; False: each exchange whole, one kernel call
        (:func:`jax_seqpar.strategies.heads.resolve_pieces`).
      pieces: how many query pieces (:func:`jax_seqpar.strategies.heads.piece_sizes`;
        :func:`jax_seqpar.strategies.heads.piece_counts` lists what the local length
        allows); ``"auto"``: :func:`~jax_seqpar.strategies.heads.default_pieces` (5 at
        2048 tokens a device, 1 where the smallest piece would bring fewer than
        :data:`~jax_seqpar.strategies.heads.MIN_PIECE_TOKENS` tokens).
        Pieces hide all but ``1/2^(pieces-1)`` of the bytes where collectives are
        asynchronous (GPU; TPU with the all-to-all option).
      head_groups: how many groups the ``H/P`` heads a device receives are pipelined in
        when the sequence is not cut into pieces (see :mod:`jax_seqpar.strategies.head_pipeline`;
        :func:`jax_seqpar.strategies.heads.head_group_counts` lists the counts the heads
        allow). ``"auto"``: 1 with pieces, else the largest allowed count up to
        :data:`jax_seqpar.strategies.heads.MAX_AUTO_HEAD_GROUPS`.

    Returns:
      ``[B, S/P, H, Dv]`` in ``q.dtype`` (softmax statistics in float32), then the lse
      and the ``[H]`` max logit when asked for, as the ring.

    >>> out = jax.shard_map(functools.partial(ulysses_attention, seq_axes="sp"),
    ...                     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
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
                                          head_groups=head_groups), seq_axes)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, options: Options, metadata: Metadata,
           *, seq_axes: str | tuple[str, ...], overlap: bool | Literal["auto"] = "auto",
           pieces: int | Literal["auto"] = "auto",
           head_groups: int | Literal["auto"] = "auto"):
    """Ulysses on described inputs (:func:`ulysses_attention` after its checks), the core the global
    view runs inside ``shard_map``: ``options`` and the local, checked ``metadata``
    (:func:`jax_seqpar.strategies.inputs.describe`)."""
    shard = shard_operands(q, options, metadata, seq_axes)
    options, q, k = rotated(options, q, k)  # the rotation, once: rotated K travels
    size = axis_size(seq_axes)
    local = halo.local_or_none(seq_axes, options, q, k, v, shard.q_tokens, shard.kv_tokens,
                               contiguous=metadata.positions is None)
    if local is not None:  # the mask's reach is (0, 0): nothing to exchange
        return finish(options, q, local, shard)
    repeats = kv_replication(q.shape[2], k.shape[2], size)
    pieces, groups = resolve_pieces(overlap, pieces, head_groups, q.shape[2], k.shape[2], size,
                                    q.shape[1])
    if repeats > 1:
        # Replicated in float32: the replicas' gradients, on different devices, come back
        # and sum in float32 and round once (the pipeline sends K/V in q.dtype).
        k, v = (x.astype(jnp.float32).repeat(repeats, axis=2) for x in (k, v))
    q_tokens, kv_tokens = gather_tokens((shard.q_tokens, shard.kv_tokens), seq_axes)  # [B, S]
    operands = Operands(q_tokens, kv_tokens, local_heads(shard.sinks, seq_axes))
    if pieces > 1:
        return seq_pipeline(seq_axes, options, q, k, v, operands,
                              sizes=piece_sizes(q.shape[1], pieces),
                              return_lse=options.return_lse)
    return head_pipeline(seq_axes, KernelStage(options), q, k, v, operands,
                         groups=groups, return_lse=options.return_lse)


# The model: the bytes Ulysses sends, its latency steps and pieces (the hybrid's inner
# exchange uses the same three).

def exchange_bytes(*, batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, v_head_dim: int, axis_size: int, dtype_bytes: float,
                   backward: bool, with_segment_ids: bool,
                   row_statistic: bool = True, compute: Compute | None = None) -> float:
    """Ulysses over ``axis_size`` devices; ``seq_len`` is the length it gathers.

    Forward: q ``[B, S/P, H, Dqk]``, k ``[B, S/P, Hkv_eff, Dqk]``, v
    ``[B, S/P, Hkv_eff, Dv]`` go seq->head and out ``[B, S/P, H, Dv]`` head->seq,
    whatever the head groups (they cut the same buffers into pieces).
    Backward (the reverse pipeline): dout in; dq, dk, dv out, one all_to_all of the
    forward's size each, dk and dv in float32 where the K/V heads are replicated (the
    replicas' partial sums cross devices); with ``row_statistic`` (Ulysses' own kernel
    backward; not the hybrid's ring, which has its own) also the float32 ``<dout, out>``
    rows ``[B, S/P, H]`` in, computed on the sequence-sharded output the backward keeps.
    The int32 positions (and segment ids, when used) ``[B, S/P]`` are all-gathered to
    ``[B, S]`` once: ``(P-1) * B*S/P * 4`` bytes each, no gradient. ``compute``: q, k,
    v (kept for the backward) and dout travel in its wire
    (:func:`~jax_seqpar.strategies.wire.wire_bytes`), the output and the gradients in
    the inputs' dtype.
    """
    if axis_size == 1:
        return 0.0
    kv_heads = replicated_kv_heads(num_kv_heads, axis_size)
    local_tokens = batch * seq_len // axis_size
    kv_elements = kv_heads * (head_dim + v_head_dim)
    elements_per_token = num_heads * head_dim + kv_elements + num_heads * v_head_dim

    def wire(heads, features, backward=False):  # bytes of one token's rows on the wire
        return wire_bytes(compute, dtype_bytes, heads, features, backward=backward,
                          saved=not backward)

    incoming = (wire(num_heads, head_dim) + wire(kv_heads, head_dim) + wire(kv_heads, v_head_dim)
                + num_heads * v_head_dim * dtype_bytes)
    sent = all_to_all_bytes(local_tokens * incoming, axis_size, 1)
    if backward:
        grad_bytes = 4 if kv_heads != num_kv_heads else dtype_bytes
        sent += all_to_all_bytes(
            local_tokens * (wire(num_heads, v_head_dim, backward=True)
                            + num_heads * head_dim * dtype_bytes), axis_size, 1)
        sent += all_to_all_bytes(local_tokens * kv_elements, axis_size, grad_bytes)
        if row_statistic:
            sent += all_to_all_bytes(local_tokens * num_heads, axis_size, 4)
    metadata = local_tokens * INDEX_BYTES * (2 if with_segment_ids else 1)
    return sent + (axis_size - 1) * metadata


def ulysses_bytes(sizes: tuple[int, ...], *, num_heads: int, spec: MaskSpec = NO_MASK,
                  **shape: Any) -> float:
    """Ulysses over all ``sizes`` devices (a window changes nothing; nothing is sent where
    the mask's reach on the contiguous split is ``(0, 0)``: chunks that fit a shard)."""
    devices = math.prod(sizes)
    if halo.is_local(spec, shape["seq_len"] // devices, devices):
        return 0.0
    if num_heads % devices:
        raise ValueError(f"num_heads={num_heads} is not divisible by the ulysses axis "
                         f"size {devices}; use strategy='ring' or 'hybrid'.")
    return exchange_bytes(num_heads=num_heads, axis_size=devices,
                          row_statistic=True, **shape)


def exchange_steps(size: int, shape: LayerShape) -> int:
    """Latency steps of Ulysses over ``size`` devices: 4 all-to-alls a pass and the
    all-gathers (``size - 1`` steps each) of the positions and any segment ids."""
    return 4 * (2 if shape.backward else 1) + (size - 1) * (1 + shape.segment_ids)


def exchange_pieces(shape: LayerShape, ring: int, ulysses: int, *, shared_kv: bool = True
                    ) -> int:
    """The pieces of Ulysses' exchange over ``ulysses`` devices (the hybrid's inner one,
    beside a ring of ``ring``) as ``overlap="auto"`` cuts them
    (:func:`~jax_seqpar.strategies.heads.resolve_pieces`; ``shared_kv``: its own).

    Sequence pieces (:func:`~jax_seqpar.strategies.heads.piece_sizes`) leave the first
    query and K/V pieces and the last output piece exposed, ``1/2^(c-1)`` of the bytes:
    as many as ``2^(c-1)`` equal pieces. Head groups where each group has its own K/V
    heads; 1 where K/V heads are shared by several groups: they travel whole ahead of
    group 0 and only parts of q and out hide (a third of the bytes at 2 query heads and
    1 K/V head a device, compiled), which the pieces model would overstate."""
    if ulysses == 1:
        return 1
    pieces, groups = auto_pieces(shape, ring, ulysses, shared_kv=shared_kv)
    if pieces > 1:
        return 2 ** (pieces - 1)
    _, kv_local = local_head_counts(shape.num_heads, shape.num_kv_heads, ulysses)
    return groups if kv_local % groups == 0 else 1


def auto_pieces(shape: LayerShape, ring: int, ulysses: int, *, shared_kv: bool = True,
                local_len: int | None = None) -> tuple[int, int]:
    """``(pieces, head_groups)`` of the exchange over ``ulysses`` devices (beside a ring of
    ``ring``) as the strategies resolve ``overlap="auto"`` on ``local_len`` tokens a device
    (None: ``ceil(S / (ring x ulysses))``; :func:`~jax_seqpar.strategies.heads.resolve_pieces`)."""
    if local_len is None:
        local_len = -(-shape.seq_len // (ring * ulysses))
    return resolve_pieces("auto", "auto", "auto", shape.num_heads, shape.num_kv_heads,
                          ulysses, local_len, shared_kv=shared_kv)


def _pieces(shape: LayerShape, ring: int, ulysses: int) -> tuple[int, int]:
    return (exchange_pieces(shape, ring, ulysses),) * 2


def _kernel_calls(shape: LayerShape, ring: int, ulysses: int, shards: np.ndarray,
                  group: int) -> list[list[KernelCall]] | None:
    """The sequence pipeline's kernel calls (one step) over the ``[P, L]`` ``shards``
    positions, or None where the exchange is not cut along the sequence (head groups) or
    nothing is exchanged (the mask's reach is ``(0, 0)``: local attention)."""
    del ring, group  # one group of all the devices
    local_len = shards.shape[1]
    if halo.is_local(shape.mask, local_len, ulysses):
        return None
    pieces, _ = auto_pieces(shape, 1, ulysses, local_len=local_len)
    if pieces == 1:
        return None
    return [kernel_calls(shards.reshape(-1), ulysses, piece_sizes(local_len, pieces))]


#: Ulysses' registry entry (:mod:`jax_seqpar.strategies.registry`). Ties by bytes go to it
#: (``preference=0``): it has the fewest, largest messages (lowest latency).
ENTRY = Strategy("ulysses", ulysses_attention, ulysses_bytes, splits_heads=True, preference=0,
                 exchanges=("all-to-all", "all-to-all"), exchange_steps=exchange_steps,
                 pieces=_pieces, kernel_calls=_kernel_calls, attend=attend,
                 pipelining=("overlap", "pieces", "head_groups"))
