"""The automatic choice of strategy, from the communication model.

:func:`plan` picks the cheapest feasible strategy for a mesh. It refines the
decision tree of the seed notes (ring whenever ``num_kv_heads < P``): Ulysses
needs the axis size to divide the query heads only, since K/V heads are
replicated up to it, and then the bytes decide; the ring has no limit; on a
two-level mesh the hybrid runs Ulysses on the fast inner axis and the ring on
the slow outer one (USP, arXiv:2405.07719).

The bytes come from :func:`jax_seqpar.traffic.comm_bytes` (also reachable as
``plan.comm_bytes``); with a ``hardware`` description the choice is by predicted
time (:mod:`jax_seqpar.planner`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

from jax_seqpar.traffic import (STRATEGIES, _axis_sizes_tuple, _is_count,
                                _replicated_kv_heads, comm_bytes)

__all__ = ["STRATEGIES", "Plan", "comm_bytes", "plan"]


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
      candidates: ``{label: bytes}`` of every feasible candidate considered
        (labels as in ``predicted_seconds``; strategy names without hardware).
      predicted_seconds: ``{label: seconds}`` per layer (forward + backward) of
        every candidate within the memory budget, when planned for a
        :class:`~jax_seqpar.hardware.Hardware` (else empty). Labels: ``"ulysses"``,
        ``"ring"``, ``"allgather"``, ``"hybrid OxI"`` (ring over O groups of I).
      factorization: ``(ring, ulysses)`` devices: ``(P, 1)`` ring / all-gather,
        ``(1, P)`` Ulysses, ``(O, I)`` hybrid.
      memory_bytes: ``{label: bytes}`` predicted per-device peak memory.
      rejected: ``{label: why}`` candidates over the memory budget.
      measured_seconds: ``{label: seconds}`` timed on the mesh (``measure=True``).
    """

    strategy: str
    seq_axes: str | tuple[str, str]
    axis_sizes: int | tuple[int, int]
    bytes_per_device: float
    reason: str
    candidates: Mapping[str, float]
    predicted_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    factorization: Optional[tuple[int, int]] = None
    memory_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    rejected: Mapping[str, str] = dataclasses.field(default_factory=dict)
    measured_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def ulysses_size(self) -> Optional[int]:
        """Devices per Ulysses group of a hybrid choice (None for other strategies)."""
        return self.factorization[1] if self.strategy == "hybrid" else None


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
         dtype_bytes: float = 2, causal: bool = False, backward: bool = True,
         hardware=None, memory_budget: Optional[float] = None, window=None,
         measure: bool = False, mesh=None, cache=None) -> Plan:
    """Chooses the sequence-parallel strategy: fastest on ``hardware``, else fewest bytes.

    With ``hardware`` (a :class:`~jax_seqpar.hardware.Hardware` or preset name),
    see :func:`jax_seqpar.planner.plan_for_hardware`: every ``ring x ulysses``
    factorization predicted, the fastest within ``memory_budget`` wins, and
    ``measure=True`` times the best on ``mesh`` and caches the winner in ``cache``.
    Without, the choice by bytes:

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
    if hardware is not None or measure:
        # The time model builds on comm_bytes above, so it is imported here.
        from jax_seqpar import planner

        return planner.plan_for_hardware(
            seq_len, num_heads, num_kv_heads, head_dim, mesh_axes, batch=batch,
            v_head_dim=v_head_dim, dtype_bytes=dtype_bytes, causal=causal, backward=backward,
            hardware=hardware, memory_budget=memory_budget, window=window, measure=measure,
            mesh=mesh, cache=cache)
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
    factorization = {"ulysses": (1, devices), "hybrid": tuple(sizes)}.get(strategy, (devices, 1))
    return Plan(strategy=strategy, seq_axes=seq_axes, axis_sizes=axis_sizes,
                bytes_per_device=candidates[strategy], reason=reason, candidates=candidates,
                factorization=factorization)
