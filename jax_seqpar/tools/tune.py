"""Measured tuning: time the best predicted candidates on the mesh, store the winner.

:func:`tune` (``jax-seqpar tune``) compiles the ``top`` candidates
:mod:`jax_seqpar.planning.predict` ranks first, times each one's forward + backward
through :func:`jax_seqpar.sequence_parallel_attention` on the given mesh, and stores
the fastest in the tuned-plan file (:mod:`jax_seqpar.planning.tuned`), which
``strategy="auto"`` reads when ``$JAX_SEQPAR_TUNED_PLANS`` names it.
"""

from __future__ import annotations

import math
import statistics
import time

from jax_seqpar.core import masks
from jax_seqpar.planning import hardware as hardware_lib, plan as planning, predict, tuned

__all__ = ["measure_candidates", "time_candidate", "tune"]


def _timed_layer(candidate, shape, mesh, axes):
    """A jitted forward + vjp of the layer with ``candidate``, and its sharded inputs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_seqpar.api.attention import sequence_parallel_attention

    ulysses = candidate.ulysses if candidate.strategy == "hybrid" else None

    def attend(q, k, v):
        return sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=axes, strategy=candidate.strategy,
            ulysses_size=ulysses, causal=shape.causal, window=shape.window)

    def forward_and_vjp(q, k, v, dout):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(dout)

    dtype = {2: jnp.bfloat16, 4: jnp.float32}[int(shape.dtype_bytes)]
    b, s, h, kv = shape.batch, shape.seq_len, shape.num_heads, shape.num_kv_heads
    sizes = [(b, s, h, shape.head_dim), (b, s, kv, shape.head_dim), (b, s, kv, shape.v_head_dim),
             (b, s, h, shape.v_head_dim)]
    sharding = NamedSharding(mesh, P(None, axes[0] if len(axes) == 1 else axes))
    keys = jax.random.split(jax.random.key(0), 4)
    args = [jax.device_put(jax.random.normal(key, size, dtype), sharding)
            for key, size in zip(keys, sizes)]
    fn = forward_and_vjp if shape.backward else attend
    return jax.jit(fn), args if shape.backward else args[:3]


def time_candidate(candidate, shape, mesh, axes, *, warmup: int = 1, runs: int = 3) -> float:
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


def measure_candidates(ranked, shape, names, sizes, hardware, *, mesh=None, cache=None,
                       top: int = 3, warmup: int = 1, runs: int = 3) -> dict:
    """Times the first ``top`` of ``ranked`` candidates; stores the winner in ``cache``
    (:func:`jax_seqpar.planning.tuned.store`) and returns ``{label: seconds}``."""
    mesh = _mesh_for(names, sizes, mesh)
    measured = {c.label: time_candidate(c, shape, mesh, tuple(names), warmup=warmup, runs=runs)
                for c in ranked[:max(1, top)]}
    best = min(measured, key=measured.get)
    winner = next(c for c in ranked if c.label == best)
    key = tuned.cache_key(shape, dict(zip(names, sizes)), mesh.devices.flat[0].device_kind,
                          hardware)
    tuned.store(key, dict(strategy=winner.strategy, label=best,
                          ulysses_size=winner.ulysses if winner.strategy == "hybrid" else None,
                          measured_seconds=measured,
                          tuned_at=time.strftime("%Y-%m-%dT%H:%M:%S")), cache)
    return measured


def tune(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, mesh, *,
         seq_axes=None, hardware=None, cache=None, top: int = 3, runs: int = 3, **kwargs):
    """Times the best predicted candidates on ``mesh`` and stores the winner.

    Args:
      seq_len, num_heads, num_kv_heads, head_dim: the layer (global sizes).
      mesh: the ``jax.sharding.Mesh`` to time on.
      seq_axes: the sequence axis or ``(outer, inner)`` (default: every mesh axis).
      hardware: a preset name or :class:`~jax_seqpar.planning.hardware.Hardware`
        (default: the preset of the mesh's device kind).
      cache: the tuned-plan file (default :func:`jax_seqpar.planning.tuned.default_cache_path`).
      top: how many of the best predicted candidates to time; runs: timed calls each.
      **kwargs: ``batch``, ``v_head_dim``, ``dtype_bytes``, ``causal``,
        ``window``, ``memory_budget`` as in :func:`jax_seqpar.planning.plan.plan`.

    Returns:
      The :class:`~jax_seqpar.planning.plan.Plan` of the fastest measured candidate,
      with ``measured_seconds``.

    >>> chosen = tune(8192, 12, 12, 64, jax.make_mesh((8,), ("sp",)), causal=True)
    """
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
    predicted = planning.plan_for_hardware(seq_len, num_heads, num_kv_heads, head_dim,
                                           dict(zip(axes, sizes)), hardware=hardware, **kwargs)
    found = {c.label: c for c in predict.candidates(math.prod(sizes), num_heads)}
    ranked = [found[label] for label in sorted(predicted.predicted_seconds,
                                               key=predicted.predicted_seconds.get)]
    shape = predict.Shape(
        batch=kwargs.get("batch", 1), seq_len=seq_len, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
        v_head_dim=kwargs.get("v_head_dim") or head_dim,
        dtype_bytes=kwargs.get("dtype_bytes", 2), causal=kwargs.get("causal", False),
        window=masks.normalize_window(kwargs.get("window")),
        backward=kwargs.get("backward", True))
    measured = measure_candidates(ranked, shape, axes, sizes, hardware, mesh=mesh, cache=cache,
                                  top=top, runs=runs)
    return planning.choose(predicted, found[min(measured, key=measured.get)], axes, sizes,
                           hardware, measured)
