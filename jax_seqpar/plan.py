"""Analytic communication model and the automatic choice of strategy.

:func:`comm_bytes` counts the bytes ONE device sends in one attention call for
each strategy as implemented in this package: bandwidth-optimal
collectives over a group of ``P`` devices, ``all_to_all`` and ``all_gather``
sending ``(P-1)/P`` of their output, ``psum_scatter`` ``(P-1)/P`` of its
input, ``ppermute`` its whole buffer, loops counted once per iteration. The
same rules read the compiled program in :mod:`jax_seqpar.hlo`, and tests hold
the two against each other.

:func:`plan` picks the cheapest feasible strategy for a mesh. It refines the
decision tree of the seed notes (ring whenever ``num_kv_heads < P``): Ulysses
needs the axis size to divide the query heads only, since K/V heads are
replicated up to it, and then the bytes decide; the ring has no limit; on a
two-level mesh the hybrid runs Ulysses on the fast inner axis and the ring on
the slow outer one (USP, arXiv:2405.07719).

Per global token, forward only, ``P`` devices, elements (times ``dtype_bytes``):

* Ulysses (arXiv:2309.14509): ``(P-1)/P**2 * (H*Dqk + Hkv_eff*Dqk + Hkv_eff*Dv
  + H*Dv)`` with ``Hkv_eff = lcm(Hkv, P)``: shrinks like ``1/P``.
* Ring (arXiv:2310.01889): ``(P-1)/P * Hkv*(Dqk + Dv)`` plus int32 positions:
  tends to a constant, but only K/V travel, so it wins when ``Hkv`` is small
  (MQA/MLA): the crossover is near ``P = 4*H*D / (Hkv*(Dqk+Dv))`` for MHA-sized
  queries.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Mapping

__all__ = ["STRATEGIES", "Plan", "comm_bytes", "plan"]

#: Strategies :func:`comm_bytes` models.
STRATEGIES = ("ulysses", "ring", "allgather", "hybrid")

_INDEX_BYTES = 4  # int32 positions and segment ids


def _replicated_kv_heads(num_kv_heads: int, axis_size: int) -> int:
    """K/V heads after replication so that ``axis_size`` devices get equal shares.

    ``Hkv`` when ``axis_size`` divides it, else ``Hkv * P / gcd(Hkv, P)``:
    ``lcm(8, 16) = 16``, ``lcm(1, 8) = 8`` (MQA/MLA), ``lcm(6, 4) = 12``.
    """
    return math.lcm(num_kv_heads, axis_size)


def _all_to_all_bytes(local_elements: float, axis_size: int, dtype_bytes: float) -> float:
    """An ``all_to_all`` keeps 1/P of its local buffer and sends the rest."""
    return local_elements * dtype_bytes * (axis_size - 1) / axis_size


def _ulysses_bytes(*, batch, seq_len, num_heads, num_kv_heads, head_dim, v_head_dim,
                   axis_size, dtype_bytes, backward, with_segment_ids) -> float:
    """Ulysses over ``axis_size`` devices; ``seq_len`` is the length it gathers.

    Forward: q ``[B, S/P, H, Dqk]``, k ``[B, S/P, Hkv_eff, Dqk]``, v
    ``[B, S/P, Hkv_eff, Dv]`` go seq->head and out ``[B, S/P, H, Dv]`` head->seq.
    Backward (autodiff) transposes each all_to_all into another of the same
    size (dout in; dq, dk, dv out), so fwd+bwd is twice the forward. The int32
    positions (and segment ids, when used) ``[B, S/P]`` are all-gathered to
    ``[B, S]`` once: ``(P-1) * B*S/P * 4`` bytes each, no gradient.
    """
    if axis_size == 1:
        return 0.0
    kv_heads = _replicated_kv_heads(num_kv_heads, axis_size)
    local_tokens = batch * seq_len // axis_size
    elements_per_token = (num_heads * head_dim + kv_heads * head_dim
                          + kv_heads * v_head_dim + num_heads * v_head_dim)
    sent = _all_to_all_bytes(local_tokens * elements_per_token, axis_size, dtype_bytes)
    if backward:
        sent *= 2
    metadata = local_tokens * _INDEX_BYTES * (2 if with_segment_ids else 1)
    return sent + (axis_size - 1) * metadata


def _window_reach(window, causal, seq_len, axis_size):
    """``(left, right)`` halo tokens of a windowed ring / all-gather, or None (full)."""
    if window is None:
        return None
    from jax_seqpar.halo import halo_sizes
    from jax_seqpar.masks import MaskSpec

    return halo_sizes(MaskSpec.make(causal, window), seq_len // axis_size, axis_size)


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
    rotations of k, v and metadata, plus ``P`` ppermutes of the float32 dk, dv
    accumulators (the last one brings them home). With a window ``reach``
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
    return float(2 * rotation + axis_size * kv_elements * 4)


def _allgather_bytes(*, batch, seq_len, num_kv_heads, head_dim, v_head_dim, axis_size,
                     dtype_bytes, backward, with_segment_ids, reach=None) -> float:
    """all_gather of k, v and positions to ``[B, S, Hkv, .]``; backward reduce-scatters dk, dv.

    The gradient of an all_gather is a psum_scatter of the cotangent in the
    input dtype: ``(P-1)/P`` of ``[B, S, Hkv, Dqk + Dv]``. With a window
    ``reach`` (contiguous split) only the halo is gathered; its gradient goes
    back in the input dtype.
    """
    if axis_size == 1:
        return 0.0
    if reach is not None:
        return _halo_bytes(batch=batch, reach=reach, kv_heads=num_kv_heads, head_dim=head_dim,
                           v_head_dim=v_head_dim, dtype_bytes=dtype_bytes, backward=backward,
                           with_segment_ids=with_segment_ids, gradient_bytes=dtype_bytes)
    fraction = (axis_size - 1) / axis_size
    kv_gathered = batch * seq_len * num_kv_heads * (head_dim + v_head_dim) * dtype_bytes
    metadata = batch * seq_len * _INDEX_BYTES * (2 if with_segment_ids else 1)
    sent = fraction * (kv_gathered + metadata)
    if backward:
        sent += fraction * kv_gathered
    return sent


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _axis_sizes_tuple(axis_sizes) -> tuple[int, ...]:
    sizes = (axis_sizes,) if not isinstance(axis_sizes, (tuple, list)) else tuple(axis_sizes)
    if not sizes or not all(_is_count(s) for s in sizes):
        raise ValueError(f"axis_sizes must be a positive int or a tuple of positive ints. "
                         f"Got {axis_sizes!r}.")
    return tuple(int(s) for s in sizes)


def _check_counts(**values):
    for name, value in values.items():
        if not _is_count(value):
            raise ValueError(f"{name} must be a positive int. Got {name}={value!r}.")


def comm_bytes(strategy: str, *, batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
               head_dim: int, v_head_dim: int | None = None, axis_sizes,
               dtype_bytes: float = 2, backward: bool = False,
               with_segment_ids: bool = False, window=None, causal: bool = False) -> float:
    """Bytes ONE device sends in one attention call.

    Shapes are global: q ``[batch, seq_len, num_heads, head_dim]``, k
    ``[batch, seq_len, num_kv_heads, head_dim]``, v ``[..., v_head_dim]``.

    * ``"ulysses"``: all_to_all of q, k, v (K/V heads replicated to
      ``lcm(num_kv_heads, P)``) and of the output, backward doubles it; plus
      one all_gather of the int32 positions (and segment ids) to ``[B, S]``.
    * ``"ring"``: ``P-1`` ppermutes of the local K/V plus int32 positions
      (``B*S/P*4`` bytes a step; ``with_segment_ids`` adds as much again);
      backward re-rotates them and sends ``P`` float32 dK/dV accumulators.
    * ``"allgather"``: all_gather of K/V and positions; backward reduce-scatters dK/dV.
    * ``"hybrid"`` with ``axis_sizes=(outer, inner)``: Ulysses over ``inner`` on
      the local shard ``[B, S/(outer*inner), ...]``, then the ring over ``outer``
      on ``[B, S/outer, lcm(Hkv, inner)/inner, .]`` (positions gathered over
      ``inner``, then rotated over ``outer``).
    * ``window=(left, right)`` (``right`` is 0 with ``causal``) on the contiguous
      split: the ring (hybrid: its ring part) and the all-gather exchange only
      the halo of ``left + right`` tokens of K/V (and segment ids, no positions):
      constant in ``P``. The ring's backward sends float32 dK/dV back, the
      all-gather's in the input dtype. A window reaching ``(P-1)*S/P`` tokens or
      more is the full ring / gather. Ulysses is unchanged by a window.

    A group of one device sends nothing. For non-hybrid strategies a tuple of
    axis sizes is flattened (the product is the group size).

    What the model leaves out, measured with :mod:`jax_seqpar.hlo`:

    * the zigzag relayout of :func:`jax_seqpar.sequence_parallel_attention`
      (q, k, v in and out back: one local shard of each, twice with backward);
      models that apply the layout once to their inputs do not pay it per call;
    * with a ring of 2 compiled together with its backward, XLA merges the
      backward's single K/V hop with the forward's (CSE), sending one rotation
      less than counted here; rings of 3 or more match exactly;
    * XLA:CPU sends bf16 collectives as f32 (use ``dtype_bytes=4`` to compare).

    Args:
      strategy: one of :data:`STRATEGIES`.
      batch, seq_len, num_heads, num_kv_heads, head_dim: global sizes.
      v_head_dim: ``Dv``, defaults to ``head_dim`` (MLA absorbed: 576 / 512).
      axis_sizes: devices along the sequence axis (int), or ``(outer, inner)``.
      dtype_bytes: bytes per element of q/k/v (2 for bf16). Cotangents use it
        too; the ring's dK/dV accumulators are float32 whatever it is.
      backward: count forward + backward (``jax.value_and_grad``) instead of forward.
      with_segment_ids: packed documents: segment ids travel with the keys.
      window: ``None``, an int or ``(left, right)``: the sliding window, with
        the per-shard functions' default (contiguous) positions.
      causal: only matters with a window (a causal window reaches no later shard).

    Returns:
      Bytes one device sends, as a float (fractions of ``(P-1)/P``).

    >>> comm_bytes("ulysses", batch=1, seq_len=1024, num_heads=64, num_kv_heads=64,
    ...            head_dim=128, axis_sizes=8, dtype_bytes=1) / 1024
    3587.5

    (the seed's ``N x 3584`` for q, k, v, out, plus 3.5 bytes of int32 positions.)
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}.")
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    _check_counts(batch=batch, seq_len=seq_len, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim)
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, numbers.Real) or (
            dtype_bytes <= 0):
        raise ValueError(f"dtype_bytes must be a positive number (2 for bf16, 4 for f32). "
                         f"Got dtype_bytes={dtype_bytes!r}.")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads} (MHA, GQA or MQA).")
    sizes = _axis_sizes_tuple(axis_sizes)
    devices = math.prod(sizes)
    if seq_len % devices:
        raise ValueError(f"seq_len={seq_len} is not divisible by the {devices} devices of "
                         f"axis_sizes={axis_sizes!r}; pad the sequence to a multiple of "
                         f"{devices}.")
    shape = dict(batch=batch, head_dim=head_dim, v_head_dim=v_head_dim,
                 dtype_bytes=dtype_bytes, backward=backward,
                 with_segment_ids=with_segment_ids)
    if strategy == "hybrid":
        if len(sizes) != 2:
            raise ValueError(f"hybrid needs axis_sizes=(outer, inner). Got {axis_sizes!r}.")
        outer, inner = sizes
        if num_heads % inner:
            raise ValueError(f"num_heads={num_heads} is not divisible by the ulysses (inner) "
                             f"axis size {inner}; use strategy='ring' or swap the axes.")
        kv_heads_after_ulysses = _replicated_kv_heads(num_kv_heads, inner) // inner
        return (_ulysses_bytes(seq_len=seq_len // outer, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, axis_size=inner, **shape)
                + _ring_bytes(seq_len=seq_len, kv_heads=kv_heads_after_ulysses,
                              axis_size=outer,
                              reach=_window_reach(window, causal, seq_len, outer), **shape))
    if strategy == "ulysses":
        if num_heads % devices:
            raise ValueError(f"num_heads={num_heads} is not divisible by the ulysses axis "
                             f"size {devices}; use strategy='ring' or 'hybrid'.")
        return _ulysses_bytes(seq_len=seq_len, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, axis_size=devices, **shape)
    if strategy == "ring":
        return _ring_bytes(seq_len=seq_len, kv_heads=num_kv_heads, axis_size=devices,
                           reach=_window_reach(window, causal, seq_len, devices), **shape)
    return _allgather_bytes(seq_len=seq_len, num_kv_heads=num_kv_heads, axis_size=devices,
                            reach=_window_reach(window, causal, seq_len, devices), **shape)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's choice for one attention layer on one mesh.

    Attributes:
      strategy: ``"ulysses"``, ``"ring"`` or ``"hybrid"``.
      seq_axes: mesh axis name, or ``(outer, inner)`` names for a two-axis mesh
        (the ring then runs over both axes flattened).
      axis_sizes: devices per axis: an int, or ``(outer, inner)``.
      bytes_per_device: :func:`comm_bytes` of the choice.
      reason: one sentence with the numbers behind the choice.
      candidates: ``{strategy: bytes}`` of every feasible strategy considered.
    """

    strategy: str
    seq_axes: str | tuple[str, str]
    axis_sizes: int | tuple[int, int]
    bytes_per_device: float
    reason: str
    candidates: Mapping[str, float]


# Ties go to the first: Ulysses cannot overlap its all_to_alls with compute but
# has the fewest, largest messages (lowest latency).
_PREFERENCE = ("ulysses", "hybrid", "ring")


def _ratio(numerator: float, denominator: float) -> float:
    return 1.0 if numerator == denominator else numerator / denominator


def _mesh_axes(mesh_axes) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if _is_count(mesh_axes):
        return ("sp",), _axis_sizes_tuple(mesh_axes)
    if isinstance(mesh_axes, Mapping) and 1 <= len(mesh_axes) <= 2:
        names = tuple(mesh_axes)
        return names, _axis_sizes_tuple(tuple(mesh_axes[n] for n in names))
    raise ValueError(f"mesh_axes must be an int or a dict {{axis_name: size}} of one or two "
                     f"axes ordered outer->inner (e.g. mesh.shape). Got {mesh_axes!r}.")


def plan(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
         mesh_axes: int | Mapping[str, int], *, batch: int = 1, v_head_dim: int | None = None,
         dtype_bytes: float = 2, causal: bool = False, backward: bool = True) -> Plan:
    """Chooses the sequence-parallel strategy that sends the fewest bytes per device.

    One axis of ``P`` devices: Ulysses when ``P`` divides ``num_heads`` (K/V
    heads are replicated up to ``lcm(num_kv_heads, P)``), else the ring; when
    both work the cheaper by :func:`comm_bytes` wins, Ulysses on ties. Two axes
    ``{outer: O, inner: I}``: the hybrid (Ulysses over the inner axis, which
    must divide ``num_heads``; ring over the outer) against the ring over both
    axes flattened. ``allgather`` is never chosen: its K/V memory is O(S).

    Args:
      seq_len, num_heads, num_kv_heads, head_dim: global attention sizes.
      mesh_axes: devices along the sequence: an int (axis named ``"sp"``) or
        ``{axis_name: size}`` of one or two axes ordered outer->inner
        (``mesh.shape`` of a ``jax.sharding.Mesh`` works).
      batch, v_head_dim, dtype_bytes, backward: as in :func:`comm_bytes`.
      causal: only worded into ``reason`` (zigzag balances the ring; traffic is equal).

    Returns:
      A :class:`Plan`.

    >>> plan(32768, 32, 32, 128, 8).strategy
    'ulysses'
    >>> plan(32768, 128, 1, 576, {"sp": 8}, v_head_dim=512).reason
    'ring: only 1 KV head (MQA/MLA) and ulysses would move 7.9x more bytes'
    """
    names, sizes = _mesh_axes(mesh_axes)
    devices = math.prod(sizes)
    shape = dict(batch=batch, seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, v_head_dim=v_head_dim, dtype_bytes=dtype_bytes,
                 backward=backward)
    # comm_bytes validates everything else (divisibility, positivity).
    ring = comm_bytes("ring", axis_sizes=devices, **shape)
    balance = "; zigzag layout balances causal work" if causal else ""

    if len(sizes) == 1:
        (axis,), (size,) = names, sizes
        candidates = {"ring": ring}
        if num_heads % size == 0:
            candidates["ulysses"] = comm_bytes("ulysses", axis_sizes=size, **shape)
        strategy = min(candidates, key=lambda s: (candidates[s], _PREFERENCE.index(s)))
        seq_axes, axis_sizes = axis, size
        if strategy == "ulysses":
            kv_heads = _replicated_kv_heads(num_kv_heads, size)
            replicated = (f" ({num_kv_heads} KV heads replicated to {kv_heads})"
                          if kv_heads != num_kv_heads else "")
            reason = (f"ulysses: {num_heads} heads divisible by {size}{replicated} and a2a "
                      f"traffic {_ratio(candidates['ulysses'], ring):.2f}x of ring")
        elif "ulysses" not in candidates:
            reason = (f"ring: num_heads={num_heads} is not divisible by the axis size {size}, "
                      f"so ulysses cannot split heads{balance}")
        else:
            factor = _ratio(candidates["ulysses"], ring)
            why = ("only 1 KV head (MQA/MLA)" if num_kv_heads == 1
                   else f"only {num_kv_heads} of {num_heads} heads are K/V heads")
            reason = f"ring: {why} and ulysses would move {factor:.1f}x more bytes{balance}"
    else:
        (outer, inner), (outer_size, inner_size) = names, sizes
        seq_axes, axis_sizes = (outer, inner), (outer_size, inner_size)
        candidates = {"ring": ring}
        if num_heads % inner_size == 0:
            candidates["hybrid"] = comm_bytes("hybrid", axis_sizes=sizes, **shape)
        strategy = min(candidates, key=lambda s: (candidates[s], _PREFERENCE.index(s)))
        if strategy == "hybrid":
            reason = (f"hybrid: ulysses over {inner!r} ({inner_size} divides {num_heads} heads) "
                      f"and ring over {outer!r} send "
                      f"{_ratio(candidates['hybrid'], ring):.2f}x the bytes of a ring over "
                      f"both axes")
        elif "hybrid" not in candidates:
            reason = (f"ring over ({outer!r}, {inner!r}): num_heads={num_heads} is not "
                      f"divisible by the inner axis size {inner_size}, so hybrid cannot use "
                      f"ulysses{balance}")
        else:
            reason = (f"ring over ({outer!r}, {inner!r}): hybrid would move "
                      f"{_ratio(candidates['hybrid'], ring):.1f}x more bytes{balance}")
    if devices == 1:
        reason += " (one device: nothing is sent)"
    return Plan(strategy=strategy, seq_axes=seq_axes, axis_sizes=axis_sizes,
                bytes_per_device=candidates[strategy], reason=reason, candidates=candidates)
