"""Long-context inference: a KV cache sharded along the sequence, prefill and decode.

A million-token KV cache does not fit one chip, and one new token has nothing to
split, so the cache is what is sharded: every device holds ``C/P`` slots of a
cache of capacity ``C``, attends the new queries to them and the partial results
merge exactly (:func:`jax_seqpar.strategies.decode.decode_attention`: one ``pmax`` and two
``psum`` s, arXiv:2408.04093).

Placement is round-robin: position ``p`` lives on shard ``p % P`` in local slot
``p // P``. Every shard therefore holds ``length/P`` tokens (+-1) of
every row however long the rows are, a new token lands on exactly one shard, and
the shards that hold a sliding window's keys are all of them, each with ``1/P``
of the window. Every slot carries its token's position, so attention is exact
whatever the placement; empty slots hold
:data:`~jax_seqpar.strategies.decode.EMPTY_POSITION` and are never seen.

Capacity is a contract: a row holds at most ``C`` tokens. A :func:`decode` that
would take a row past ``C`` is refused and writes nothing (the cache stays as it
was): called eagerly it raises ``ValueError`` before any work, naming the capacity,
the row's length and the tokens asked for; traced under ``jax.jit`` the compiled
step checks the lengths on the device and a host callback on every shard raises
the same message when the step runs: the step fails, and reading any of its outputs
raises ``jax.errors.JaxRuntimeError`` whose text ends with that ``ValueError`` (with
asynchronous dispatch, at the first read). A step jitted with ``donate_argnums`` on the cache has given its
input buffers away when it starts, so after a refused donated step the old cache
is gone too: keep ``cache.length + T <= capacity`` (or call without donating) to
recover from a refusal. A prompt longer than ``C`` is refused by :func:`prefill`
from its shape. Give the cache the capacity of the longest sequence. A sliding
window lifts the limit only where the cache is made for it, by opting in:
``KVCache.create(..., window=W)`` is a ring (position ``p`` overwrites ``p - C``)
that keeps each row's latest ``C`` tokens, exact for decodes that see at most ``W``
keys back (``window=(left <= W, 0)``) with ``T <= C - W`` new tokens a step, which
it checks.

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
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar.core import checks, masks
from jax_seqpar.kernels import tiling
from jax_seqpar.strategies.inputs import check_qkv, check_self_attention
from jax_seqpar.api import placement as _placement
from jax_seqpar.api.placement import place as _place
from jax_seqpar.api.attention import axis_name_of, can_check_vma, sequence_parallel_attention
from jax_seqpar.strategies import decode as decode_steps
from jax_seqpar.strategies.decode import EMPTY_POSITION


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
      window: None (every token keeps its slot), or ``W``: a sliding-window cache that
        keeps each row's latest ``C`` tokens, for attention that sees ``W`` keys back
        at most (static).
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array
    mesh: jax.sharding.Mesh = _static()
    seq_axes: tuple = _static()
    window: Optional[int] = _static(default=None)

    @classmethod
    def create(cls, mesh: jax.sharding.Mesh, *, batch: int, capacity: int, num_kv_heads: int,
               head_dim: int, v_head_dim: Optional[int] = None, dtype=jnp.bfloat16,
               seq_axes: Union[str, tuple] = "sp", window: Optional[int] = None) -> "KVCache":
        """An empty cache of ``capacity`` slots per row, created sharded (never whole).

        Args:
          mesh: the device mesh (Explicit or Auto axis types).
          batch, capacity: rows and slots per row (``capacity`` divisible by the
            number of shards).
          num_kv_heads, head_dim: ``Hkv`` and ``Dqk``; v_head_dim: ``Dv``
            (default ``head_dim``; MLA absorbed: ``Hkv=1``, 576 / 512).
          dtype: storage dtype of k and v.
          seq_axes: the mesh axis (or tuple of axes) the slots are split over.
          window: opt in to a bounded cache for sliding-window attention that sees at
            most ``window`` keys back: position ``p`` overwrites ``p - capacity``, so
            rows never fill up, and every decode must attend with
            ``window=(left <= window, 0)`` and ``T <= capacity - window`` new tokens (a
            query then never needs an overwritten key). None (default): every token
            keeps its slot and a full row refuses more.

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
        k, v, positions, length = _empty(mesh, axes, batch, capacity, num_kv_heads, head_dim,
                                         v_head_dim, np.dtype(dtype))()
        if window is not None and (isinstance(window, bool) or not isinstance(
                window, numbers.Integral) or not 0 <= window < capacity):
            raise ValueError(f"window must be an int in 0..capacity-1={capacity - 1} (the keys "
                             f"a query sees back). Got window={window!r}.")
        return cls(k, v, positions, length, mesh=mesh, seq_axes=axes,
                   window=None if window is None else int(window))

    @property
    def capacity(self) -> int:
        """``C``, slots per row."""
        return self.k.shape[1]

    @property
    def num_shards(self) -> int:
        """``P``, devices along ``seq_axes``."""
        return math.prod(self.mesh.shape[name] for name in self.seq_axes)

    def check_room(self, new_tokens: int) -> None:
        """Raise ``ValueError`` if appending ``new_tokens`` to some row would pass the capacity.

        Reads ``length`` (a small host transfer) when it is concrete; a cache traced
        under ``jit`` is checked by the compiled step instead (see the module docstring).
        """
        if self.window is not None or isinstance(self.length, jax.core.Tracer):
            return
        lengths = np.asarray(self.length)
        if (lengths + new_tokens > self.capacity).any():
            raise ValueError(decode_steps.overflow_message(lengths, new_tokens, self.capacity))

    def _specs(self):
        seq = P(None, axis_name_of(self.seq_axes))
        return seq, seq, seq

    def _placed(self):
        """``(k, v, positions)`` sharded along the sequence, as ``shard_map`` takes them (a
        cache made or carried inside ``jit`` may have lost its sharding in its type)."""
        return tuple(_place(x, self.mesh, spec)
                     for x, spec in zip((self.k, self.v, self.positions), self._specs()))


