"""The analytic communication model's shared rules: bytes one device sends per attention call.

:func:`~jax_seqpar.strategies.registry.comm_bytes` counts the bytes ONE device sends in one
attention call with each strategy's own model (``ulysses.ulysses_bytes``,
``ring.ring_bytes``, ...: :attr:`~jax_seqpar.strategies.entry.Strategy.bytes`), as
implemented in this package: bandwidth-optimal
collectives over a group of ``P`` devices, ``all_to_all`` and ``all_gather``
sending ``(P-1)/P`` of their output, ``psum_scatter`` ``(P-1)/P`` of its
input, ``ppermute`` its whole buffer, loops counted once per iteration. The
same rules read the compiled program in :mod:`jax_seqpar.tools.hlo`, and tests hold
the two against each other.

Per global token, forward only, ``P`` devices, elements (times ``dtype_bytes``):

* Ulysses (arXiv:2309.14509): ``(P-1)/P**2 * (H*Dqk + Hkv_eff*Dqk + Hkv_eff*Dv
  + H*Dv)`` with ``Hkv_eff = lcm(Hkv, P)``: shrinks like ``1/P``.
* Ring (arXiv:2310.01889): ``(P-1)/P * Hkv*(Dqk + Dv)`` plus int32 positions:
  tends to a constant, but only K/V travel, so it wins when ``Hkv`` is small
  (MQA/MLA): the crossover is near ``P = 4*H*D / (Hkv*(Dqk+Dv))`` for MHA-sized
  queries.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.core.shape import check_counts, check_head_groups, is_count
from jax_seqpar.core.quant import Compute
from jax_seqpar.core.reach import documents_bound_reach, mask_reach
from jax_seqpar.strategies.wire import wire_bytes

__all__ = ["INDEX_BYTES", "NO_MASK", "accumulator_bytes", "all_to_all_bytes",
           "axis_sizes_tuple", "check_shape", "document_check_bytes", "halo_bytes",
           "replicated_kv_heads", "layer_reach"]

#: Bytes of one int32 position or segment id.
INDEX_BYTES = 4
#: What a bytes model's ``spec`` defaults to, the empty mask.
NO_MASK = MaskSpec()


def replicated_kv_heads(num_kv_heads: int, axis_size: int) -> int:
    """K/V heads after replication so that ``axis_size`` devices get equal shares.

    ``Hkv`` when ``axis_size`` divides it, else ``Hkv * P / gcd(Hkv, P)``:
    ``lcm(8, 16) = 16``, ``lcm(1, 8) = 8`` (MQA/MLA), ``lcm(6, 4) = 12``.
    """
    return math.lcm(num_kv_heads, axis_size)


def all_to_all_bytes(local_elements: float, axis_size: int, dtype_bytes: float) -> float:
    """An ``all_to_all`` keeps 1/P of its local buffer and sends the rest."""
    return local_elements * dtype_bytes * (axis_size - 1) / axis_size


def layer_reach(spec: MaskSpec, seq_len: int, axis_size: int, *,
                shard_len: int | None = None) -> tuple[int, int] | None:
    """``(left, right)`` halo tokens a ring / all-gather over ``axis_size`` devices sends on
    the contiguous split of ``seq_len`` tokens (:func:`~jax_seqpar.core.reach.mask_reach`:
    windows and chunks; ``max_document_shards`` in any order, counting shards of
    ``shard_len`` tokens, default ``seq_len / axis_size``), or None (the full exchange);
    ``(0, 0)``: nothing."""
    return mask_reach(spec, seq_len // axis_size, axis_size, shard_len=shard_len)


def halo_bytes(*, batch: int, reach: tuple[int, int], kv_heads: int, head_dim: int,
               v_head_dim: int, dtype_bytes: float, backward: bool, with_segment_ids: bool,
               gradient_bytes: float, positions_travel: bool = False,
               compute: Compute | None = None) -> float:
    """A halo exchange of ``left + right`` tokens of K/V (and segment ids; positions
    are computed on the contiguous split, sent where documents bound the reach:
    ``positions_travel``); backward sends dK/dV back in ``gradient_bytes``. ``compute``:
    K/V travel in its wire (kept for the backward: :func:`~jax_seqpar.strategies.wire.wire_bytes`)."""
    tokens = batch * sum(reach)
    kv_elements = tokens * kv_heads * (head_dim + v_head_dim)
    metadata = with_segment_ids + positions_travel
    kv = sum(wire_bytes(compute, dtype_bytes, tokens * kv_heads, d, saved=True)
             for d in (head_dim, v_head_dim))
    sent = kv + tokens * INDEX_BYTES * metadata
    if backward:
        sent += kv_elements * gradient_bytes
    return float(sent)


def document_check_bytes(spec: MaskSpec, *, batch: int, seq_len: int, devices: int) -> float:
    """The check of ``max_document_shards`` (:func:`jax_seqpar.strategies.inputs.documents_within`):
    one all-gather of every shard's int32 segment ids, ``B*S*4*(P-1)/P``; 0 without it."""
    if not documents_bound_reach(spec.max_document_shards, devices):
        return 0.0  # a bound that bounds nothing is not checked
    return batch * seq_len * INDEX_BYTES * (devices - 1) / devices


def accumulator_bytes(kv_elements: float, axis_size: int, dtype_bytes: float) -> float:
    """dK/dV accumulators of ``kv_elements`` passed ``P`` hops: float32 while they sum
    (so the gradients' error does not grow with P), the input dtype on the last hop."""
    return kv_elements * ((axis_size - 1) * 4 + dtype_bytes)


def axis_sizes_tuple(axis_sizes: int | tuple[int, ...] | Mapping[str, int]) -> tuple[int, ...]:
    """Devices per sequence axis from an int, a tuple of ints or ``{name: size}``."""
    if isinstance(axis_sizes, Mapping):
        sizes = tuple(axis_sizes.values())
    elif isinstance(axis_sizes, (tuple, list)):
        sizes = tuple(axis_sizes)
    else:
        sizes = (axis_sizes,)
    if not sizes or not all(is_count(s) for s in sizes):
        raise ValueError(f"axis_sizes must be a positive int, a tuple of positive ints or "
                         f"{{name: size}}. Got {axis_sizes!r}.")
    return tuple(int(s) for s in sizes)


def check_shape(*, batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                v_head_dim: int | None, dtype_bytes: float, sizes: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless the layer's sizes are positive, the heads form groups
    and the ``sizes`` (devices per sequence axis) divide the sequence."""
    check_counts(batch=batch, seq_len=seq_len, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim)
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, numbers.Real) or (
            dtype_bytes <= 0):
        raise ValueError(f"dtype_bytes must be a positive number (2 for bf16, 4 for f32). "
                         f"Got dtype_bytes={dtype_bytes!r}.")
    check_head_groups(num_heads, num_kv_heads)
    devices = math.prod(sizes)
    if seq_len % devices:
        raise ValueError(f"seq_len={seq_len} is not divisible by the {devices} devices of "
                         f"axis_sizes={sizes}; pad the sequence to a multiple of {devices}.")
