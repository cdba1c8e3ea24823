"""The sequence-sharded KV cache of :mod:`jax_seqpar.api.inference` (its contract:
round-robin placement, capacity, the sliding-window ring, is described there).

Every device holds ``C/P`` slots of a cache of capacity ``C``; position ``p`` lives on
shard ``p % P`` in local slot ``p // P``, and every slot carries its token's position
(:data:`~jax_seqpar.strategies.decode.EMPTY_POSITION`: empty).

An FP8 cache (``dtype=jnp.float8_e4m3fn`` or ``float8_e5m2``) stores the keys and values
as the FP8 kernel takes them (:func:`stored`): values in FP8 and one float32 scale per
token and head (:func:`jax_seqpar.core.quant.quantize`), the keys rotated first by the
Hadamard matrix (:func:`rotated`) unless the cache was made with ``hadamard=False``.
Attention against it computes in its FP8 dtype (:func:`cache_compute`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar.api.placement import place as _place
from jax_seqpar.core import checks, quant
from jax_seqpar.api.program import axis_name_of
from jax_seqpar.strategies import decode as decode_steps
from jax_seqpar.strategies.decode import EMPTY_POSITION

__all__ = ["KVCache", "cache_compute", "check_against_cache", "rotated", "stored"]

# The dtypes a cache stores: those of the queries it serves (see check_against_cache),
# or FP8 (values and per-token scales, for any of them).
_DTYPES = ("float32", "bfloat16", "float16") + quant.FP8_DTYPES


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of a batch of sequences, sharded along the sequence (a pytree).

    Attributes:
      k: ``[B, C, Hkv, Dqk]`` keys, sharded ``P(None, seq_axes)`` (FP8: rotated where
        ``hadamard``, then quantized).
      v: ``[B, C, Hkv, Dv]`` values, sharded likewise.
      positions: ``int32[B, C]`` the global position each slot holds
        (:data:`~jax_seqpar.strategies.decode.EMPTY_POSITION`: empty), sharded likewise.
      length: ``int32[B]`` tokens written per row (positions ``0 .. length-1``).
      mesh: the device mesh (static).
      seq_axes: the mesh axes splitting the slots, a tuple of names (static).
      window: None (every token keeps its slot), or ``W``: a sliding-window cache that
        keeps each row's latest ``C`` tokens, for attention that sees ``W`` keys back
        at most (static).
      k_scale, v_scale: FP8 only, ``float32[B, C, Hkv]``: each token and head's scale
        (``k ≈ k_values * k_scale[..., None]``), sharded likewise; else None.
      hadamard: FP8 only: the keys are stored rotated by
        :func:`jax_seqpar.core.quant.rotation`
        (:func:`jax_seqpar.api.kv_cache.rotated`) (static).
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array
    mesh: jax.sharding.Mesh = _static()
    seq_axes: tuple = _static()
    window: Optional[int] = _static(default=None)
    k_scale: Optional[jax.Array] = None
    v_scale: Optional[jax.Array] = None
    hadamard: bool = _static(default=False)

    @classmethod
    def create(cls, mesh: jax.sharding.Mesh, *, batch: int, capacity: int, num_kv_heads: int,
               head_dim: int, v_head_dim: Optional[int] = None,
               dtype: jax.typing.DTypeLike = jnp.float32, seq_axes: Union[str, tuple] = "sp",
               window: Optional[int] = None, hadamard: Optional[bool] = None) -> "KVCache":
        """An empty cache of ``capacity`` slots per row, created sharded (never whole).

        Args:
          mesh: the device mesh (Explicit or Auto axis types).
          batch, capacity: rows and slots per row (``capacity`` divisible by the
            number of shards).
          num_kv_heads, head_dim: ``Hkv`` and ``Dqk``; v_head_dim: ``Dv``
            (default ``head_dim``; MLA absorbed: ``Hkv=1``, 576 / 512).
          dtype: storage dtype of k and v: float32 (default, JAX's and
            ``nnx.MultiHeadAttention.init_cache``'s), bfloat16 or float16, the dtype of
            the q, k, v that :func:`~jax_seqpar.api.inference.prefill` and
            :func:`~jax_seqpar.api.inference.decode` take (they refuse another); or
            ``float8_e4m3fn`` / ``float8_e5m2``: FP8 values plus float32 scales per token
            and head (``(D+4)/(2D)`` of a bfloat16 cache's bytes), for q, k, v of any of
            the three, attended in that FP8 dtype (``compute_dtype=``).
          seq_axes: the mesh axis (or tuple of axes) the slots are split over.
          window: opt in to a bounded cache for sliding-window attention that sees at
            most ``window`` keys back: position ``p`` overwrites ``p - capacity``, so
            rows never fill up, and every decode must attend with
            ``window=(left <= window, 0)`` and ``T <= capacity - window`` new tokens (a
            query then never needs an overwritten key). None (default): every token
            keeps its slot and a full row refuses more.
          hadamard: FP8 only: store the keys rotated (None: True, as
            :class:`~jax_seqpar.core.quant.Compute`'s default); the calls against the
            cache then compute with the same ``Compute.hadamard``.

        Raises:
          ValueError: unknown axes, non-positive sizes, a capacity the shards
            do not divide or that does not fit int32, a dtype other than float32,
            bfloat16, float16 and the FP8 ones, ``hadamard=True`` without FP8.
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
        name = np.dtype(dtype).name
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)} (the dtype of the queries "
                             f"the cache serves, or FP8 with scales). Got dtype={name}.")
        fp8 = quant.is_fp8(name)
        if (hadamard is not None and not isinstance(hadamard, bool)) or (hadamard and not fp8):
            raise ValueError(f"hadamard={hadamard!r}: the keys of an FP8 cache are stored "
                             f"rotated or not (a bool); a {name} cache stores them as given. "
                             "Pass hadamard=None (or an FP8 dtype).")
        hadamard = fp8 if hadamard is None else hadamard
        if capacity > checks.INT32_MAX:
            raise ValueError(f"capacity must fit int32 (the cache's positions and lengths are "
                             f"int32): at most 2**31 - 1 = {checks.INT32_MAX} slots per row. "
                             f"Got capacity={capacity}.")
        shards = math.prod(mesh.shape[name] for name in axes)
        if capacity % shards:
            raise ValueError(f"capacity={capacity} is not divisible by the {shards} shards of "
                             f"{axes}; use capacity={-(-capacity // shards) * shards}.")
        _check_memory(mesh, batch * (capacity // shards) * (num_kv_heads * (
            (head_dim + v_head_dim) * np.dtype(dtype).itemsize + 8 * fp8) + 4))
        k, v, positions, length, k_scale, v_scale = _empty(
            mesh, axes, batch, capacity, num_kv_heads, head_dim, v_head_dim, np.dtype(dtype))()
        if window is not None and (isinstance(window, bool) or not isinstance(
                window, numbers.Integral) or not 0 <= window < capacity):
            raise ValueError(f"window must be an int in 0..capacity-1={capacity - 1} (the keys "
                             f"a query sees back). Got window={window!r}.")
        return cls(k, v, positions, length, mesh=mesh, seq_axes=axes,
                   window=None if window is None else int(window), k_scale=k_scale,
                   v_scale=v_scale, hadamard=hadamard)

    @property
    def capacity(self) -> int:
        """``C``, slots per row."""
        return self.k.shape[1]

    @property
    def fp8(self) -> bool:
        """Whether k and v are stored in FP8 with per-token scales."""
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the stored keys and values, their scales included (not the positions
        and lengths): ``B*C*Hkv*(Dqk+Dv)*itemsize``, plus ``B*C*Hkv*8`` in FP8."""
        return sum(x.nbytes for x in (self.k, self.v, self.k_scale, self.v_scale)
                   if x is not None)

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

    def _stored(self) -> tuple[Any, Any]:
        """``(k, v)`` as the per-shard steps take them: arrays, or in FP8 ``(values,
        scales)`` pairs."""
        if not self.fp8:
            return self.k, self.v
        return (self.k, self.k_scale), (self.v, self.v_scale)

    def _placed(self):
        """``(k, v, positions)`` (:meth:`_stored`) sharded along the sequence, as
        ``shard_map`` takes them (a cache made or carried inside ``jit`` may have lost its
        sharding in its type)."""
        return tuple(jax.tree.map(lambda x: _place(x, self.mesh, spec), tree)
                     for tree, spec in zip((*self._stored(), self.positions), self._specs()))

    def _with(self, k, v, positions, length) -> "KVCache":
        """This cache holding ``k, v`` (as :meth:`_stored` gives them), ``positions`` and
        ``length``."""
        if not self.fp8:
            return dataclasses.replace(self, k=k, v=v, positions=positions, length=length)
        (k, k_scale), (v, v_scale) = k, v
        return dataclasses.replace(self, k=k, v=v, positions=positions, length=length,
                                   k_scale=k_scale, v_scale=v_scale)


@functools.lru_cache(maxsize=None)
def _empty(mesh, axes, batch, capacity, num_kv_heads, head_dim, v_head_dim, dtype):
    """The jitted maker of an empty cache's arrays, one per signature (compiled once)."""
    seq = NamedSharding(mesh, P(None, axis_name_of(axes)))

    scales = quant.is_fp8(dtype.name)

    @functools.partial(jax.jit, out_shardings=(seq, seq, seq, NamedSharding(mesh, P()))
                       + (seq, seq) * scales)
    def empty():
        ones = jnp.ones((batch, capacity, num_kv_heads), jnp.float32)
        return (jnp.zeros((batch, capacity, num_kv_heads, head_dim), dtype),
                jnp.zeros((batch, capacity, num_kv_heads, v_head_dim), dtype),
                jnp.full((batch, capacity), EMPTY_POSITION, jnp.int32),
                jnp.zeros((batch,), jnp.int32)) + ((ones, ones) if scales else ())

    if scales:
        return empty
    return lambda: empty() + (None, None)

    return empty