@functools.lru_cache(maxsize=None)
def _empty(mesh, axes, batch, capacity, num_kv_heads, head_dim, v_head_dim, dtype):
    """The jitted maker of an empty cache's arrays, one per signature (compiled once)."""
    seq = NamedSharding(mesh, P(None, axis_name_of(axes)))

    @functools.partial(jax.jit, out_shardings=(seq, seq, seq, NamedSharding(mesh, P())))
    def empty():
        return (jnp.zeros((batch, capacity, num_kv_heads, head_dim), dtype),
                jnp.zeros((batch, capacity, num_kv_heads, v_head_dim), dtype),
                jnp.full((batch, capacity), EMPTY_POSITION, jnp.int32),
                jnp.zeros((batch,), jnp.int32))

    return empty


def _check_against_cache(k, v, cache: KVCache) -> None:
    expected = (cache.k.shape[0], cache.k.shape[2], cache.k.shape[3], cache.v.shape[3])
    got = (k.shape[0], k.shape[2], k.shape[3], v.shape[3])
    if got != expected:
        raise ValueError(f"k/v [batch, ., kv_heads, head_dim] / v_head_dim must match the "
                         f"cache's (batch, Hkv, Dqk, Dv)={expected}. Got {got}.")


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
        raise ValueError(f"the prompt has {seq_len} tokens but the cache holds only "
                         f"capacity={cache.capacity} per row (prefill replaces its content: "
                         f"length 0 + {seq_len} tokens asked); create a larger KVCache.")
    lengths = checks.lengths("lengths", lengths, batch)  # int32[B] or None
    if lengths is not None:
        lengths = jnp.asarray(lengths, jnp.int32)
    # Eager arrays replicated onto the cache's mesh: left on one device, the programs'
    # inputs would take whatever sharding the partitioner propagates back to them, which
    # no mesh spec may name.
    q, k, v, lengths, sinks = _placement.onto(cache.mesh, q, k, v, lengths,
                                              None if sinks is None else jnp.asarray(sinks))
    lengths = _prompt_lengths(lengths, batch=batch, seq_len=seq_len)
    segment_ids = None
    if not causal:  # causal prompts never see their own later padding; others must not
        segment_ids = _padding_segments(lengths, seq_len=seq_len)
    seq_axes = cache.seq_axes if len(cache.seq_axes) > 1 else cache.seq_axes[0]
    # The attention is its own staged program (sequence_parallel_attention), the cache
    # write another: each compiles once, and what the attention builds inside stays there.
    out = sequence_parallel_attention(
        q, k, v, mesh=cache.mesh, seq_axes=seq_axes, strategy=strategy, causal=causal,
        segment_ids=segment_ids, window=window, scale=scale, layout=layout, kernel=kernel,
        block_sizes=block_sizes, softcap=softcap, sinks=sinks)  # [B, S, H, Dv], like q
    return out, _write_prompt(k, v, cache, lengths)


