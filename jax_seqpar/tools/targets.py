"""Compile-only meshes of GPUs and TPUs, by name, on any host (deviceless AOT).

``"h100:8"`` is eight H100 SXM GPUs on one host (``h200:N``, ``a100:N`` alike; more
than 8 are hosts of 8), ``"v5p:2x2x2"`` a TPU v5p slice (``v5e:2x4``, ``v6e:2x4``,
``v4:2x2x2``, ...: any topology libtpu knows), ``"v5p:2x2x2*2"`` two such slices joined
by the data-center network (DCN, as multi-slice training runs), ``"cpu"`` / ``"cpu:N"``
this host's CPU devices. A target mesh holds devices that cannot run anything, but programs on
it compile with the real compilers: XLA:GPU with Triton and ptxas for sm_90a /
sm_80, XLA:TPU with Mosaic. Lower for the target's platform::

    mesh = target_mesh("h100:8")
    compiled = jax.jit(f).trace(*args).lower(
        lowering_platforms=(target_platform("h100:8"),)).compile()

GPU targets are described by the ``gpu_targets/*.txtpb`` files shipped with the
package (``GpuTargetConfigProto``: compute capability, SM count, shared memory and
register limits, HBM). Compiling for a GPU or TPU target needs the plugins of the
``[aot]`` extra (``pip install 'jax_seqpar[aot]'``); JAX's platforms should then be
CPU only (``JAX_PLATFORMS=cpu``), since nothing runs on the target devices.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import math
import os
import re
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # targets imports nothing of the package at run time
    from jax_seqpar.strategies.registry import StrategyName

__all__ = ["COMPILE_OPTIONS", "TPU_HEAD_GROUP_OPTIONS", "Target", "compile_only_environment",
           "compile_options", "domains", "emulate_cpu_devices", "libtpu_init_args", "parse",
           "require_plugin", "target_mesh", "target_platform"]

#: GPU kinds, each ``(target description file, GPUs per host)``.
GPUS = {"h100": ("h100_sxm.txtpb", 8), "h200": ("h200.txtpb", 8), "a100": ("a100_sxm_80.txtpb", 8)}
#: HBM per TPU device (one chip; v4 and v5p as one megacore device), bytes.
TPU_HBM = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}
#: XLA:TPU runs all-to-all synchronously unless asked: this makes it asynchronous. The
#: sequence pieces' transfers pass the barriers of their kernels and need no more.
_TPU_ASYNC_ALL_TO_ALL = {"xla_tpu_enable_async_all_to_all": True}
#: What a pipeline over head groups (``pieces=1``: a local length too short for sequence
#: pieces, or forced) needs on TPU besides: the scheduler starts a group's exchange
#: before the previous group's kernel only with it (v5p:2x2x2, S=16384, 2 groups: a
#: third of the forward's bytes hidden with it, none without). Not among the default
#: options: it raises the sequence pieces' memory (Ulysses' training step at 131072 on
#: v5p:2x2x2: 780.7 MiB temp with it, 517.6 without; the hybrid's 916.4 and 696.4).
TPU_HEAD_GROUP_OPTIONS = {"xla_tpu_use_aggressive_scheduling": True}
#: XLA:TPU runs all-gather synchronously unless asked: these make it an async collective
#: fusion that runs inside the Mosaic call it can hide behind (each of the five is needed;
#: tests/test_compile_gate.py holds that with them the gather encloses a kernel).
_TPU_ASYNC_ALL_GATHER = {
    "xla_enable_async_all_gather": True,
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
    "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
    "xla_tpu_enable_async_collective_fusion_with_mosaic_custom_call": True,
}
#: XLA options the library's target compiles set (``jax-seqpar bench --target``, the
#: compile gate), per lowering platform and strategy: each strategy gets only what its own
#: collectives need, since every option costs memory elsewhere (the all-gather's fusion
#: options raise the Mosaic ring's temp at S=32768 on v5p:2x2x2 from 156.8 to 177.7 MiB,
#: fwd+bwd; XLA:TPU's collective-permutes, the ring's, are asynchronous without any).
#: XLA:GPU needs none. Pass the same options to your own programs
#: (:func:`compile_options`; or ``LIBTPU_INIT_ARGS``, :func:`libtpu_init_args`) for the
#: schedules ``bench --target`` reports.
COMPILE_OPTIONS = {
    "tpu": {"ulysses": _TPU_ASYNC_ALL_TO_ALL, "hybrid": _TPU_ASYNC_ALL_TO_ALL,
            "allgather": _TPU_ASYNC_ALL_GATHER, "ring": {}},
    "cuda": {},
    "cpu": {},
}
_PLUGINS = {"cuda": ("jax_cuda12_plugin", "the CUDA plugin (jax-cuda12-plugin)"),
            "tpu": ("libtpu", "libtpu")}
_TPU_NAME_RE = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)+)(?:\*(\d+))?$")
_DEVICE_MEMORY_RE = re.compile(r"\bdevice_memory_size:\s*(\d+)")
_KNOWN = ("h100:N, h200:N, a100:N (N GPUs, hosts of 8 beyond 8), TPU topologies "
          "v5p:2x2x2, v5e:2x4, v6e:2x4, v4:2x2x2, ... (v5p:2x2x2*2: two slices), cpu or "
          "cpu:N")


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target name.

    Attributes:
      name: as given, e.g. ``"h100:8"``.
      platform: the lowering platform, ``"cuda"``, ``"tpu"`` or ``"cpu"``.
      kind: ``"h100"``, ``"v5p"``, ... or ``"cpu"``.
      num_devices: devices in the mesh.
      topology: the topology string of :func:`jax.experimental.topologies.get_topology_desc`
        (of one slice).
      slices: TPU slices joined by DCN (1: one slice, or not a TPU).
    """

    name: str
    platform: str
    kind: str
    num_devices: int
    topology: str
    slices: int = 1

    @property
    def hbm_bytes(self) -> Optional[int]:
        """Memory of one device in bytes (None for CPU)."""
        if self.platform == "cuda":
            found = _DEVICE_MEMORY_RE.search(gpu_target_config(self.kind))
            if found is None:
                raise ValueError(f"the target description of {self.kind!r} gives no memory.")
            return int(found.group(1))
        return TPU_HBM.get(self.kind) if self.platform == "tpu" else None