def check_against_cache(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache) -> None:
    """Raise ``ValueError`` unless new ``k, v`` have the cache's batch, heads and dims, and
    ``q, k, v`` (one dtype, checked before) the cache's dtype: the kernels attend q to the
    cached keys, so they must share it (a wider cache would hold nothing more, a narrower
    one would silently round the new keys). An FP8 cache takes any of float32, bfloat16
    and float16 (it quantizes the new keys with scales, as the FP8 kernel does)."""
    if q.dtype != cache.k.dtype and not cache.fp8:
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


def cache_compute(compute_dtype: quant.ComputeLike, cache: KVCache) -> quant.ComputeLike:
    """The ``compute_dtype=`` of a call against ``cache``: as given for a cache in the
    queries' dtype; for an FP8 cache its FP8 dtype and rotation (None: those), and a
    ``ValueError`` naming both and the fix for any other (the cached keys are FP8
    already, and rotated or not: a wider dtype would not restore what quantization
    dropped, another format or rotation would quantize them twice)."""
    if not cache.fp8:
        return compute_dtype
    name = cache.k.dtype.name
    expected = quant.Compute(name, hadamard=cache.hadamard)
    if compute_dtype is None:
        return expected
    chosen = compute_dtype if isinstance(compute_dtype, quant.Compute) else quant.Compute(
        compute_dtype)
    if chosen.dtype == name and chosen.hadamard == cache.hadamard:
        return chosen
    rotation = "rotated keys" if cache.hadamard else "unrotated keys"
    remake = f"dtype={chosen.dtype}" + (f", hadamard={chosen.hadamard}"
                                        if quant.is_fp8(chosen.dtype) else "")
    raise ValueError(
        f"the cache stores {name} keys and values (FP8 with per-token scales, {rotation}), "
        f"so attention against it computes in {name} with hadamard={cache.hadamard}, but "
        f"compute_dtype={chosen} was asked. Pass compute_dtype=None (the cache's) or "
        f"jnp.{name}, or create the cache for the computation asked (KVCache.create(..., "
        f"{remake}), or SelfAttention.init_cache(..., dtype=...)).")


