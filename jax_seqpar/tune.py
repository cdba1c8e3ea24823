"""Measured tuning: time the best predicted candidates on the mesh, cache the winner.

:func:`tune` (``jax-seqpar tune``, ``plan(..., measure=True)``) compiles the
``top`` candidates :mod:`jax_seqpar.predict` ranks first, times each one's
forward + backward through :func:`jax_seqpar.sequence_parallel_attention` on
the given mesh, and stores the fastest in a JSON file keyed by the layer's
shape, the mesh's sequence axes and device kind, and the hardware preset.
``strategy="auto"`` looks there first (:func:`lookup`), so a tuned choice is
reused by every later call with that key, in any process.

The file is ``$JAX_SEQPAR_TUNE_CACHE`` if set, else
``$XDG_CACHE_HOME/jax_seqpar/tuned_plans.json`` (``~/.cache`` by default).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import time
from typing import Optional

__all__ = ["cache_key", "default_cache_path", "lookup", "measure_candidates", "store", "tune"]

ENV_VAR = "JAX_SEQPAR_TUNE_CACHE"


def default_cache_path() -> pathlib.Path:
    """``$JAX_SEQPAR_TUNE_CACHE``, else ``<user cache dir>/jax_seqpar/tuned_plans.json``."""
    if os.environ.get(ENV_VAR):
        return pathlib.Path(os.environ[ENV_VAR])
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "jax_seqpar" / "tuned_plans.json"


def cache_key(shape, axis_sizes, device_kind: str, hardware) -> str:
    """One string per (layer shape, sequence axes of the mesh, device kind, hardware)."""
    key = dict(shape=dict(vars(shape), window=list(shape.window) if shape.window else None),
               mesh={str(k): int(v) for k, v in dict(axis_sizes).items()},
               device_kind=device_kind,
               hardware=None if hardware is None else hardware.name)
    return json.dumps(key, sort_keys=True)


def _read(path: pathlib.Path) -> dict:
    try:
        with open(path) as file:
            entries = json.load(file)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ValueError(f"the tuning cache {str(path)!r} is not readable JSON ({error}); "
                         f"delete it or point {ENV_VAR} elsewhere.") from None
    return entries if isinstance(entries, dict) else {}


def lookup(key: str, cache=None) -> Optional[dict]:
    """The cached entry for ``key`` (``{"strategy", "ulysses_size", ...}``) or None."""
    return _read(pathlib.Path(cache) if cache else default_cache_path()).get(key)


def store(key: str, entry: dict, cache=None) -> pathlib.Path:
    """Adds ``entry`` under ``key`` to the cache file (written atomically); returns its path."""
    path = pathlib.Path(cache) if cache else default_cache_path()
    entries = _read(path)
    entries[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(partial, path)
    return path


def _timed_layer(candidate, shape, mesh, axes):
    """A jitted forward + vjp of the layer with ``candidate``, and its sharded inputs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_seqpar.api import sequence_parallel_attention

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
    """Times the first ``top`` of ``ranked`` candidates; caches and returns ``{label: s}``."""
    mesh = _mesh_for(names, sizes, mesh)
    measured = {c.label: time_candidate(c, shape, mesh, tuple(names), warmup=warmup, runs=runs)
                for c in ranked[:max(1, top)]}
    best = min(measured, key=measured.get)
    winner = next(c for c in ranked if c.label == best)
    key = cache_key(shape, dict(zip(names, sizes)), mesh.devices.flat[0].device_kind, hardware)
    store(key, dict(strategy=winner.strategy, label=best,
                    ulysses_size=winner.ulysses if winner.strategy == "hybrid" else None,
                    measured_seconds=measured, tuned_at=time.strftime("%Y-%m-%dT%H:%M:%S")),
          cache)
    return measured


def tune(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, mesh, *,
         seq_axes=None, hardware=None, cache=None, top: int = 3, runs: int = 3, **kwargs):
    """Times the best predicted candidates on ``mesh`` and caches the winner.

    Args:
      seq_len, num_heads, num_kv_heads, head_dim: the layer (global sizes).
      mesh: the ``jax.sharding.Mesh`` to time on.
      seq_axes: the sequence axis or ``(outer, inner)`` (default: every mesh axis).
      hardware: a preset name or :class:`~jax_seqpar.hardware.Hardware`
        (default: the preset of the mesh's device kind).
      cache: the JSON file (default :func:`default_cache_path`).
      top: how many of the best predicted candidates to time; runs: timed calls each.
      **kwargs: ``batch``, ``v_head_dim``, ``dtype_bytes``, ``causal``,
        ``window``, ``memory_budget`` as in :func:`jax_seqpar.plan.plan`.

    Returns:
      The :class:`~jax_seqpar.plan.Plan`, with ``measured_seconds``.

    >>> chosen = tune(8192, 12, 12, 64, jax.make_mesh((8,), ("sp",)), causal=True)
    """
    from jax_seqpar import planner

    axes = tuple(mesh.axis_names) if seq_axes is None else (
        (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes))
    return planner.plan_for_hardware(
        seq_len, num_heads, num_kv_heads, head_dim, {name: mesh.shape[name] for name in axes},
        hardware=hardware, measure=True, mesh=mesh, cache=cache, top=top, runs=runs, **kwargs)