@functools.partial(jax.jit, static_argnames=("batch", "seq_len"))
def _prompt_lengths(lengths, *, batch: int, seq_len: int):
    """``int32[B]``: the true prompt lengths (default ``S``), at most ``S``."""
    if lengths is None:
        return jnp.full((batch,), seq_len, jnp.int32)
    return jnp.minimum(lengths.astype(jnp.int32), seq_len)


@functools.partial(jax.jit, static_argnames="seq_len")
def _padding_segments(lengths, *, seq_len: int):
    """``int32[B, S]``: 0 for the prompt's tokens, 1 for its padding."""
    return (jnp.arange(seq_len)[None] >= lengths[:, None]).astype(jnp.int32)


# One program per signature (eagerly: one program, compiled once, not a program per
# operation with a fresh shard_map each call).
@jax.jit
def _write_prompt(k, v, cache: KVCache, lengths):
    """The cache holding the prompts' ``k, v [B, S, Hkv, D]``, dealt round-robin."""
    # Whole shards are dealt: the prompt padded to a length they divide (the padding is
    # past ``lengths``, so it is never written).
    padded = _placement.padded_length(k.shape[1], cache.num_shards)
    k, v = (tiling.pad_seq(x, padded) for x in (k, v))  # [B, S', Hkv, D]
    axis_name = axis_name_of(cache.seq_axes)
    seq = P(None, axis_name)
    k, v = (_place(x, cache.mesh, seq) for x in (k, v))
    lengths = _place(lengths, cache.mesh, P())
    write = jax.shard_map(functools.partial(decode_steps.deal_round_robin, axis_name=axis_name),
                          mesh=cache.mesh, in_specs=(seq, seq, P(), seq, seq),
                          out_specs=cache._specs())
    new_k, new_v, positions = write(k, v, lengths, *cache._placed()[:2])
    return dataclasses.replace(cache, k=new_k, v=new_v, positions=positions, length=lengths)


