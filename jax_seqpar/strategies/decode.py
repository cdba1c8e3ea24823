"""Decoding against a KV cache sharded along the sequence.

Each device attends the new queries against its slice of the cache and returns
a partial ``(out, lse)``; the partials combine exactly with one ``pmax`` and two
``psum`` s (the tree-attention reduction, arXiv:2408.04093). Forward only.

The cache's slots may hold any positions in any order (contiguous, zigzag,
round-robin): with ``kv_positions`` every slot carries its token's global
position, the mask is computed on those, and empty slots hold
:data:`EMPTY_POSITION` (or any negative number), which no query sees.

The per-shard steps of :mod:`jax_seqpar.api.inference` live here too: dealing a
prompt into round-robin slots, and appending new tokens (refused, writing nothing,
when a row would pass the cache's capacity) before attending.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core.quant import ComputeLike
from jax_seqpar import kernels
from jax_seqpar.core import checks, layout, masks, quant
from jax_seqpar.core.shape import check_counts
from jax_seqpar.kernels import tiling
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.strategies.inputs import Options, check_ids, check_qkv
from jax_seqpar.strategies.wire import rotated
from jax_seqpar.kernels import make_options
from jax_seqpar.core.merge import check_sinks, merge_across
from jax_seqpar.kernels import KernelName

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.kernels.contract import BlockSizes

__all__ = ["ENTRY", "EMPTY_POSITION", "Step", "append_and_attend", "deal_round_robin",
           "decode_attention", "decode_bytes", "overflow_message"]

#: Keys or values as a cache stores them: an array ``[B, L, Hkv, D]``, or FP8 ``(values
#: [B, L, Hkv, D], float32 scales [B, L, Hkv])`` (:func:`jax_seqpar.core.quant.quantize`).
Stored = Union[jax.Array, tuple[jax.Array, jax.Array]]

#: The position of an empty cache slot, later than every query, so the causal
#: mask hides it and whole empty key blocks are skipped.
EMPTY_POSITION = 2**31 - 1


def _heads_as_tokens(options: Options, q, k_cache, v_cache, q_tokens: masks.Tokens,
                     kv_tokens: masks.Tokens):
    """The local attention with every (token, KV head) pair as a token of one KV head.

    ``[B, C/P, Hkv, D] -> [B, C/P * Hkv, 1, D]`` is a free reshape, and a pair
    sees only the pairs of its head (one segment per KV head). The kernel then
    reads the cache shard in place: with ``Hkv > 1`` heads-first tiles would make
    XLA relayout the whole shard first (a second cache-sized buffer); the cost is
    ``Hkv`` times the score arithmetic, small next to reading the cache once.

    Args:
      q_tokens, kv_tokens: the queries' ``[B, T]`` and the slots' ``[B, C/P]``
        metadata (positions, optional bidirectional ids; no segment ids).

    Returns:
      ``(out float32[B, T, H, Dv], lse float32[B, T, H])``.
    """
    batch, new_tokens, heads, _ = q.shape
    slots, kv_heads = k_cache.shape[1:3]
    head = jnp.arange(kv_heads, dtype=jnp.int32)[None, None]  # [1, 1, Hkv]

    def pairs(tokens):  # [B, L] fields -> [B, L * Hkv], the KV head as the segment id
        spread = lambda x: None if x is None else jnp.broadcast_to(
            x[:, :, None], x.shape + (kv_heads,)).reshape(batch, -1)
        return masks.Tokens(spread(tokens.positions),
                            jnp.broadcast_to(head, tokens.positions.shape + (kv_heads,))
                            .reshape(batch, -1), spread(tokens.bidirectional_ids))

    q = q.reshape(batch, new_tokens * kv_heads, heads // kv_heads, q.shape[3])  # [B, T*Hkv, G, D]
    k_cache = k_cache.reshape(batch, slots * kv_heads, 1, k_cache.shape[3])  # [B, C/P*Hkv, 1, D]
    v_cache = v_cache.reshape(batch, slots * kv_heads, 1, v_cache.shape[3])
    out, lse = kernels.forward(options, q, k_cache, v_cache, pairs(q_tokens), pairs(kv_tokens))
    return out.reshape(batch, new_tokens, heads, -1), lse.reshape(batch, new_tokens, heads)


def _attend_slots(options: Options, q, k_cache, v_cache, q_tokens: masks.Tokens,
                  kv_tokens: masks.Tokens):
    """This shard's partial ``(out float32[B, T, H, Dv], lse float32[B, T, H])`` of the
    queries against its slots; a slot at ``EMPTY_POSITION`` is later than every query
    (the mask is always causal) and never seen."""
    if k_cache.shape[2] == 1:  # MQA / MLA: tiles are heads-first already
        return kernels.forward(options, q, k_cache, v_cache, q_tokens, kv_tokens)
    return _heads_as_tokens(options, q, k_cache, v_cache, q_tokens, kv_tokens)


def _hide_unwritten(kv_positions, seq_lengths):
    """``int32[B, C/P]`` slot positions with every slot at or past ``seq_lengths`` (stale
    or empty) and every negative "empty" marker at :data:`EMPTY_POSITION`: later than
    every query, so the causal mask hides them."""
    kv_positions = kv_positions.astype(jnp.int32)
    hidden = (kv_positions < 0) | (kv_positions >= seq_lengths[:, None])
    return jnp.where(hidden, EMPTY_POSITION, kv_positions)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *,
                     seq_axes: str | tuple[str, ...], seq_lengths: jax.Array,
                     scale: float | None = None, kernel: KernelName = "auto",
                     kv_positions: jax.Array | None = None,
                     window: int | tuple[int, int] | None = None,
                     block_sizes: BlockSizes | None = None, softcap: float | None = None,
                     compute_dtype: ComputeLike = None,
                     sinks: jax.Array | None = None, chunk_size: int | None = None,
                     mask_fn: Callable | None = None):
    """Attend new queries to a sequence-sharded cache (call inside ``shard_map``).

    Args:
      q: ``[B, T, H, Dqk]`` the T newest tokens' queries, the same on every device;
        query ``t`` sits at global position ``seq_lengths - T + t`` and sees cache
        entries at positions ``<=`` its own (so ``T > 1`` is causal among them).
      k_cache: ``[B, C/P, Hkv, Dqk]``; v_cache: ``[B, C/P, Hkv, Dv]`` this device's
        slice of a cache of capacity ``C`` (any dtype; softmax in float32).
      seq_axes: the mesh axis (or tuple of axes) the cache is split over.
      seq_lengths: ``int32[B]`` each row's true length: tokens in the cache (positions
        ``0 .. seq_lengths-1``), including the T new tokens.
      scale: defaults to ``1/sqrt(Dqk)``; kernel: ``"auto"``, ``"xla"``, ``"pallas"``,
        ``"mosaic"``.
      kv_positions: ``int32[B, C/P]`` the global position held by each local slot
        (:data:`EMPTY_POSITION` or negative: empty). Default: the contiguous split,
        slot ``i`` of device ``r`` holds position ``r*C/P + i``.
      window: ``(left, right)`` or one int: query ``i`` sees keys ``i-left .. i``;
        key blocks wholly outside every query's window are skipped.
      block_sizes: the kernel's tile sizes, or None.
      compute_dtype: the products' dtype, as in
        :func:`jax_seqpar.sequence_parallel_attention` (None: the cache's).
      softcap: logit soft-cap, or None; sinks: ``[H]`` sink logits (replicated), or None.
      chunk_size: a query sees only keys of its chunk (``position // chunk_size``);
        mask_fn: a predicate on the queries' and the slots' metadata (their positions;
        see :class:`jax_seqpar.core.masks.MaskSpec`). Both as in
        :func:`jax_seqpar.sequence_parallel_attention`. (Bidirectional ids need the ids
        the cache holds: :func:`jax_seqpar.api.inference.decode` keeps them.)

    Returns:
      ``[B, T, H, Dv]`` in ``q.dtype``, the same on every device.

    .. code-block:: python

        f = lambda q, k, v, n: decode_attention(q, k, v, seq_axes="sp", seq_lengths=n)
        out = jax.shard_map(f, mesh=mesh, in_specs=(P(), P(None, "sp"), P(None, "sp"), P()),
                            out_specs=P())(q, k_cache, v_cache, seq_lengths)
    """
    check_qkv(q, k_cache, v_cache)
    check_sinks(sinks, q.shape[2])
    batch, new_tokens = q.shape[:2]
    if tuple(seq_lengths.shape) != (batch,):
        raise ValueError(f"seq_lengths must have shape [batch]=({batch},). "
                         f"Got {tuple(seq_lengths.shape)}.")
    check_ids("kv_positions", kv_positions, batch, k_cache.shape[1])
    spec = masks.MaskSpec.make(True, window, chunk_size, mask_fn)
    checks.mask_fn(spec, batch, new_tokens, k_cache.shape[1])
    options = make_options(q, spec, scale=scale, kernel=kernel, block_sizes=block_sizes,
                           softcap=softcap,
                           compute_dtype=compute_dtype)
    seq_lengths = seq_lengths.astype(jnp.int32)
    if kv_positions is None:
        kv_positions = layout.shard_positions("contiguous", k_cache.shape[1],
                                              axis_name=seq_axes)
        kv_positions = jnp.broadcast_to(kv_positions, (batch, k_cache.shape[1]))
    q_positions = seq_lengths[:, None] - new_tokens + jnp.arange(new_tokens, dtype=jnp.int32)[None]
    # The Hadamard rotation where asked: of q and of this shard's cached keys, each call
    # (an FP8 KVCache stores its keys rotated instead: jax_seqpar.api.inference.decode).
    options, q_in, k_cache = rotated(options, q, k_cache)
    out, lse = _attend_slots(options, q_in, k_cache, v_cache, masks.Tokens(q_positions),
                             masks.Tokens(_hide_unwritten(kv_positions, seq_lengths)))
    # out float32 [B, T, H, Dv], lse float32 [B, T, H]
    return merge_across(out, lse, seq_axes, sinks).astype(q.dtype)  # [B, T, H, Dv]


# --- the per-shard steps of a sequence-sharded KV cache (jax_seqpar.api.inference) ---

def overflow_message(lengths: jax.typing.ArrayLike, new_tokens: int, capacity: int) -> str:
    """What a refused step says: the capacity, the fullest row's length, the tokens asked
    (``lengths``: concrete ``int[B]``, a jax or numpy array)."""
    lengths = np.asarray(lengths)
    row = int(np.argmax(lengths))
    return (f"the KV cache is full: capacity={capacity} tokens per row, row {row} holds "
            f"length={int(lengths[row])} and {new_tokens} new token(s) were asked for "
            f"({int(lengths[row])} + {new_tokens} > {capacity}); nothing was written. Create "
            f"the cache with capacity >= {int(lengths.max()) + new_tokens} (the longest "
            f"sequence), or start a new one.")


def _refuse_overflow(fits, lengths, new_tokens: int, capacity: int):
    """Inside a traced step: ``lengths``, or a host error when the step runs unless ``fits``
    (:func:`jax_seqpar.core.checks.refuse_unless`)."""
    return checks.refuse_unless(
        fits, lambda lengths: overflow_message(lengths, int(new_tokens), int(capacity)),
        lengths, lengths)


def deal_round_robin(k: Stored, v: Stored, lengths: jax.Array, k_cache: Stored,
                     v_cache: Stored, *, axis_name: str | tuple[str, ...]):
    """Per shard: the contiguous prompt shard into its round-robin slots (one ``all_to_all``).

    Shard ``r`` holds positions ``r*L .. r*L+L-1``; position ``p`` belongs on shard
    ``p % P`` in slot ``p // P``. Padded to whole groups of ``P`` tokens, local token
    ``a*P + j`` goes to shard ``(r*L + j) % P``: rolling each group by ``r*L % P``
    puts the token for shard ``d`` in column ``d``, and one ``all_to_all`` deals
    the columns (positions travel with the tokens).

    Args:
      k: ``[B, L, Hkv, Dqk]``, v: ``[B, L, Hkv, Dv]`` this shard of the prompt.
      lengths: ``int32[B]`` true prompt lengths (later tokens are not written).
      k_cache: ``[B, C/P, Hkv, Dqk]``, v_cache: ``[B, C/P, Hkv, Dv]``.
      (FP8: each of k, v, k_cache, v_cache a ``(values, scales)`` pair, ``Stored``.)
    Returns:
      The new local k, v and ``int32[B, C/P]`` positions (the rest of the slots empty).
    """
    shards, shard = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    batch, local_len = jax.tree.leaves(k)[0].shape[:2]
    groups = -(-local_len // shards)
    index = jnp.arange(groups * shards, dtype=jnp.int32)
    positions = shard * local_len + index  # [L'], L' = groups * P
    written = (index < local_len)[None] & (positions[None] < lengths[:, None])  # [B, L']
    positions = jnp.where(written, positions[None], EMPTY_POSITION)  # [B, L']

    def deal(x):
        x = tiling.pad_seq(x, groups * shards)  # [B, L', ...]
        x = x.reshape(batch, groups, shards, *x.shape[2:])  # [B, L'/P, P, ...]
        x = jnp.roll(x, shard * local_len % shards, axis=2)  # column d: for shard d
        x = jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=2, tiled=True)
        return x.reshape(batch, groups * shards, *x.shape[3:])  # [B, L', ...] from all shards

    k, v, positions = jax.tree.map(deal, k), jax.tree.map(deal, v), deal(positions)
    local_capacity = jax.tree.leaves(k_cache)[0].shape[1]
    slot = jnp.where(positions == EMPTY_POSITION, local_capacity,
                     positions // shards)  # [B, L'] (a prompt fits the cache); empty: dropped
    empty = jnp.full((batch, local_capacity), EMPTY_POSITION, jnp.int32)
    return _put_stored(k_cache, slot, k), _put_stored(v_cache, slot, v), _put(empty, slot,
                                                                              positions)


#: ``cache[b, slot[b, t]] = x[b, t]`` per row; slots out of range are dropped.
_put = jax.vmap(lambda cache, slot, x: cache.at[slot].set(x.astype(cache.dtype), mode="drop"))


def _put_stored(cache: Stored, slot: jax.Array, x: Stored) -> Stored:
    """:data:`_put` of each array of ``x`` (FP8: values and scales) into ``cache``'s."""
    return jax.tree.map(lambda c, new: _put(c, slot, new), cache, x)


def _dequantized(x: Stored) -> jax.Array:
    """A cache shard as the kernel takes it: itself, or FP8 ``(values, scales)`` in
    float32 (:func:`jax_seqpar.core.quant.dequantize`), which the FP8 kernel quantizes back
    to the same values (its scales to float32 rounding)."""
    return quant.dequantize(*x) if isinstance(x, tuple) else x


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Step:
    """The dynamic operands of one decode step, the same on every device (a pytree).

    Attributes:
      q: ``[B, T, H, Dqk]``; k: ``[B, T, Hkv, Dqk]``; v: ``[B, T, Hkv, Dv]`` the new tokens
        (against an FP8 cache: q float32, k and v as it stores them, ``Stored``).
      bidirectional_ids: ``int32[B, T]`` the new tokens' ids, or None (all 0). Every
        cached token is earlier than every new one and seen anyway, so the ids only
        lift causality among the step's own tokens: nothing of them is stored.
      sinks: ``float32[H]`` sink logits, or None.
    """

    q: jax.Array
    k: Any
    v: Any
    bidirectional_ids: Optional[jax.Array] = None
    sinks: Optional[jax.Array] = None


def append_and_attend(step: Step, k_cache: Stored, v_cache: Stored, positions: jax.Array,
                      length: jax.Array, fits: jax.Array, *, axis_name: str | tuple[str, ...],
                      options: Options, ring: bool = False, check: bool = True):
    """Per shard: write the new tokens this shard owns, attend to the local slots, merge.

    ``step``: the new tokens (the same on every device); k_cache/v_cache:
    ``[B, C/P, Hkv, D]`` (FP8: ``(values, scales)`` pairs, ``Stored``, attended
    dequantized to float32), positions ``int32[B, C/P]``; ``fits``: whether the step is
    allowed (a refused one writes nothing); ``options``: the kernel's static options
    (an always causal mask); ``ring``: a sliding-window cache, where position ``p``
    overwrites ``p - C``; ``check``: a refused step raises.
    """
    new_tokens, local_capacity = step.q.shape[1], positions.shape[1]
    shards, shard = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    if check:
        length = _refuse_overflow(fits, length, new_tokens, local_capacity * shards)
    new_positions = length[:, None] + jnp.arange(new_tokens, dtype=jnp.int32)[None]  # [B, T]
    slot = new_positions // shards  # past the capacity only in a refused step
    if ring:
        slot = slot % local_capacity
    mine = (new_positions % shards == shard) & fits
    slot = jnp.where(mine, slot, local_capacity)  # others' tokens (and a refused step): dropped
    k_cache, v_cache = (_put_stored(k_cache, slot, step.k),
                        _put_stored(v_cache, slot, step.v))  # [B, C/P, Hkv, D]
    positions = _put(positions, slot, new_positions)  # [B, C/P]
    kv_tokens = masks.Tokens(_hide_unwritten(positions, length + new_tokens))
    if step.bidirectional_ids is not None:  # cached slots: 0 (earlier than every query)
        kv_tokens.bidirectional_ids = _put(jnp.zeros_like(positions), slot,
                                           step.bidirectional_ids)  # [B, C/P]
    q_tokens = masks.Tokens(new_positions, None, step.bidirectional_ids)
    # The Hadamard rotation where still asked (FP8 compute on a wider cache: q and this
    # shard's keys each step; an FP8 cache holds its keys rotated and asks for none).
    options, q, k = rotated(options, step.q, _dequantized(k_cache))
    out, lse = _attend_slots(options, q, k, _dequantized(v_cache), q_tokens, kv_tokens)
    out = merge_across(out, lse, axis_name, step.sinks).astype(step.q.dtype)
    return out, k_cache, v_cache, positions  # out [B, T, H, Dv], the same on every device


def decode_bytes(sizes: tuple[int, ...], *, batch: int, seq_len: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, v_head_dim: int, **_: object) -> float:
    """Sharded-cache decode (:mod:`jax_seqpar.api.inference`): only the merge communicates.

    ``seq_len`` is ``T``, the new tokens; the cache never moves. One ``pmax`` of
    the float32 lse ``[B, T, H]`` and two ``psum`` s, of the float32 weights
    ``[B, T, H]`` and weighted outputs ``[B, T, H, Dv]``: ``2(P-1)/P`` of each,
    whatever the dtype of q/k/v.
    """
    check_counts(batch=batch, seq_len=seq_len, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim)
    devices = math.prod(sizes)
    rows = batch * seq_len * num_heads
    return 2 * (devices - 1) / devices * rows * (v_head_dim + 2) * 4


#: The registry entry (:mod:`jax_seqpar.strategies.registry`) of new tokens attending to a
#: sequence-sharded KV cache, forward only; the global entry point does not run it.
ENTRY = Strategy("decode", decode_attention, decode_bytes, global_view=False)
