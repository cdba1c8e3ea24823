"""Calibrating the ``"cpu"`` hardware preset from micro-benchmarks on the emulated mesh.

Emulated CPU devices share the host's cores and memory, so their figures
depend on the host and on its load; :func:`calibrate_cpu` measures them with
every device of the mesh busy at once, as in a sharded program:

* ``peak_flops``: a float32 matmul on every device (FLOP/s per device);
* ``attention_efficiency``: the local attention kernel's forward + backward
  (causal, FLOPs of the visible pairs) against that peak;
* the link: ``ppermute`` to the next device at two message sizes (latency and
  bandwidth by a two-point fit), and ``all_to_all`` bandwidth over the mesh.

Every figure is the median of ``runs`` timed calls of a program that repeats
its operation ``repeats`` times (one dispatch per call).
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Optional

import jax

from jax_seqpar import kernels
from jax_seqpar.planning import hardware as hardware_lib

__all__ = ["calibrate_cpu"]


def _median_seconds(fn, args, runs: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(max(1, runs)):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _on_every_device(body, mesh, axis, *shapes, dtype=None):
    """A jitted ``shard_map`` of ``body`` over ``axis`` and its random sharded inputs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = mesh.shape[axis]
    spec = P(axis)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(shapes), out_specs=spec))
    keys = jax.random.split(jax.random.key(0), len(shapes))
    args = [jax.device_put(jax.random.normal(key, (devices * s[0],) + s[1:],
                                             dtype or jnp.float32),
                           NamedSharding(mesh, spec)) for key, s in zip(keys, shapes)]
    return fn, args


def _matmul_flops(mesh, axis, size, repeats, runs) -> float:
    import jax

    def body(a, b):  # [1, n, n] each, per device
        return jax.lax.fori_loop(0, repeats, lambda _, x: (x @ b) * 0.5, a)

    fn, args = _on_every_device(body, mesh, axis, (1, size, size), (1, size, size))
    return 2 * size**3 * repeats / _median_seconds(fn, args, runs)


def _attention_rate(mesh, axis, seq_len, heads, head_dim, runs) -> float:
    """FLOP/s of the kernel's causal forward + backward on every device at once."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_seqpar.core import masks
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.planning import compute
    from jax_seqpar.kernels import make_options

    def body(q, k, v, dout):  # [1, S, H, D] per device
        options = make_options(q, masks.MaskSpec(causal=True), kernel="xla")
        positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), q.shape[:2])
        tokens = masks.Tokens(positions, None)
        out, vjp = jax.vjp(lambda q, k, v: kernels.attention(options, q, k, v, tokens, tokens)[0],
                           q, k, v)
        return out + sum(g.sum() for g in vjp(dout))

    shape = (1, seq_len, heads, head_dim)
    fn, args = _on_every_device(body, mesh, axis, *(shape,) * 4)
    positions = np.arange(seq_len)
    pairs = compute.tile_pairs(positions, positions,
                               LayerShape(1, seq_len, heads, heads, head_dim, causal=True))
    flops = 2 * heads * 2 * head_dim * pairs * (1 + 5 / 2)  # forward + 2.5x backward
    return flops / _median_seconds(fn, args, runs)


def _collective_seconds(mesh, axis, num_floats, repeats, runs, kind) -> float:
    import jax

    devices = mesh.shape[axis]
    perm = [(i, (i + 1) % devices) for i in range(devices)]

    def once(x):
        if kind == "ppermute":
            return jax.lax.ppermute(x, axis, perm)
        return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=1, tiled=True)

    def body(x):  # [1, devices, n / devices] per device
        return jax.lax.fori_loop(0, repeats, lambda _, y: once(y), x)

    fn, args = _on_every_device(body, mesh, axis, (1, devices, num_floats // devices))
    return _median_seconds(fn, args, runs) / repeats


def calibrate_cpu(mesh: jax.sharding.Mesh | None = None, *, axis: Optional[str] = None,
                  runs: int = 5, matmul_size: int = 512,
                  attention_shape: tuple[int, int, int] = (1024, 8, 64),
                  message_bytes: tuple[int, ...] = (2**16, 2**22),
                  repeats: int = 8) -> hardware_lib.Hardware:
    """The ``"cpu"`` preset with figures measured on ``mesh`` (every device busy at once).

    Args:
      mesh: a one-axis mesh of the emulated devices (default: every device on ``"sp"``).
      axis: its axis name (default: the mesh's first).
      runs: timed calls per figure (the median is kept).
      matmul_size: ``n`` of the per-device ``n x n`` float32 matmul.
      attention_shape: ``(seq_len, heads, head_dim)`` of the per-device kernel run.
      message_bytes: the two ``ppermute`` sizes of the latency/bandwidth fit
        (the larger one also sizes the all-to-all).
      repeats: operations per timed program.

    Returns:
      ``hardware.CPU`` with ``peak_flops``, ``attention_efficiency`` and both
      links (one domain: the host) replaced by the measurements.

    .. code-block:: python

        cpu = calibrate_cpu()
        plan(8192, 12, 12, 64, 8, hardware=cpu, causal=True).predicted_seconds
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if mesh is None:
        mesh = Mesh(np.array(jax.devices()), ("sp",))
    axis = axis or mesh.axis_names[0]
    peak = _matmul_flops(mesh, axis, matmul_size, repeats, runs)
    seq_len, heads, head_dim = attention_shape
    efficiency = min(1.0, _attention_rate(mesh, axis, seq_len, heads, head_dim, runs) / peak)
    small, large = (max(4 * mesh.shape[axis], b) // 4 for b in message_bytes)
    measure = functools.partial(_collective_seconds, mesh, axis, repeats=repeats, runs=runs)
    t_small, t_large = measure(small, kind="ppermute"), measure(large, kind="ppermute")
    bandwidth = 4 * (large - small) / max(t_large - t_small, 1e-9)
    latency = max(0.0, t_small - 4 * small / bandwidth)
    devices = mesh.shape[axis]
    a2a_sent = 4 * large * (devices - 1) / devices
    a2a_bandwidth = a2a_sent / max(measure(large, kind="all_to_all") - latency, 1e-9)
    link = hardware_lib.Link(bandwidth, latency, all_to_all_bandwidth=a2a_bandwidth)
    return hardware_lib.CPU.replace(peak_flops=peak, attention_efficiency=efficiency,
                                    ici=link, dcn=link)