def decode(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, *, window=None,
           scale: Optional[float] = None, kernel: str = "auto", block_sizes=None,
           softcap: Optional[float] = None, sinks: Optional[jax.Array] = None,
           check_capacity: bool = True):
    """Append ``T >= 1`` new tokens per row and attend them to the whole cache.

    Row ``b``'s new tokens take positions ``length[b] .. length[b]+T-1`` (rows may
    have different lengths) and see every cached token before them, and each
    other causally. Each token is written on one shard only (round-robin); the
    only communication is the merge of the partial results.

    Args:
      q: ``[B, T, H, Dqk]``; k: ``[B, T, Hkv, Dqk]``; v: ``[B, T, Hkv, Dv]`` the new
        tokens (k/v stored in the cache's dtype; softmax in float32).
      cache: the :class:`KVCache` (``length + T <= capacity`` in every row).
      window: ``(left, right)`` or one int: query ``i`` sees keys ``i-left .. i``;
        key blocks outside every window are skipped.
      scale, kernel, block_sizes, softcap, sinks: as in
        :func:`jax_seqpar.strategies.decode.decode_attention`.
      check_capacity: under ``jit``, raise (from a host callback) when a step is refused.
        False only for a caller that has sized the cache for every step it runs (as
        ``generate`` does): a refused step still writes nothing, but says nothing under
        ``jit``. (A program holding a host callback cannot also hold a split-axis
        hybrid prefill: JAX then requires one mesh across the whole program.)

    Returns:
      ``(out [B, T, H, Dv] in q.dtype, replicated; cache with length + T)``.

    Raises:
      ValueError: shapes that do not match the cache or each other; a step that would
        take a row past the capacity (nothing is written). Under ``jit`` the capacity
        check runs with the step and raises ``jax.errors.JaxRuntimeError`` carrying
        the same message (see the module docstring, donation included).

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
    if cache.window is not None:
        left, right = masks.normalize_window(window) or (None, 0)
        if left is None or left > cache.window or right:
            raise ValueError(f"this cache keeps only each row's latest {cache.capacity} tokens "
                             f"(KVCache window={cache.window}); decode must attend with "
                             f"window=(left <= {cache.window}, 0). Got window={window!r}.")
        if new_tokens + cache.window > cache.capacity:
            raise ValueError(f"{new_tokens} new tokens would overwrite keys the window of "
                             f"{cache.window} still sees in a cache of capacity="
                             f"{cache.capacity}; decode at most "
                             f"{cache.capacity - cache.window} tokens a step.")
    cache.check_room(new_tokens)
    call = _Decode(window=masks.normalize_window(window),
                   scale=None if scale is None else float(scale), kernel=kernel,
                   block_sizes=block_sizes, softcap=None if softcap is None else float(softcap),
                   check_capacity=bool(check_capacity))
    q, k, v, sinks = _placement.onto(cache.mesh, q, k, v,
                                     None if sinks is None else jnp.asarray(sinks))  # as prefill
    return _decode(q, k, v, cache, sinks, call=call)


@dataclasses.dataclass(frozen=True)
class _Decode:
    """The static options of a decode step (hashable: the key of its compiled program)."""

    window: Optional[tuple]
    scale: Optional[float]
    kernel: str
    block_sizes: object
    softcap: Optional[float]
    check_capacity: bool


@functools.partial(jax.jit, static_argnames="call")
def _decode(q, k, v, cache: KVCache, sinks, *, call: _Decode):
    new_tokens = q.shape[1]
    new_length = cache.length + new_tokens  # [B]
    fits = jnp.all(new_length <= cache.capacity) | (cache.window is not None)  # a ring fits
    axis_name = axis_name_of(cache.seq_axes)
    options = dict(window=call.window, scale=call.scale, kernel=call.kernel,
                   block_sizes=call.block_sizes, softcap=call.softcap)
    step = jax.shard_map(
        functools.partial(decode_steps.append_and_attend, axis_name=axis_name, options=options,
                          ring=cache.window is not None, check=call.check_capacity),
        mesh=cache.mesh, in_specs=(P(),) * 3 + cache._specs() + (P(), P(), P()),
        out_specs=(P(),) + cache._specs(), check_vma=can_check_vma(call.kernel))
    q, k, v, length, fits = (_place(x, cache.mesh, P()) for x in (q, k, v, cache.length, fits))
    if sinks is not None:
        sinks = _place(sinks, cache.mesh, P())
    out, new_k, new_v, positions = step(q, k, v, *cache._placed(), length, fits, sinks)
    return out, dataclasses.replace(cache, k=new_k, v=new_v, positions=positions,
                                    length=jnp.where(fits, new_length, cache.length))
