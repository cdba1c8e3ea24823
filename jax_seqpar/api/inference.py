"""Long-context inference: a KV cache sharded along the sequence, prefill and decode.

A million-token KV cache does not fit one chip, and one new token has nothing to
split, so the cache is what is sharded: every device holds ``C/P`` slots of a
cache of capacity ``C``, attends the new queries to them and the partial results
merge exactly (:func:`jax_seqpar.strategies.decode.decode_attention`: one ``pmax`` and two
``psum`` s, arXiv:2408.04093).

Placement is round-robin: position ``p`` lives on shard ``p % P`` in local slot
``(p // P) % (C/P)``. Every shard therefore holds ``length/P`` tokens (+-1) of
every row however long the rows are, a new token lands on exactly one shard, and
the shards that hold a sliding window's keys are all of them, each with ``1/P``
of the window. Every slot carries its token's position, so attention is exact
whatever the placement; empty slots hold
:data:`~jax_seqpar.strategies.decode.EMPTY_POSITION` and are never seen.

A cache that fills up keeps its latest ``C`` tokens (position ``p`` overwrites
``p - C``): exact for ``window=(left, 0)`` with ``left + T <= C``; for full
attention give the cache the capacity of the longest sequence.

>>> mesh = jax.make_mesh((8,), ("sp",))
>>> cache = KVCache.create(mesh, batch=1, capacity=4096, num_kv_heads=8, head_dim=128)
>>> out, cache = prefill(q, k, v, cache, strategy="ring")  # q [1, S, 32, 128]
>>> out, cache = decode(q_new, k_new, v_new, cache)        # q_new [1, 1, 32, 128]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar.kernels import tiling
from jax_seqpar.core import checks
from jax_seqpar.strategies.inputs import check_qkv, check_self_attention
from jax_seqpar.api import placement as _placement
from jax_seqpar.api.placement import place as _place
from jax_seqpar.api.attention import axis_name_of, can_check_vma, sequence_parallel_attention
from jax_seqpar.strategies.decode import EMPTY_POSITION, decode_attention


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of a batch of sequences, sharded along the sequence (a pytree).

    Attributes:
      k: ``[B, C, Hkv, Dqk]`` keys, sharded ``P(None, seq_axes)``.
      v: ``[B, C, Hkv, Dv]`` values, sharded likewise.
      positions: ``int32[B, C]`` the global position each slot holds
        (:data:`~jax_seqpar.strategies.decode.EMPTY_POSITION`: empty), sharded likewise.
      length: ``int32[B]`` tokens written per row (positions ``0 .. length-1``).
      mesh: the device mesh (static).
      seq_axes: the mesh axes splitting the slots, a tuple of names (static).
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array
    mesh: jax.sharding.Mesh = _static()
    seq_axes: tuple = _static()

    @classmethod
    def create(cls, mesh: jax.sharding.Mesh, *, batch: int, capacity: int, num_kv_heads: int,
               head_dim: int, v_head_dim: Optional[int] = None, dtype=jnp.bfloat16,
               seq_axes: Union[str, tuple] = "sp") -> "KVCache":
        """An empty cache of ``capacity`` slots per row, created sharded (never whole).

        Args:
          mesh: the device mesh (Explicit or Auto axis types).
          batch, capacity: rows and slots per row (``capacity`` divisible by the
            number of shards).
          num_kv_heads, head_dim: ``Hkv`` and ``Dqk``; v_head_dim: ``Dv``
            (default ``head_dim``; MLA absorbed: ``Hkv=1``, 576 / 512).
          dtype: storage dtype of k and v.
          seq_axes: the mesh axis (or tuple of axes) the slots are split over.

        Raises:
          ValueError: unknown axes, non-positive sizes, or a capacity the shards
            do not divide.
        """
        axes = (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes)
        for name in axes:
            if name not in mesh.shape:
                raise ValueError(f"seq_axes names {name!r}, which is not an axis of the mesh "
                                 f"{dict(mesh.shape)}.")
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        sizes = dict(batch=batch, capacity=capacity, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, v_head_dim=v_head_dim)
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int. Got {name}={value!r}.")
        shards = math.prod(mesh.shape[name] for name in axes)
        if capacity % shards:
            raise ValueError(f"capacity={capacity} is not divisible by the {shards} shards of "
                             f"{axes}; use capacity={-(-capacity // shards) * shards}.")
        seq = NamedSharding(mesh, P(None, axis_name_of(axes)))

        @functools.partial(jax.jit, out_shardings=(seq, seq, seq, NamedSharding(mesh, P())))
        def empty():
            return (jnp.zeros((batch, capacity, num_kv_heads, head_dim), dtype),
                    jnp.zeros((batch, capacity, num_kv_heads, v_head_dim), dtype),
                    jnp.full((batch, capacity), EMPTY_POSITION, jnp.int32),
                    jnp.zeros((batch,), jnp.int32))

        return cls(*empty(), mesh=mesh, seq_axes=axes)

    @property
    def capacity(self) -> int:
        """``C``, slots per row."""
        return self.k.shape[1]

    @property
    def num_shards(self) -> int:
        """``P``, devices along ``seq_axes``."""
        return math.prod(self.mesh.shape[name] for name in self.seq_axes)

    def _specs(self):
        seq = P(None, axis_name_of(self.seq_axes))
        return seq, seq, seq

    def _placed(self):
        """``(k, v, positions)`` sharded along the sequence, as ``shard_map`` takes them (a
        cache made or carried inside ``jit`` may have lost its sharding in its type)."""
        return tuple(_place(x, self.mesh, spec)
                     for x, spec in zip((self.k, self.v, self.positions), self._specs()))


def _check_against_cache(k, v, cache: KVCache) -> None:
    expected = (cache.k.shape[0], cache.k.shape[2], cache.k.shape[3], cache.v.shape[3])
    got = (k.shape[0], k.shape[2], k.shape[3], v.shape[3])
    if got != expected:
        raise ValueError(f"k/v [batch, ., kv_heads, head_dim] / v_head_dim must match the "
                         f"cache's (batch, Hkv, Dqk, Dv)={expected}. Got {got}.")


def _deal_round_robin(k, v, lengths, k_cache, v_cache, *, axis_name):
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
    Returns:
      The new local k, v and ``int32[B, C/P]`` positions (the rest of the slots empty).
    """
    shards, shard = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    batch, local_len = k.shape[:2]
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

    k, v, positions = deal(k), deal(v), deal(positions)
    local_capacity = k_cache.shape[1]
    slot = jnp.where(positions == EMPTY_POSITION, local_capacity,
                     (positions // shards) % local_capacity)  # [B, L']; empty: dropped
    empty = jnp.full((batch, local_capacity), EMPTY_POSITION, jnp.int32)
    return _put(k_cache, slot, k), _put(v_cache, slot, v), _put(empty, slot, positions)


def prefill(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, *, causal: bool = True,
            strategy: str = "auto", lengths: Optional[jax.Array] = None, window=None,
            scale: Optional[float] = None, layout: str = "auto", kernel: str = "auto",
            block_sizes=None, softcap: Optional[float] = None, sinks: Optional[jax.Array] = None):
    """Attend over the prompts sequence-parallel and write their K/V into an emptied cache.

    Args:
      q: ``[B, S, H, Dqk]``; k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` the
        prompts at positions ``0 .. S-1`` (rows shorter than ``S`` padded at the end).
      cache: the :class:`KVCache` to fill (``S <= capacity``); its content is replaced.
      causal, window, scale, layout, kernel, block_sizes, strategy, softcap, sinks: as in
        :func:`jax_seqpar.sequence_parallel_attention` (``strategy="hybrid"``
        needs a cache over ``(outer, inner)`` axes).
      lengths: ``int32[B]`` true prompt lengths (default ``S``): later tokens are
        padding, not written to the cache, and (with ``causal=False``) not attended.

    Returns:
      ``(out [B, S, H, Dv] in q.dtype, cache)``; ``out`` of padding tokens is
      meaningless, the cache's ``length`` is ``lengths``.

    Raises:
      ValueError: shapes that do not match the cache, a prompt longer than it.

    >>> cache = KVCache.create(mesh, batch=2, capacity=8192, num_kv_heads=8, head_dim=128)
    >>> out, cache = prefill(q, k, v, cache, lengths=jnp.array([4000, 17]))
    """
    check_self_attention(q, k, v, None)
    _check_against_cache(k, v, cache)
    batch, seq_len = q.shape[:2]
    if seq_len > cache.capacity:
        raise ValueError(f"the prompt has {seq_len} tokens but the cache only "
                         f"capacity={cache.capacity}; create a larger KVCache.")
    lengths = checks.lengths("lengths", lengths, batch)
    if lengths is None:
        lengths = jnp.full((batch,), seq_len, jnp.int32)
    if tuple(jnp.shape(lengths)) != (batch,):
        raise ValueError(f"lengths must have shape [batch]=({batch},). "
                         f"Got {tuple(jnp.shape(lengths))}.")
    lengths = jnp.minimum(jnp.asarray(lengths, jnp.int32), seq_len)
    segment_ids = None
    if not causal:  # causal prompts never see their own later padding; others must not
        segment_ids = (jnp.arange(seq_len)[None] >= lengths[:, None]).astype(jnp.int32)
    seq_axes = cache.seq_axes if len(cache.seq_axes) > 1 else cache.seq_axes[0]
    out = sequence_parallel_attention(
        q, k, v, mesh=cache.mesh, seq_axes=seq_axes, strategy=strategy, causal=causal,
        segment_ids=segment_ids, window=window, scale=scale, layout=layout, kernel=kernel,
        block_sizes=block_sizes, softcap=softcap, sinks=sinks)  # [B, S, H, Dv], like q

    # The cache write deals whole shards: the prompt padded to a length they divide (the
    # padding is past ``lengths``, so it is never written).
    padded = _placement.padded_length(seq_len, cache.num_shards)
    k, v = (tiling.pad_seq(x, padded) for x in (k, v))  # [B, S', Hkv, D]
    axis_name = axis_name_of(cache.seq_axes)
    seq = P(None, axis_name)
    k, v = (_place(x, cache.mesh, seq) for x in (k, v))
    lengths = _place(lengths, cache.mesh, P())
    write = jax.shard_map(functools.partial(_deal_round_robin, axis_name=axis_name),
                          mesh=cache.mesh, in_specs=(seq, seq, P(), seq, seq),
                          out_specs=cache._specs())
    new_k, new_v, positions = write(k, v, lengths, *cache._placed()[:2])
    return out, dataclasses.replace(cache, k=new_k, v=new_v, positions=positions,
                                    length=lengths)


#: ``cache[b, slot[b, t]] = x[b, t]`` per row; slots out of range are dropped.
_put = jax.vmap(lambda cache, slot, x: cache.at[slot].set(x.astype(cache.dtype), mode="drop"))


def _append_and_attend(q, k, v, k_cache, v_cache, positions, length, sinks, *, axis_name,
                       options):
    """Per shard: write the new tokens this shard owns, attend to the local slots, merge.

    q: ``[B, T, H, Dqk]``, k/v: ``[B, T, Hkv, D]`` (the same on every device);
    k_cache/v_cache: ``[B, C/P, Hkv, D]``, positions ``int32[B, C/P]``.
    """
    new_tokens, local_capacity = q.shape[1], k_cache.shape[1]
    shards, shard = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    new_positions = length[:, None] + jnp.arange(new_tokens, dtype=jnp.int32)[None]  # [B, T]
    slot = (new_positions // shards) % local_capacity
    slot = jnp.where(new_positions % shards == shard, slot, local_capacity)  # others: dropped
    k_cache, v_cache = _put(k_cache, slot, k), _put(v_cache, slot, v)  # [B, C/P, Hkv, D]
    positions = _put(positions, slot, new_positions)  # [B, C/P]
    out = decode_attention(q, k_cache, v_cache, seq_axes=axis_name,
                           kv_length=length + new_tokens, kv_positions=positions, sinks=sinks,
                           **options)
    return out, k_cache, v_cache, positions  # out [B, T, H, Dv], the same on every device


def decode(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, *, window=None,
           scale: Optional[float] = None, kernel: str = "auto", block_sizes=None,
           softcap: Optional[float] = None, sinks: Optional[jax.Array] = None):
    """Append ``T >= 1`` new tokens per row and attend them to the whole cache.

    Row ``b``'s new tokens take positions ``length[b] .. length[b]+T-1`` (rows may
    have different lengths) and see every cached token before them, and each
    other causally. Each token is written on one shard only (round-robin); the
    only communication is the merge of the partial results.

    Args:
      q: ``[B, T, H, Dqk]``; k: ``[B, T, Hkv, Dqk]``; v: ``[B, T, Hkv, Dv]`` the new
        tokens (k/v stored in the cache's dtype; softmax in float32).
      cache: the :class:`KVCache` (``T <= capacity``).
      window: ``(left, right)`` or one int: query ``i`` sees keys ``i-left .. i``;
        key blocks outside every window are skipped.
      scale, kernel, block_sizes, softcap, sinks: as in
        :func:`jax_seqpar.strategies.decode.decode_attention`.

    Returns:
      ``(out [B, T, H, Dv] in q.dtype, replicated; cache with length + T)``.

    Raises:
      ValueError: shapes that do not match the cache or each other.

    >>> step = jax.jit(decode, donate_argnums=3)  # donated: the cache updates in place
    >>> out, cache = step(q_new, k_new, v_new, cache)  # q_new [B, 1, H, Dqk]
    """
    check_qkv(q, k, v)
    _check_against_cache(k, v, cache)
    new_tokens = q.shape[1]
    if k.shape[1] != new_tokens:
        raise ValueError(f"q and k/v must hold the same new tokens. Got q seq={new_tokens}, "
                         f"k seq={k.shape[1]}.")
    if new_tokens > cache.capacity:
        raise ValueError(f"{new_tokens} new tokens do not fit a cache of capacity="
                         f"{cache.capacity}; decode them in chunks or create a larger cache.")
    axis_name = axis_name_of(cache.seq_axes)
    options = dict(window=window, scale=scale, kernel=kernel, block_sizes=block_sizes,
                   softcap=softcap)
    step = jax.shard_map(
        functools.partial(_append_and_attend, axis_name=axis_name, options=options),
        mesh=cache.mesh, in_specs=(P(),) * 3 + cache._specs() + (P(), P()),
        out_specs=(P(),) + cache._specs(), check_vma=can_check_vma(kernel))
    q, k, v, length = (_place(x, cache.mesh, P()) for x in (q, k, v, cache.length))
    if sinks is not None:
        sinks = _place(jnp.asarray(sinks), cache.mesh, P())
    out, new_k, new_v, positions = step(q, k, v, *cache._placed(), length,
                                        sinks)
    return out, dataclasses.replace(cache, k=new_k, v=new_v, positions=positions,
                                    length=cache.length + new_tokens)