def rotated(cache: KVCache, x: jax.Array) -> jax.Array:
    """``x [B, S, *heads, D]`` in float32, rotated by :func:`jax_seqpar.core.quant.rotate`
    (in ``x``'s dtype, as the strategies rotate q and k before any kernel quantizes them)
    where ``cache`` stores its keys rotated (``cache.hadamard``): the keys written to the
    cache (:func:`stored`) and the queries that attend to them. The one place of the rule
    for a cache (the kernel then runs with ``hadamard=False``)."""
    return (quant.rotate(x) if cache.hadamard else x).astype(jnp.float32)


def stored(cache: KVCache, k: jax.Array, v: jax.Array) -> tuple[Any, Any]:
    """New ``k [B, S, Hkv, Dqk]``, ``v [B, S, Hkv, Dv]`` as ``cache`` stores them: cast
    to its dtype, or in FP8 ``(values, float32 scales [B, S, Hkv])`` pairs,
    :func:`jax_seqpar.core.quant.quantize` of the (:func:`rotated`) keys and of the values:
    the numbers the FP8 kernel computes from them (one scale per token, so wherever it is
    done)."""
    if not cache.fp8:
        return k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    name = cache.k.dtype.name
    return quant.quantize(rotated(cache, k), name), quant.quantize(v, name)
