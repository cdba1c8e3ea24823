"""The analytic communication model: bytes one device sends per attention call.

:func:`~jax_seqpar.strategies.registry.comm_bytes` counts the bytes ONE device sends in one attention call for
each strategy as implemented in this package: bandwidth-optimal
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

__all__ = ["allgather_bytes", "axis_sizes_tuple", "check_shape", "decode_bytes",
           "hybrid_bytes", "replicated_kv_heads", "ring_bytes", "ulysses_bytes"]

_INDEX_BYTES = 4  # int32 positions and segment ids
_NO_MASK = MaskSpec()


def replicated_kv_heads(num_kv_heads: int, axis_size: int) -> int:
    """K/V heads after replication so that ``axis_size`` devices get equal shares.

    ``Hkv`` when ``axis_size`` divides it, else ``Hkv * P / gcd(Hkv, P)``:
    ``lcm(8, 16) = 16``, ``lcm(1, 8) = 8`` (MQA/MLA), ``lcm(6, 4) = 12``.
    """
    return math.lcm(num_kv_heads, axis_size)


def _all_to_all_bytes(local_elements: float, axis_size: int, dtype_bytes: float) -> float:
    """An ``all_to_all`` keeps 1/P of its local buffer and sends the rest."""
    return local_elements * dtype_bytes * (axis_size - 1) / axis_size


def _ulysses_bytes(*, batch, seq_len, num_heads, num_kv_heads, head_dim, v_head_dim,
                   axis_size, dtype_bytes, backward, with_segment_ids,
                   row_statistic: bool = True) -> float:
    """Ulysses over ``axis_size`` devices; ``seq_len`` is the length it gathers.

    Forward: q ``[B, S/P, H, Dqk]``, k ``[B, S/P, Hkv_eff, Dqk]``, v
    ``[B, S/P, Hkv_eff, Dv]`` go seq->head and out ``[B, S/P, H, Dv]`` head->seq,
    whatever the head groups (they cut the same buffers into pieces).
    Backward (the reverse pipeline): dout in; dq, dk, dv out, one all_to_all of the
    forward's size each, dk and dv in float32 where the K/V heads are replicated (the
    replicas' partial sums cross devices); with ``row_statistic`` (Ulysses' own kernel backward; not the
    hybrid's ring, which has its own) also the float32 ``<dout, out>`` rows ``[B, S/P,
    H]`` in, computed on the sequence-sharded output the backward keeps. The int32
    positions (and segment ids, when used) ``[B, S/P]`` are all-gathered to
    ``[B, S]`` once: ``(P-1) * B*S/P * 4`` bytes each, no gradient.
    """
    if axis_size == 1:
        return 0.0
    kv_heads = replicated_kv_heads(num_kv_heads, axis_size)
    local_tokens = batch * seq_len // axis_size
    kv_elements = kv_heads * (head_dim + v_head_dim)
    elements_per_token = num_heads * head_dim + kv_elements + num_heads * v_head_dim
    sent = _all_to_all_bytes(local_tokens * elements_per_token, axis_size, dtype_bytes)
    if backward:
        grad_bytes = 4 if kv_heads != num_kv_heads else dtype_bytes
        sent += _all_to_all_bytes(local_tokens * (elements_per_token - kv_elements),
                                  axis_size, dtype_bytes)
        sent += _all_to_all_bytes(local_tokens * kv_elements, axis_size, grad_bytes)
        if row_statistic:
            sent += _all_to_all_bytes(local_tokens * num_heads, axis_size, 4)
    metadata = local_tokens * _INDEX_BYTES * (2 if with_segment_ids else 1)
    return sent + (axis_size - 1) * metadata


def _window_reach(spec: MaskSpec, seq_len, axis_size):
    """``(left, right)`` halo tokens of a windowed ring / all-gather, or None (full)."""
    if spec.window is None:
        return None
    from jax_seqpar.strategies.halo import halo_sizes

    return halo_sizes(spec, seq_len // axis_size, axis_size)


def _halo_bytes(*, batch, reach, kv_heads, head_dim, v_head_dim, dtype_bytes, backward,
                with_segment_ids, gradient_bytes) -> float:
    """A halo exchange of ``left + right`` tokens of K/V (and segment ids; positions
    are computed, not sent); backward sends dK/dV back in ``gradient_bytes``."""
    tokens = batch * sum(reach)
    kv_elements = tokens * kv_heads * (head_dim + v_head_dim)
    sent = kv_elements * dtype_bytes + (tokens * _INDEX_BYTES if with_segment_ids else 0)
    if backward:
        sent += kv_elements * gradient_bytes
    return float(sent)


def _ring_bytes(*, batch, seq_len, kv_heads, head_dim, v_head_dim, axis_size,
                dtype_bytes, backward, with_segment_ids, reach=None) -> float:
    """The ring over ``axis_size`` devices on K/V of ``kv_heads`` heads.

    Forward: ``P-1`` ppermutes of the local k ``[B, S/P, Hkv, Dqk]`` and v
    ``[B, S/P, Hkv, Dv]``, with their int32 positions ``[B, S/P]`` (and segment
    ids). Backward (custom_vjp, the forward is not re-run): the same ``P-1``
    rotations of k, v and metadata, plus ``P - 1`` ppermutes of the float32 dk, dv
    accumulators and one in the input dtype (the sums done, it brings them home). With
    a window ``reach``
    (contiguous split): a halo exchange; the backward re-uses the saved halo
    and sends float32 dK/dV back.
    """
    if axis_size == 1:
        return 0.0
    if reach is not None:
        return _halo_bytes(batch=batch, reach=reach, kv_heads=kv_heads, head_dim=head_dim,
                           v_head_dim=v_head_dim, dtype_bytes=dtype_bytes, backward=backward,
                           with_segment_ids=with_segment_ids, gradient_bytes=4)
    local_tokens = batch * seq_len // axis_size
    kv_elements = local_tokens * kv_heads * (head_dim + v_head_dim)
    metadata = local_tokens * _INDEX_BYTES * (2 if with_segment_ids else 1)
    rotation = (axis_size - 1) * (kv_elements * dtype_bytes + metadata)
    if not backward:
        return float(rotation)
    return float(2 * rotation + _accumulator_bytes(kv_elements, axis_size, dtype_bytes))


def _accumulator_bytes(kv_elements, axis_size, dtype_bytes) -> float:
    """dK/dV accumulators of ``kv_elements`` passed ``P`` hops: float32 while they sum
    (so the gradients' error does not grow with P), the input dtype on the last hop."""
    return kv_elements * ((axis_size - 1) * 4 + dtype_bytes)


def _allgather_bytes(*, batch, seq_len, num_kv_heads, head_dim, v_head_dim, axis_size,
                     dtype_bytes, backward, with_segment_ids, reach=None) -> float:
    """all_gather of k, v and positions to ``[B, S, Hkv, .]`` (K/V in pieces, the same
    bytes); the backward sends dK/dV home around the ring.

    The backward's dK/dV accumulators ``[B, S/P, Hkv, Dqk + Dv]`` travel ``P``
    ppermutes as the ring's do: ``P - 1`` in float32, the last (home) in the input
    dtype. With a window ``reach`` (contiguous split) only the halo is gathered; its
    float32 gradient goes back.
    """
    if axis_size == 1:
        return 0.0
    if reach is not None:
        return _halo_bytes(batch=batch, reach=reach, kv_heads=num_kv_heads, head_dim=head_dim,
                           v_head_dim=v_head_dim, dtype_bytes=dtype_bytes, backward=backward,
                           with_segment_ids=with_segment_ids, gradient_bytes=4)
    fraction = (axis_size - 1) / axis_size
    kv_elements = batch * seq_len * num_kv_heads * (head_dim + v_head_dim)
    metadata = batch * seq_len * _INDEX_BYTES * (2 if with_segment_ids else 1)
    sent = fraction * (kv_elements * dtype_bytes + metadata)
    if backward:
        sent += _accumulator_bytes(kv_elements // axis_size, axis_size, dtype_bytes)
    return sent


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


def hybrid_bytes(sizes: tuple[int, ...], *, num_heads: int, num_kv_heads: int, seq_len: int,
                 spec: MaskSpec = _NO_MASK, **shape: float) -> float:
    """Ulysses over the inner axis of ``sizes=(outer, inner)`` on the local shard, then
    the ring over the outer one on ``lcm(Hkv, inner)/inner`` K/V heads. Pipelined along
    the sequence (the default where the local length allows and the ring is no halo
    exchange), the backward also sends the float32 ``<dout, out>`` rows (the ring's own
    backward does not need them)."""
    if len(sizes) != 2:
        raise ValueError(f"hybrid needs axis_sizes=(outer, inner). Got {sizes!r}.")
    outer, inner = sizes
    if num_heads % inner:
        raise ValueError(f"num_heads={num_heads} is not divisible by the ulysses (inner) "
                         f"axis size {inner}; use strategy='ring' or swap the axes.")
    kv_heads_after_ulysses = replicated_kv_heads(num_kv_heads, inner) // inner
    reach = _window_reach(spec, seq_len, outer)
    from jax_seqpar.strategies import halo, heads  # the pieces' rules (they import jax)

    chunks = 1 if halo.ring_is_halo(spec, seq_len // outer, outer) else heads.default_chunks(
        seq_len // (outer * inner), inner)
    return (_ulysses_bytes(seq_len=seq_len // outer, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, axis_size=inner,
                           row_statistic=chunks > 1, **shape)
            + _ring_bytes(seq_len=seq_len, kv_heads=kv_heads_after_ulysses, axis_size=outer,
                          reach=reach, **shape))


def ulysses_bytes(sizes: tuple[int, ...], *, num_heads: int, spec: MaskSpec = _NO_MASK,
                  **shape: float) -> float:
    """Ulysses over all ``sizes`` devices (a window changes nothing)."""
    devices = math.prod(sizes)
    if num_heads % devices:
        raise ValueError(f"num_heads={num_heads} is not divisible by the ulysses axis "
                         f"size {devices}; use strategy='ring' or 'hybrid'.")
    return _ulysses_bytes(num_heads=num_heads, axis_size=devices, row_statistic=True,
                          **shape)


def ring_bytes(sizes: tuple[int, ...], *, num_heads: int, num_kv_heads: int, seq_len: int,
               spec: MaskSpec = _NO_MASK, **shape: float) -> float:
    """The ring over all ``sizes`` devices (a halo exchange with a window)."""
    devices = math.prod(sizes)
    return _ring_bytes(seq_len=seq_len, kv_heads=num_kv_heads, axis_size=devices,
                       reach=_window_reach(spec, seq_len, devices), **shape)


def allgather_bytes(sizes: tuple[int, ...], *, num_heads: int, seq_len: int,
                    spec: MaskSpec = _NO_MASK, **shape: float) -> float:
    """The all-gather over all ``sizes`` devices (the halo only with a window)."""
    devices = math.prod(sizes)
    return _allgather_bytes(seq_len=seq_len, axis_size=devices,
                            reach=_window_reach(spec, seq_len, devices), **shape)
