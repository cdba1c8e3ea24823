"""Measured tuning: time the best predicted candidates on the mesh, store the winner.

:func:`tune` (``jax-seqpar tune``) compiles the ``top`` candidates
:mod:`jax_seqpar.planning.predict` ranks first, times each one's forward + backward
through :func:`jax_seqpar.sequence_parallel_attention` on the given mesh, and stores
the fastest in the tuned-plan file (:mod:`jax_seqpar.planning.tuned`), which
``strategy="auto"`` reads when ``$JAX_SEQPAR_TUNED_PLANS`` names it.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import TYPE_CHECKING, Optional, Sequence

import jax

from jax_seqpar.core.masks import normalize_window
from jax_seqpar.core.shape import LayerShape, dtype_of_size
from jax_seqpar.planning import hardware as hardware_lib, plan as planning, predict, tuned

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.planning.hardware import Hardware

__all__ = ["measure_candidates", "time_candidate", "tune", "tune_layer"]


def _timed_layer(candidate, shape, mesh, axes):
    """A jitted forward (+ vjp) of the layer with ``candidate``, and its sharded inputs
    (q, k, v, the output's cotangent with ``shape.backward``, segment ids with
    ``shape.segment_ids``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_seqpar.api.attention import sequence_parallel_attention

    ulysses = candidate.ulysses if candidate.strategy == "hybrid" else None

    def attend(q, k, v, *segment_ids):
        return sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=axes, strategy=candidate.strategy,
            ulysses_size=ulysses, causal=shape.causal, window=shape.window,
            segment_ids=segment_ids[0] if segment_ids else None)

    def forward_and_vjp(q, k, v, dout, *segment_ids):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, *segment_ids), q, k, v)
        return out, vjp(dout)

    sharding = NamedSharding(mesh, P(None, axes[0] if len(axes) == 1 else axes))
    keys = jax.random.split(jax.random.key(0), 4)
    args = [jax.device_put(jax.random.normal(key, size, shape.dtype), sharding)
            for key, size in zip(keys, shape.operand_shapes())]
    args = args if shape.backward else args[:3]
    if shape.segment_ids:  # one document: the ids travel, nothing is masked
        args.append(jax.device_put(jnp.zeros((shape.batch, shape.seq_len), jnp.int32),
                                   sharding))
    return jax.jit(forward_and_vjp if shape.backward else attend), args


def time_candidate(candidate: predict.Candidate, shape: LayerShape, mesh: jax.sharding.Mesh,
                   axes: tuple[str, ...], *, warmup: int = 1, runs: int = 3) -> float:
    """Median seconds of one forward (+ backward) call of ``candidate`` on ``mesh``."""
    import jax

    fn, args = _timed_layer(candidate, shape, mesh, axes)
    compiled = fn.lower(*args).compile()
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(max(1, runs)):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _mesh_for(names, sizes, mesh):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if mesh is not None:
        for name, size in zip(names, sizes):
            if mesh.shape.get(name) != size:
                raise ValueError(f"mesh {dict(mesh.shape)} does not have the planned axis "
                                 f"{name}={size}.")
        return mesh
    needed = math.prod(sizes)
    if jax.device_count() < needed:
        raise ValueError(f"measuring needs {needed} devices, JAX has {jax.device_count()}.")
    return Mesh(np.array(jax.devices()[:needed]).reshape(sizes), tuple(names))


def measure_candidates(ranked: Sequence[predict.Candidate], shape: LayerShape,
                       names: tuple[str, ...], sizes: tuple[int, ...],
                       hardware: Hardware | str | None, *, mesh: jax.sharding.Mesh | None = None,
                       cache: str | os.PathLike | None = None, top: int = 3, warmup: int = 1,
                       runs: int = 3) -> dict:
    """Times the first ``top`` of ``ranked`` candidates; stores the winner in ``cache``
    (:func:`jax_seqpar.planning.tuned.store`) and returns ``{label: seconds}``."""
    mesh = _mesh_for(names, sizes, mesh)
    measured = {c.label: time_candidate(c, shape, mesh, tuple(names), warmup=warmup, runs=runs)
                for c in ranked[:max(1, top)]}
    best = min(measured, key=measured.__getitem__)
    winner = next(c for c in ranked if c.label == best)
    key = tuned.cache_key(shape, dict(zip(names, sizes)), mesh.devices.flat[0].device_kind,
                          None if hardware is None else hardware_lib.get(hardware))
    tuned.store(key, dict(strategy=winner.strategy, label=best,
                          ulysses_size=winner.ulysses if winner.strategy == "hybrid" else None,
                          measured_seconds=measured,
                          tuned_at=time.strftime("%Y-%m-%dT%H:%M:%S")), cache)
    return measured


