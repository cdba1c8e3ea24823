"""The choice of strategy: by predicted time on a hardware description, else by bytes.

:func:`plan` picks the strategy for one attention layer on a mesh. With a
:class:`~jax_seqpar.planning.hardware.Hardware` (``plan(hardware=)``) every
strategy and ``ring x ulysses`` factorization is predicted
(:mod:`jax_seqpar.planning.predict`) and the fastest within memory wins. Without, it
refines the decision tree of the seed notes (ring whenever ``num_kv_heads < P``):
Ulysses needs the axis size to divide the query heads only, since K/V heads are
replicated up to it, and then the bytes (:func:`jax_seqpar.comm_bytes`)
decide; the ring has no limit; on a two-level mesh the hybrid runs Ulysses on the fast
inner axis and the ring on the slow outer one (USP, arXiv:2405.07719).

:func:`plan_layer` is the same choice for a :class:`~jax_seqpar.core.shape.LayerShape`
(:func:`plan` takes its fields as keywords and calls it).
:func:`auto_choice` is what ``strategy="auto"`` of
:func:`jax_seqpar.sequence_parallel_attention` runs: a tuned plan when the caller asks
for them (:mod:`jax_seqpar.planning.tuned`), else the prediction for the mesh's device
kind, else (an unknown device) fewest bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Mapping, Optional

import jax

from jax_seqpar.core.masks import normalize_window
from jax_seqpar.core.shape import LayerShape, dtype_of_size, is_count
from jax_seqpar.planning import hardware as hardware_lib, predict, reasons, tuned
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.strategies.registry import StrategyName, comm_bytes
from jax_seqpar.strategies.traffic import axis_sizes_tuple
from jax_seqpar.core.layout import LayoutName

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.planning.hardware import Hardware

__all__ = ["Plan", "auto_choice", "choose", "plan", "plan_layer"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's choice for one attention layer on one mesh.

    Attributes:
      strategy: ``"ulysses"``, ``"ring"`` or ``"hybrid"``.
      seq_axes: mesh axis name, or ``(outer, inner)`` names for a two-axis mesh
        (the ring then runs over both axes flattened).
      axis_sizes: devices per axis: an int, or ``(outer, inner)``.
      bytes_per_device: :func:`~jax_seqpar.strategies.registry.comm_bytes` of the choice.
      reason: one sentence with the numbers behind the choice.
      candidates: ``{label: bytes}`` of every feasible candidate considered
        (labels as in ``predicted_seconds``; strategy names without hardware).
      predicted_seconds: ``{label: seconds}`` per layer (forward + backward) of
        every candidate within the memory budget, when planned for a
        :class:`~jax_seqpar.planning.hardware.Hardware` (else empty). Labels: ``"ulysses"``,
        ``"ring"``, ``"allgather"``, ``"hybrid OxI"`` (ring over O groups of I).
      factorization: ``(ring, ulysses)`` devices: ``(P, 1)`` ring / all-gather,
        ``(1, P)`` Ulysses, ``(O, I)`` hybrid.
      memory_bytes: ``{label: bytes}`` predicted per-device peak memory.
      rejected: ``{label: why}`` candidates over the memory budget.
      measured_seconds: ``{label: seconds}`` timed on the mesh (``jax-seqpar tune``).
    """

    strategy: StrategyName
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
        """Devices per Ulysses group of a hybrid (two-axis) choice (None for other
        strategies)."""
        if self.factorization is None or registry.get(self.strategy).num_seq_axes != 2:
            return None
        return self.factorization[1]


