"""The sequence-sharded KV cache of :mod:`jax_seqpar.api.inference` (its contract:
round-robin placement, capacity, the sliding-window ring, is described there).

Every device holds ``C/P`` slots of a cache of capacity ``C``; position ``p`` lives on
shard ``p % P`` in local slot ``p // P``, and every slot carries its token's position
(:data:`~jax_seqpar.strategies.decode.EMPTY_POSITION`: empty).
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

from jax_seqpar.api.placement import place as _place
from jax_seqpar.core import checks
from jax_seqpar.api.program import axis_name_of
from jax_seqpar.strategies import decode as decode_steps
from jax_seqpar.strategies.decode import EMPTY_POSITION

__all__ = ["KVCache", "check_against_cache"]

# The dtypes a cache stores: those of the queries it serves (see check_against_cache).
_DTYPES = ("float32", "bfloat16", "float16")


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
               head_dim: int, v_head_dim: Optional[int] = None,
               dtype: jax.typing.DTypeLike = jnp.float32, seq_axes: Union[str, tuple] = "sp",
               window: Optional[int] = None) -> "KVCache":
        """An empty cache of ``capacity`` slots per row, created sharded (never whole).

        Args:
          mesh: the device mesh (Explicit or Auto axis types).
          batch, capacity: rows and slots per row (``capacity`` divisible by the
            number of shards).
          num_kv_heads, head_dim: ``Hkv`` and ``Dqk``; v_head_dim: ``Dv``
            (default ``head_dim``; MLA absorbed: ``Hkv=1``, 576 / 512).
          dtype: storage dtype of k and v: float32 (default, JAX's and
            ``nnx.MultiHeadAttention.init_cache``'s), bfloat16 or float16; the dtype of
            the q, k, v that :func:`~jax_seqpar.api.inference.prefill` and
            :func:`~jax_seqpar.api.inference.decode` take (they refuse another).
          seq_axes: the mesh axis (or tuple of axes) the slots are split over.
          window: opt in to a bounded cache for sliding-window attention that sees at
            most ``window`` keys back: position ``p`` overwrites ``p - capacity``, so
            rows never fill up, and every decode must attend with
            ``window=(left <= window, 0)`` and ``T <= capacity - window`` new tokens (a
            query then never needs an overwritten key). None (default): every token
            keeps its slot and a full row refuses more.

        Raises:
          ValueError: unknown axes, non-positive sizes, a capacity the shards
            do not divide or that does not fit int32, or a dtype other than float32, bfloat16, float16.
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
        if np.dtype(dtype).name not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)} (the dtype of the queries "
                             f"the cache serves). Got dtype={np.dtype(dtype).name}.")
        if capacity > checks.INT32_MAX:
            raise ValueError(f"capacity must fit int32 (the cache's positions and lengths are "
                             f"int32): at most 2**31 - 1 = {checks.INT32_MAX} slots per row. "
                             f"Got capacity={capacity}.")
        shards = math.prod(mesh.shape[name] for name in axes)
        if capacity % shards:
            raise ValueError(f"capacity={capacity} is not divisible by the {shards} shards of "
                             f"{axes}; use capacity={-(-capacity // shards) * shards}.")
        _check_memory(mesh, batch * (capacity // shards) * (
            num_kv_heads * (head_dim + v_head_dim) * np.dtype(dtype).itemsize + 4))
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


def check_against_cache(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache) -> None:
    """Raise ``ValueError`` unless new ``k, v`` have the cache's batch, heads and dims, and
    ``q, k, v`` (one dtype, checked before) the cache's dtype: the kernels attend q to the
    cached keys, so they must share it (a wider cache would hold nothing more, a narrower
    one would silently round the new keys)."""
    if q.dtype != cache.k.dtype:
        raise ValueError(f"the cache stores {cache.k.dtype.name} keys and values but q is "
                         f"{q.dtype.name}: create the cache with dtype={q.dtype.name} "
                         f"(KVCache.create(..., dtype=...), or SelfAttention.init_cache(..., "
                         f"dtype=...)), or cast q, k and v to {cache.k.dtype.name}.")
    expected = (cache.k.shape[0], cache.k.shape[2], cache.k.shape[3], cache.v.shape[3])
    got = (k.shape[0], k.shape[2], k.shape[3], v.shape[3])
    if got != expected:
        raise ValueError(f"k/v [batch, ., kv_heads, head_dim] / v_head_dim must match the "
                         f"cache's (batch, Hkv, Dqk, Dv)={expected}. Got {got}.")


def _check_memory(mesh: jax.sharding.Mesh, per_device: int) -> None:
    """``ValueError`` when a device of ``mesh`` that reports its memory (GPU, TPU; not the
    CPU) has less free than the ``per_device`` bytes a new cache needs there."""
    for device in mesh.devices.flat:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            continue
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if per_device > free:
            raise ValueError(f"the cache needs {per_device} bytes on each device but {device} "
                             f"has {free} free; use a smaller capacity or batch, a narrower "
                             "dtype, or more shards.")