def parse(name: str) -> Target:
    """The :class:`Target` of ``name``; a ``ValueError`` naming the known forms if unknown."""
    kind, _, count = name.partition(":")
    if kind == "cpu" and (not count or count.isdigit() and int(count) > 0):
        return Target(name, "cpu", "cpu", int(count) if count else 0, "")
    if kind in GPUS:
        per_host = GPUS[kind][1]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"target {name!r} needs a GPU count, e.g. '{kind}:8'.")
        n = int(count)
        if n > per_host and n % per_host:
            raise ValueError(f"target {name!r}: {n} GPUs beyond one host must be whole hosts "
                             f"of {per_host}; use {kind}:{n - n % per_host} or "
                             f"{kind}:{n + per_host - n % per_host}.")
        hosts = max(1, n // per_host)
        return Target(name, "cuda", kind, n, f"1x{hosts}x{n // hosts}")
    found = _TPU_NAME_RE.match(name)
    if found:
        dims = [int(d) for d in found.group(2).split("x")]
        slices = int(found.group(3) or 1)
        if slices < 1:
            raise ValueError(f"target {name!r} needs at least one slice; e.g. "
                             f"'{found.group(1)}:{found.group(2)}*2'.")
        return Target(name, "tpu", found.group(1), math.prod(dims) * slices,
                      f"{found.group(1)}:{found.group(2)}", slices)
    raise ValueError(f"unknown target {name!r}; known forms: {_KNOWN}.")


def compile_options(platform: str, strategy: Optional[StrategyName] = None) -> dict:
    """The XLA options of :data:`COMPILE_OPTIONS` for ``strategy``'s programs on
    ``platform`` (``"tpu"``, ...), or every strategy's (None: a program that runs several),
    for ``jax.jit(f).lower(*args).compile(compiler_options=compile_options("tpu"))``.

    >>> compile_options("tpu", "ulysses")
    {'xla_tpu_enable_async_all_to_all': True}
    >>> compile_options("tpu", "ring")
    {}
    """
    per_strategy = COMPILE_OPTIONS.get(platform, {})
    if strategy is not None:
        return dict(per_strategy.get(strategy, {}))
    return {key: value for options in per_strategy.values() for key, value in options.items()}


def libtpu_init_args(strategy: Optional[StrategyName] = None) -> str:
    """:func:`compile_options` for TPU as command-line flags, for ``LIBTPU_INIT_ARGS`` (set
    before JAX starts the TPU backend; every program of the process then compiles with
    them).

    >>> libtpu_init_args("ulysses")
    '--xla_tpu_enable_async_all_to_all=true'
    """
    return " ".join(f"--{key}={str(value).lower()}"
                    for key, value in compile_options("tpu", strategy).items())


def target_platform(name: str) -> str:
    """The platform to lower for: ``"cuda"``, ``"tpu"`` or ``"cpu"``.

    >>> target_platform("h100:8"), target_platform("v5p:2x2x2")
    ('cuda', 'tpu')
    """
    return parse(name).platform


@functools.cache
def gpu_target_config(kind: str) -> str:
    """The ``GpuTargetConfigProto`` text of GPU ``kind`` (``"h100"``, ``"h200"``, ``"a100"``)."""
    if kind not in GPUS:
        raise ValueError(f"no GPU target description for {kind!r}; known: {sorted(GPUS)}.")
    return (importlib.resources.files("jax_seqpar.tools") / "gpu_targets" / GPUS[kind][0]).read_text()


def require_plugin(platform: str) -> None:
    """Raise ``ImportError`` naming the ``[aot]`` extra unless ``platform`` can compile here."""
    if platform == "cpu":
        return
    module, what = _PLUGINS[platform]
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"compiling for {platform} targets needs {what}: "
                          "pip install 'jax_seqpar[aot]' (the [aot] extra).")