def _names_and_sizes(axis_sizes) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(axis names, sizes)`` of ``axis_sizes``: an int (one axis, ``"sp"``) or
    ``{name: size}`` of one or two axes."""
    if is_count(axis_sizes):
        return ("sp",), axis_sizes_tuple(axis_sizes)
    if isinstance(axis_sizes, Mapping) and 1 <= len(axis_sizes) <= 2:
        names = tuple(axis_sizes)
        return names, axis_sizes_tuple(tuple(axis_sizes[n] for n in names))
    raise ValueError(f"axis_sizes must be an int or a dict {{axis_name: size}} of one or two "
                     f"axes ordered outer->inner (e.g. mesh.shape). Got {axis_sizes!r}.")


def plan(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
         axis_sizes: int | Mapping[str, int], *, batch: int = 1, v_head_dim: int | None = None,
         dtype_bytes: float = 2, causal: bool = False, backward: bool = True,
         hardware: Hardware | str | None = None, memory_budget: Optional[float] = None,
         window: int | tuple[int, int] | None = None) -> Plan:
    """Chooses the sequence-parallel strategy: fastest on ``hardware``, else fewest bytes.

    With ``hardware`` (a :class:`~jax_seqpar.planning.hardware.Hardware` or preset name),
    every strategy and ``ring x ulysses`` factorization of the devices
    (:func:`jax_seqpar.planning.predict.candidates`) is predicted on it (time and
    per-device memory, :func:`jax_seqpar.planning.predict.predict`); candidates over
    ``memory_budget`` bytes (default: the hardware's HBM) are rejected with the reason,
    and the fastest of the rest wins (``jax-seqpar tune`` times the best on a mesh:
    :func:`jax_seqpar.tools.tune.tune`); the :class:`Plan` then has
    ``predicted_seconds``, ``memory_bytes``, ``rejected`` and ``factorization``. Without,
    the choice by bytes:

    One axis of ``P`` devices: Ulysses when ``P`` divides ``num_heads`` (K/V
    heads are replicated up to ``lcm(num_kv_heads, P)``), else the ring; when
    both work the cheaper by :func:`~jax_seqpar.strategies.registry.comm_bytes` wins, Ulysses on ties. Two axes
    ``{outer: O, inner: I}``: the hybrid (Ulysses over the inner axis, which
    must divide ``num_heads``; ring over the outer) against the ring over both
    axes flattened. ``allgather`` is never chosen: its K/V memory is O(S).

    Args:
      seq_len, num_heads, num_kv_heads, head_dim: global attention sizes.
      axis_sizes: devices along the sequence: an int (axis named ``"sp"``) or
        ``{axis_name: size}`` of one or two axes ordered outer->inner
        (``mesh.shape`` of a ``jax.sharding.Mesh`` works).
      batch, v_head_dim, dtype_bytes, backward, window: as in :func:`~jax_seqpar.strategies.registry.comm_bytes`
        (``dtype_bytes`` 1, 2, 4 or 8: the layer is modelled in a dtype of that size,
        :func:`jax_seqpar.core.shape.dtype_of_size`).
      causal: worded into ``reason`` (zigzag balances the ring); with a window, the
        halo it sends. Chunks: :func:`plan_layer` of a
        ``LayerShape(..., chunk_size=)`` (nothing is sent where every chunk fits a shard).

    Returns:
      A :class:`Plan`.

    >>> plan(32768, 32, 32, 128, 8).strategy
    'ulysses'
    >>> plan(32768, 128, 1, 576, {"sp": 8}, v_head_dim=512).reason
    'ring: only 1 KV head (MQA/MLA) and ulysses would move 8.4x more bytes'
    """
    shape = LayerShape(batch=batch, seq_len=seq_len, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                       dtype=dtype_of_size(dtype_bytes), causal=causal,
                       window=normalize_window(window), backward=backward)
    return plan_layer(shape, axis_sizes, hardware=hardware, memory_budget=memory_budget)


def plan_layer(shape: LayerShape, axis_sizes: int | Mapping[str, int], *,
               hardware: Hardware | str | None = None, memory_budget: Optional[float] = None,
               segment_ids: jax.Array | None = None, layout: Optional[LayoutName] = None) -> Plan:
    """:func:`plan` for a :class:`~jax_seqpar.core.shape.LayerShape`.

    With ``hardware``, ``segment_ids`` (a representative batch of packed documents,
    ``int[B', S]``) and ``layout`` (its token order, e.g. ``"per_document"``) are the
    predictions' (:func:`jax_seqpar.planning.predict.predict`): compute is then the
    busiest device's computed tiles of those documents.

    >>> plan_layer(LayerShape(1, 32768, 32, 32, 128), {"sp": 8}).strategy
    'ulysses'
    """
    names, sizes = _names_and_sizes(axis_sizes)
    if hardware is not None:
        return _plan_predicted(shape, names, sizes, hardware_lib.get(hardware), memory_budget,
                               dict(segment_ids=segment_ids, layout=layout))
    if segment_ids is not None or layout is not None:
        raise ValueError("segment_ids= and layout= shape the predicted compute: pass "
                         "hardware= too (a preset name or a Hardware).")
    devices = math.prod(sizes)
    traffic = shape.comm_kwargs()
    registry.check_layer(devices, **traffic)  # comm_bytes' messages (positivity, division)
    num_heads = shape.num_heads
    inner_size = sizes[-1]  # the one axis, or the inner of two
    candidates: dict[str, float] = {}
    feasible: list[tuple[StrategyName, Strategy]] = []
    blocked: list[Strategy] = []  # head-splitting strategies the heads rule out
    for name, entry in _by_bytes(len(sizes)):
        if entry.splits_heads and num_heads % entry.factorization(devices, inner_size)[1]:
            blocked.append(entry)
            continue
        entry_sizes = sizes if entry.num_seq_axes == 2 else devices
        candidates[name] = comm_bytes(name, axis_sizes=entry_sizes, **traffic)
        feasible.append((name, entry))
    if not feasible:
        raise ValueError(f"no registered strategy runs {num_heads} heads over axis_sizes="
                         f"{sizes}: register one without a head constraint.")
    strategy, chosen = min(feasible, key=lambda item: (candidates[item[0]], reasons.rank(item[1])))
    plan_axes: str | tuple[str, str]
    plan_sizes: int | tuple[int, int]
    if len(sizes) == 1:
        (plan_axes,), (plan_sizes,) = names, sizes
    else:
        (outer, inner), (outer_size, _) = names, sizes
        plan_axes, plan_sizes = (outer, inner), (outer_size, inner_size)
    reason = reasons.bytes_reason(chosen, candidates, blocked, shape, names, sizes)
    if devices == 1:
        reason += " (one device: nothing is sent)"
    return Plan(strategy=strategy, seq_axes=plan_axes, axis_sizes=plan_sizes,
                bytes_per_device=candidates[strategy], reason=reason, candidates=candidates,
                factorization=chosen.factorization(devices, inner_size))


def _tie_rank(name: str) -> int:
    """Among predicted ties of equal bytes, the strategy ranked first
    (:attr:`~jax_seqpar.strategies.entry.Strategy.preference`; unranked ones last)."""
    preference = registry.get(name).preference
    return len(registry.STRATEGIES) if preference is None else preference


def _by_bytes(num_axes: int) -> list[tuple[StrategyName, Strategy]]:
    """The strategies the choice by bytes weighs on ``num_axes`` sequence axes: those
    with a :attr:`~jax_seqpar.strategies.entry.Strategy.preference`; on one axis the
    one-axis ones, on two the two-axis ones (heads split over the inner axis) and the
    one-axis ones that split no heads (over both axes flattened). Listed as plans list
    their candidates: those without a head constraint first, each group by rank."""
    found = [(name, entry) for name, entry in registry.STRATEGIES.items()
             if entry.preference is not None
             and (entry.num_seq_axes == 2 if num_axes == 2 and entry.splits_heads
                  else entry.num_seq_axes == 1)]
    return sorted(found, key=lambda item: (item[1].splits_heads, reasons.rank(item[1])))


def _plan_predicted(shape: LayerShape, names, sizes, hardware, memory_budget,
                    documents=None) -> Plan:
    devices = math.prod(sizes)
    budget = hardware.hbm_bytes if memory_budget is None else float(memory_budget)
    if not budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes. Got "
                         f"{memory_budget!r}.")
    # Validates the shape (divisibility, positivity) with comm_bytes' messages.
    registry.check_layer(devices, **shape.comm_kwargs())
    found = {c.label: c for c in predict.candidates(devices, shape.num_heads)}
    predictions = {label: predict.predict(c, shape, hardware, **(documents or {}))
                   for label, c in found.items()}
    rejected = {label: f"needs {reasons.gib(p['memory'])} per device, over the budget of "
                       f"{reasons.gib(budget)}" for label, p in predictions.items()
                if p["memory"] > budget}
    seconds = {label: p["seconds"] for label, p in predictions.items() if label not in rejected}
    if not seconds:
        raise ValueError(
            f"every candidate is over the memory budget of {reasons.gib(budget)} per device: "
            + "; ".join(f"{label} {why}" for label, why in rejected.items())
            + ". Use more devices, a smaller batch, or a larger memory_budget.")
    # A tie goes to the fewest bytes, then to the strategy ranked first (equal bytes: a
    # mask whose reach keeps every query's keys home sends nothing with any of them).
    chosen = min(reasons.tied(seconds), key=lambda label: (predictions[label]["bytes"],
                                                    _tie_rank(found[label].strategy)))
    predicted = Plan(
        strategy=found[chosen].strategy, seq_axes="", axis_sizes=0, bytes_per_device=0.0,
        reason="",
        candidates={label: p["bytes"] for label, p in predictions.items()},
        predicted_seconds=seconds,
        memory_bytes={label: p["memory"] for label, p in predictions.items()},
        rejected=rejected)
    return choose(predicted, found[chosen], names, sizes, hardware)


def choose(predicted: Plan, candidate: predict.Candidate, names: tuple[str, ...],
           sizes: tuple[int, ...], hardware: Hardware | str | None,
           measured: Mapping[str, float] | None = None) -> Plan:
    """``predicted`` (a plan's predictions) with ``candidate`` chosen: the fastest
    predicted, or the fastest ``measured`` (``{label: seconds}`` timed on a mesh)."""
    seq_axes: str | tuple[str, str]
    axis_sizes: int | tuple[int, int]
    if len(names) == 1:
        seq_axes, axis_sizes = names[0], sizes[0]
    else:  # (outer, inner): _names_and_sizes gives one or two axes
        (outer, inner), (outer_size, inner_size) = names, sizes
        seq_axes, axis_sizes = (outer, inner), (outer_size, inner_size)
    return dataclasses.replace(
        predicted, strategy=candidate.strategy, seq_axes=seq_axes, axis_sizes=axis_sizes,
        bytes_per_device=predicted.candidates[candidate.label],
        reason=reasons.predicted_reason(candidate.label, predicted.predicted_seconds, measured or {},
                       predicted.rejected, hardware, predicted.candidates),
        factorization=(candidate.ring, candidate.ulysses), measured_seconds=measured or {})


def auto_choice(shape: LayerShape, mesh: jax.sharding.Mesh,
                axes: tuple[str, ...]) -> tuple[StrategyName, Optional[int]]:
    """``(strategy, ulysses_size)`` for ``strategy="auto"`` on the ``axes`` of ``mesh``.

    ``shape`` is the layer as one sequence group holds it (its batch rows and heads).
    A plan tuned on this mesh wins when the caller asks for tuned plans
    (:data:`jax_seqpar.planning.tuned.ENV_VAR` names the file; unset, none is read);
    else the prediction for the preset of the mesh's device kind; else (no preset)
    fewest bytes. ``ulysses_size`` is set for a hybrid only.
    """
    strategy, ulysses_size, _ = auto_plan(shape, mesh, axes)
    return strategy, ulysses_size


def auto_plan(shape: LayerShape, mesh: jax.sharding.Mesh, axes: tuple[str, ...]
              ) -> tuple[StrategyName, Optional[int], str]:
    """:func:`auto_choice` and one sentence on why: the tuned plan's file, or the plan's
    :attr:`Plan.reason` with the bytes and memory of every candidate."""
    axis_sizes = {name: mesh.shape[name] for name in axes}
    device_kind = mesh.devices.flat[0].device_kind
    hardware = hardware_lib.for_device_kind(device_kind)
    tuned_plan = tuned.lookup(tuned.cache_key(shape, axis_sizes, device_kind, hardware))
    if tuned_plan is not None:
        return (tuned_plan["strategy"], tuned_plan["ulysses_size"],
                f"the plan tuned on this mesh ({tuned.ENV_VAR})")
    chosen = plan_layer(shape, axis_sizes, hardware=hardware)
    why = chosen.reason + "; bytes sent per device: " + ", ".join(
        f"{label} {reasons.binary_size(sent)}" for label, sent in chosen.candidates.items())
    if chosen.memory_bytes:
        why += "; memory per device: " + ", ".join(
            f"{label} {reasons.binary_size(held)}" for label, held in chosen.memory_bytes.items())
    return chosen.strategy, chosen.ulysses_size, why
