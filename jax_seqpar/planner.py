"""The hardware-aware choice: every candidate predicted, the fastest within memory wins.

:func:`jax_seqpar.plan.plan` calls :func:`plan_for_hardware` when it is given a
:class:`~jax_seqpar.hardware.Hardware`; :func:`auto_choice` is what
``strategy="auto"`` of :func:`jax_seqpar.sequence_parallel_attention` runs: a
plan tuned on this mesh (:mod:`jax_seqpar.tune`'s cache) first, else the
prediction for the mesh's device kind, else (an unknown device) fewest bytes.
"""

from __future__ import annotations

import math
from typing import Optional

from jax_seqpar import hardware as hardware_lib
from jax_seqpar import masks, plan as planner_bytes, predict

__all__ = ["auto_choice", "plan_for_hardware"]

_GIB = 2.0**30


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / _GIB:.3g} GiB"


def plan_for_hardware(seq_len, num_heads, num_kv_heads, head_dim, mesh_axes, *, batch=1,
                      v_head_dim=None, dtype_bytes=2, causal=False, backward=True,
                      hardware=None, memory_budget=None, window=None, measure=False,
                      mesh=None, cache=None, top=3, runs=3):
    """The fastest predicted candidate within the memory budget (``plan(hardware=...)``).

    Every strategy and every ``ring x ulysses`` factorization of the devices
    (:func:`jax_seqpar.predict.candidates`) is predicted on ``hardware`` (time
    and per-device memory, :func:`jax_seqpar.predict.predict`); candidates over
    ``memory_budget`` bytes (default: the hardware's HBM) are rejected with the
    reason; the fastest of the rest wins. With ``measure=True`` the ``top``
    predicted are compiled and timed (``runs`` calls each) on ``mesh`` (default:
    the first devices), the fastest measured wins and is cached in ``cache``
    (:mod:`jax_seqpar.tune`). ``window`` cuts the predicted compute. Other
    arguments as in :func:`jax_seqpar.plan.plan`; ``hardware=None`` with
    ``measure`` takes the preset of ``mesh``'s device kind.

    Returns:
      A :class:`~jax_seqpar.plan.Plan` with ``predicted_seconds``,
      ``memory_bytes``, ``rejected``, ``factorization`` and (measured)
      ``measured_seconds``; its ``reason`` names the predicted times.

    >>> plan_for_hardware(32768, 12, 12, 64, {"sp": 8}, hardware="tpu-v5p",
    ...                   causal=True).factorization
    (4, 2)
    """
    names, sizes = planner_bytes._mesh_axes(mesh_axes)
    devices = math.prod(sizes)
    if hardware is None:
        if mesh is None:
            raise ValueError("measure=True needs hardware= (the cache key) or mesh= (its "
                             "devices name the hardware).")
        hardware = hardware_lib.for_device_kind(mesh.devices.flat[0].device_kind)
        if hardware is None:
            raise ValueError(f"no preset for device kind {mesh.devices.flat[0].device_kind!r}; "
                             f"pass hardware= (a Hardware or one of "
                             f"{sorted(hardware_lib.PRESETS)}).")
    hardware = hardware_lib.get(hardware)
    budget = hardware.hbm_bytes if memory_budget is None else float(memory_budget)
    if not budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes. Got "
                         f"{memory_budget!r}.")
    shape = predict.Shape(batch=batch, seq_len=seq_len, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, head_dim=head_dim,
                          v_head_dim=head_dim if v_head_dim is None else v_head_dim,
                          dtype_bytes=dtype_bytes, causal=causal,
                          window=masks.normalize_window(window), backward=backward)
    # Validates the shape (divisibility, positivity) with comm_bytes' messages.
    planner_bytes.comm_bytes("ring", axis_sizes=devices, **shape.traffic())
    found = {c.label: c for c in predict.candidates(devices, num_heads)}
    predictions = {label: predict.predict(c, shape, hardware) for label, c in found.items()}
    rejected = {label: f"needs {_gib(p['memory'])} per device, over the budget of "
                       f"{_gib(budget)}" for label, p in predictions.items()
                if p["memory"] > budget}
    seconds = {label: p["seconds"] for label, p in predictions.items() if label not in rejected}
    if not seconds:
        raise ValueError(
            f"every candidate is over the memory budget of {_gib(budget)} per device: "
            + "; ".join(f"{label} {why}" for label, why in rejected.items())
            + ". Use more devices, a smaller batch, or a larger memory_budget.")
    ranked = sorted(seconds, key=seconds.get)
    measured = {}
    if measure:
        from jax_seqpar import tune

        measured = tune.measure_candidates(
            [found[label] for label in ranked], shape, names, sizes, hardware, mesh=mesh,
            cache=cache, top=top, runs=runs)
        chosen = min(measured, key=measured.get)
    else:
        chosen = ranked[0]
    candidate = found[chosen]
    reason = _reason(chosen, seconds, measured, rejected, hardware)
    if candidate.strategy == "hybrid" and len(sizes) == 2 and candidate.ulysses == sizes[1]:
        seq_axes, axis_sizes = tuple(names), tuple(sizes)
    else:
        seq_axes = names[0] if len(names) == 1 else tuple(names)
        axis_sizes = sizes[0] if len(sizes) == 1 else tuple(sizes)
    return planner_bytes.Plan(
        strategy=candidate.strategy, seq_axes=seq_axes, axis_sizes=axis_sizes,
        bytes_per_device=predictions[chosen]["bytes"], reason=reason,
        candidates={label: p["bytes"] for label, p in predictions.items()},
        predicted_seconds=seconds, factorization=(candidate.ring, candidate.ulysses),
        memory_bytes={label: p["memory"] for label, p in predictions.items()},
        rejected=rejected, measured_seconds=measured)