@functools.cache
def _devices(name: str) -> tuple:
    from jax.experimental import topologies

    target = parse(name)
    require_plugin(target.platform)
    if target.platform == "cpu":
        import jax

        devices = jax.devices("cpu")
        count = target.num_devices or len(devices)
        if count > len(devices):
            raise ValueError(
                f"target {name!r} needs {count} CPU devices but JAX has {len(devices)}; set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX starts.")
        return tuple(devices[:count])
    if target.platform == "cuda":
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name=target.kind, topology=target.topology,
            target_config=gpu_target_config(target.kind))
    else:
        # libtpu locks /tmp/libtpu_lockfile so one process owns the TPUs; compile-only
        # topologies own none, so compiling processes (CI, a bench) may run side by side.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        extra: dict[str, str | int] = (
            {"chip_config_name": "megacore"} if target.kind == "v4" else {})
        if target.slices > 1:
            extra["num_slices"] = target.slices
        topology = topologies.get_topology_desc(topology_name=target.topology,
                                                platform="tpu", **extra)
    # Host-major order (slices, then their hosts): an inner mesh axis stays within a host
    # (NVLink / one TPU host), an axis inside a slice within it.
    return tuple(sorted(topology.devices, key=lambda d: (d.process_index, d.id)))


def domains(devices: Sequence) -> int:
    """How many domains of fast links ``devices`` span: TPU slices (joined by DCN), else
    hosts (GPUs joined by NVLink within a host, by the network across)."""
    slices = {getattr(d, "slice_index", 0) for d in devices}
    return len(slices) if len(slices) > 1 else len({d.process_index for d in devices})


def target_mesh(name: str, axis_names: Sequence[str] = ("sp",),
                shape: Optional[Sequence[int]] = None):
    """A :class:`jax.sharding.Mesh` of the devices of target ``name`` (compile-only on GPU/TPU).

    Args:
      name: a target name (see the module docstring), e.g. ``"h100:8"``, ``"v5p:2x2x2"``.
      axis_names: the mesh axes, outer first.
      shape: the size of each axis (product: the target's devices). Default: all
        devices on one axis; with two axes, ``(slices, devices per slice)`` for TPU
        slices, else ``(hosts, devices per host)`` (:func:`domains`).

    Raises:
      ValueError: an unknown name, or a shape that does not fit the target.
      ImportError: the plugin the target needs is not installed (the ``[aot]`` extra).

    .. code-block:: python

        mesh = target_mesh("h100:16", ("dcn", "ici"))      # 2 hosts x 8 GPUs
        mesh = target_mesh("v5p:2x2x2*2", ("dcn", "ici"))  # 2 slices x 8 chips
    """
    from jax.sharding import Mesh

    devices = _devices(name)
    axis_names = tuple(axis_names)
    if shape is None:
        hosts = domains(devices)
        if len(axis_names) == 1:
            shape = (len(devices),)
        elif len(axis_names) == 2 and hosts > 1:
            shape = (hosts, len(devices) // hosts)
        else:
            raise ValueError(f"target {name!r} ({len(devices)} devices in {hosts} host(s) or "
                             f"slice(s)) has no default shape for axes {axis_names}; pass "
                             "shape=.")
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axis_names) or math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {shape} for axes {axis_names} must have one size per "
                         f"axis and {len(devices)} devices in all (target {name!r}).")
    return Mesh(np.array(devices, dtype=object).reshape(shape), axis_names)


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def emulate_cpu_devices(count: int, *, cpu_only: bool = False) -> None:
    """Ask for ``count`` CPU devices (unless XLA_FLAGS chose already); call it before
    JAX starts a backend (importing ``jax`` does not start one).

    With ``cpu_only``, JAX's platforms are set to CPU unless JAX_PLATFORMS is set;
    otherwise JAX keeps its default backend: an accelerator when one is present,
    else the ``count`` emulated CPU devices.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()
    if cpu_only:
        compile_only_environment()


def compile_only_environment() -> None:
    """Make JAX start only its CPU backend, unless the user chose platforms.

    Compiling for a target runs nothing on it, and an installed GPU or TPU plugin
    without its device would otherwise be initialized (and checked) for nothing.
    Call it before JAX starts a backend.
    """
    if "JAX_PLATFORMS" not in os.environ:
        import jax

        jax.config.update("jax_platforms", "cpu")