def tune(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, mesh: jax.sharding.Mesh, *,
         seq_axes: str | tuple[str, ...] | None = None, hardware: Hardware | str | None = None,
         cache: str | os.PathLike | None = None, top: int = 3, runs: int = 3, batch: int = 1,
         v_head_dim: Optional[int] = None, dtype_bytes: float = 2, causal: bool = False,
         window: int | tuple[int, int] | None = None, backward: bool = True,
         memory_budget: Optional[float] = None):
    """Times the best predicted candidates on ``mesh`` and stores the winner.

    Args:
      seq_len, num_heads, num_kv_heads, head_dim: the layer (global sizes).
      mesh: the ``jax.sharding.Mesh`` to time on.
      seq_axes: the sequence axis or ``(outer, inner)`` (default: every mesh axis).
      hardware: a preset name or :class:`~jax_seqpar.planning.hardware.Hardware`
        (default: the preset of the mesh's device kind).
      cache: the tuned-plan file (default :func:`jax_seqpar.planning.tuned.default_cache_path`).
      top: how many of the best predicted candidates to time; runs: timed calls each.
      batch, v_head_dim, dtype_bytes, causal, window, backward, memory_budget: as in
        :func:`jax_seqpar.planning.plan.plan` (the layer is timed in the dtype of
        ``dtype_bytes``: bfloat16 for 2, float32 for 4).

    Returns:
      The :class:`~jax_seqpar.planning.plan.Plan` of the fastest measured candidate,
      with ``measured_seconds``.

    .. code-block:: python

        chosen = tune(8192, 12, 12, 64, jax.make_mesh((8,), ("sp",)), causal=True)
    """
    shape = LayerShape(batch=batch, seq_len=seq_len, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                       dtype=dtype_of_size(dtype_bytes), causal=causal,
                       window=normalize_window(window), backward=backward)
    return tune_layer(shape, mesh, seq_axes=seq_axes, hardware=hardware, cache=cache, top=top,
                      runs=runs, memory_budget=memory_budget)


def tune_layer(shape: LayerShape, mesh: jax.sharding.Mesh, *,
               seq_axes: str | tuple[str, ...] | None = None,
               hardware: Hardware | str | None = None, cache: str | os.PathLike | None = None,
               top: int = 3, runs: int = 3, memory_budget: Optional[float] = None):
    """:func:`tune` for a :class:`~jax_seqpar.core.shape.LayerShape` (timed in its dtype)."""
    axes = tuple(mesh.axis_names) if seq_axes is None else (
        (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes))
    sizes = tuple(mesh.shape[name] for name in axes)
    if hardware is None:
        kind = mesh.devices.flat[0].device_kind
        hardware = hardware_lib.for_device_kind(kind)
        if hardware is None:
            raise ValueError(f"no preset for device kind {kind!r}; pass hardware= (a Hardware "
                             f"or one of {sorted(hardware_lib.PRESETS)}).")
    hardware = hardware_lib.get(hardware)
    predicted = planning.plan_layer(shape, dict(zip(axes, sizes)), hardware=hardware,
                                    memory_budget=memory_budget)
    found = {c.label: c for c in predict.candidates(math.prod(sizes), shape.num_heads)}
    ranked = [found[label] for label in sorted(predicted.predicted_seconds,
                                               key=predicted.predicted_seconds.__getitem__)]
    measured = measure_candidates(ranked, shape, axes, sizes, hardware, mesh=mesh, cache=cache,
                                  top=top, runs=runs)
    return planning.choose(predicted, found[min(measured, key=measured.__getitem__)], axes, sizes,
                           hardware, measured)
