"""One attention layer's global shape: the record the traffic model, the planner, the
time model, tuning and the benchmarks all describe a layer with.

A :class:`LayerShape` is pure data: the sizes of ``q [batch, seq_len, num_heads,
head_dim]``, ``k [batch, seq_len, num_kv_heads, head_dim]`` and ``v [batch, seq_len,
num_kv_heads, v_head_dim]``, their dtype, the mask (causal, window, chunks, whether
segment ids travel with the tokens) and whether the backward pass counts. What is not the
layer's stays out: the mesh (``axis_sizes`` of :func:`jax_seqpar.comm_bytes` and the
planner), the kernel's tile (:func:`jax_seqpar.planning.predict.predict`), the
hardware.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jax_seqpar.core.masks import (MaskSpec, normalize_chunk_size, normalize_document_shards,
                                   normalize_window)

__all__ = ["LayerShape", "check_counts", "check_head_groups", "dtype_of_size", "is_count"]

#: The dtype a layer given only its element size (``dtype_bytes=``) is modelled in.
_DTYPE_OF_SIZE = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32", 8: "float64"}


def is_count(value: object) -> bool:
    """Whether ``value`` is a positive int (``bool`` is not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1


def check_counts(**values: object) -> None:
    """Raise ``ValueError`` naming the first of ``values`` that is not a positive int."""
    for name, value in values.items():
        if not is_count(value):
            raise ValueError(f"{name} must be a positive int. Got {name}={value!r}.")


def check_head_groups(num_heads: int, num_kv_heads: int) -> None:
    """Raise ``ValueError`` unless the query heads form groups over the K/V heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads} (MHA, GQA or MQA).")


def dtype_of_size(dtype_bytes: float) -> str:
    """The dtype name a layer of ``dtype_bytes`` per element is modelled in (``2``:
    ``"bfloat16"``): the planner's keyword form gives sizes, not dtypes.

    >>> dtype_of_size(4)
    'float32'
    """
    if isinstance(dtype_bytes, numbers.Real) and not isinstance(dtype_bytes, bool) and (
            dtype_bytes in _DTYPE_OF_SIZE):
        return _DTYPE_OF_SIZE[int(float(dtype_bytes))]
    raise ValueError(f"dtype_bytes must be the size of a float dtype, one of "
                     f"{sorted(_DTYPE_OF_SIZE)} (2 for bf16, 4 for f32). Got "
                     f"dtype_bytes={dtype_bytes!r}.")


def _dtype_name(dtype) -> str:
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(f"dtype={dtype!r} is not a floating-point dtype; use e.g. "
                         f"'bfloat16', 'float16' or 'float32'.")
    return resolved.name


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One attention layer, global sizes (every device's share follows from the mesh).

    Attributes:
      batch: sequences per call (``B``).
      seq_len: tokens per sequence, all devices together (``S``).
      num_heads: query heads (``H``).
      num_kv_heads: key/value heads (``Hkv``; ``H % Hkv == 0``: MHA, GQA, MQA).
      head_dim: q/k head dim (``Dqk``).
      v_head_dim: v head dim (``Dv``); None (the default) means ``head_dim`` and is
        stored as it (MLA absorbed: 576 / 512).
      dtype: the q/k/v dtype, stored as its name (``"bfloat16"``; a dtype object is
        taken too); :attr:`dtype_bytes` is its size.
      causal: query ``i`` sees keys ``<= i`` (on true positions).
      window: ``(left, right)`` sliding window (one int: both sides), or None.
      segment_ids: packed documents: segment ids travel with the tokens.
      backward: the layer is trained: forward + backward (``jax.value_and_grad``),
        else the forward only.
      chunk_size: chunked attention (Llama 4): a query sees only keys of its own chunk
        of ``chunk_size`` positions, or None. With a window it bounds the mask's reach
        (:func:`jax_seqpar.core.reach.mask_reach`), so the bytes.
      max_document_shards: with ``segment_ids``, the most consecutive shards any
        document spans (:attr:`jax_seqpar.core.masks.MaskSpec.max_document_shards`): it
        bounds the reach in any order, or None.

    >>> shape = LayerShape(1, 32768, 32, 8, 128, causal=True)
    >>> shape.v_head_dim, shape.dtype, shape.dtype_bytes
    (128, 'bfloat16', 2)
    """

    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    dtype: str = "bfloat16"
    causal: bool = False
    window: Optional[tuple[int, int]] = None
    segment_ids: bool = False
    backward: bool = True
    chunk_size: Optional[int] = None
    max_document_shards: Optional[int] = None

    def __post_init__(self):
        set_field = lambda name, value: object.__setattr__(self, name, value)  # frozen
        if self.v_head_dim is None:
            set_field("v_head_dim", self.head_dim)
        sizes = ("batch", "seq_len", "num_heads", "num_kv_heads", "head_dim", "v_head_dim")
        check_counts(**{name: getattr(self, name) for name in sizes})
        for name in sizes:
            set_field(name, int(getattr(self, name)))
        check_head_groups(self.num_heads, self.num_kv_heads)
        for name in ("causal", "segment_ids", "backward"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False. Got "
                                 f"{name}={getattr(self, name)!r}.")
            set_field(name, bool(getattr(self, name)))
        set_field("dtype", _dtype_name(self.dtype))
        set_field("window", normalize_window(self.window))
        set_field("chunk_size", normalize_chunk_size(self.chunk_size))
        set_field("max_document_shards", normalize_document_shards(self.max_document_shards))
        if self.max_document_shards is not None and not self.segment_ids:
            raise ValueError(f"max_document_shards={self.max_document_shards} bounds where "
                             "documents lie: it needs segment_ids=True.")

    @property
    def mask(self) -> MaskSpec:
        """The layer's static mask (causal, window, chunks, the documents' bound)."""
        return MaskSpec.make(self.causal, self.window, self.chunk_size,
                             max_document_shards=self.max_document_shards)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per q/k/v element."""
        return jnp.dtype(self.dtype).itemsize

    def comm_kwargs(self) -> dict:
        """The layer keywords of :func:`jax_seqpar.comm_bytes`:
        ``comm_bytes(strategy, axis_sizes=8, **shape.comm_kwargs())``."""
        return dict(batch=self.batch, seq_len=self.seq_len, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    v_head_dim=self.v_head_dim, dtype_bytes=self.dtype_bytes,
                    backward=self.backward, with_segment_ids=self.segment_ids,
                    window=self.window, causal=self.causal, chunk_size=self.chunk_size,
                    max_document_shards=self.max_document_shards)

    def operand_shapes(self) -> tuple:
        """Global shapes of ``q, k, v`` and the output's cotangent ``dout``."""
        b, s, h, kv = self.batch, self.seq_len, self.num_heads, self.num_kv_heads
        d, dv = self.head_dim, self.v_head_dim
        return (b, s, h, d), (b, s, kv, d), (b, s, kv, dv), (b, s, h, dv)

    def replace(self, **changes: Any) -> "LayerShape":
        """A copy with ``changes``, validated again (``shape.replace(seq_len=8192)``).
        ``v_head_dim`` is stored resolved: a new ``head_dim`` leaves it as it was."""
        return dataclasses.replace(self, **changes)