def _reason(chosen, seconds, measured, rejected, hardware) -> str:
    if measured:
        others = sorted((s, label) for label, s in measured.items() if label != chosen)
        text = (f"{chosen}: fastest measured on this mesh, {_ms(measured[chosen])} per layer "
                f"(predicted {_ms(seconds[chosen])})")
        timed = "measured"
    else:
        others = sorted((s, label) for label, s in seconds.items() if label != chosen)
        text = f"{chosen}: fastest predicted on {hardware.name}, {_ms(seconds[chosen])} per layer"
        timed = "predicted"
    if others:
        text += f"; {timed}: " + ", ".join(f"{label} {_ms(s)}" for s, label in others)
    if rejected:
        text += "; over the memory budget: " + ", ".join(sorted(rejected))
    return text


def auto_choice(q_shape, kv_heads: int, v_head_dim: int, dtype_bytes: float, mesh, axes,
                *, causal: bool, window=None) -> tuple[str, Optional[int]]:
    """``(strategy, ulysses_size)`` for ``strategy="auto"`` on the ``axes`` of ``mesh``.

    A plan tuned on this mesh (:func:`jax_seqpar.tune.lookup`) wins; else the
    prediction for the preset of the mesh's device kind; else (no preset)
    fewest bytes. ``ulysses_size`` is set for a hybrid only.
    """
    from jax_seqpar import tune

    batch, seq_len, heads, head_dim = q_shape
    axis_sizes = {name: mesh.shape[name] for name in axes}
    shape = dict(batch=batch, v_head_dim=v_head_dim, dtype_bytes=dtype_bytes, causal=causal)
    device_kind = mesh.devices.flat[0].device_kind
    hardware = hardware_lib.for_device_kind(device_kind)
    tuned = tune.lookup(tune.cache_key(
        predict.Shape(seq_len=seq_len, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=head_dim, window=masks.normalize_window(window), **shape),
        axis_sizes, device_kind, hardware))
    if tuned is not None:
        return tuned["strategy"], tuned["ulysses_size"]
    chosen = planner_bytes.plan(seq_len, heads, kv_heads, head_dim, axis_sizes,
                                hardware=hardware, window=window, **shape)
    return chosen.strategy, chosen.ulysses_size
