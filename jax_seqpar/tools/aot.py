"""Compile for a target without running: the compiled program, its time and its kernels.

:func:`compile_for` lowers a jitted function for a target's platform (see
:mod:`jax_seqpar.tools.targets`) and compiles it with the real compiler. On GPU it can
turn register spills into compile errors (XLA's
``xla_gpu_fail_ptx_compilation_on_register_spilling``) and report what each Triton
kernel uses: registers, spill stores and loads (``ptxas -v`` on the PTX that XLA
dumps) and shared memory (XLA's own launch figures, from its thunk sequence).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable, Mapping, Optional

from jax_seqpar.tools import hlo

__all__ = ["compile_for", "Compiled", "KernelResources", "PRODUCTION_CODEGEN", "with_vjp"]

_ENTRY_RE = re.compile(r"^\.visible \.entry (\w+)\(", re.MULTILINE)
_PTXAS_FUNCTION_RE = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                                r"(\d+) bytes spill stores, (\d+) bytes spill loads\s*\n"
                                r".*?Used (\d+) registers")
_THUNK_RE = re.compile(r"kCustomKernel\b.*?\]\s+(\w+)\s+grid:.*?shared_memory:\s*(\d+) bytes")
_TARGET_RE = re.compile(r"^\.target\s+(\w+)", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What one GPU kernel needs per thread block.

    Attributes:
      registers: registers per thread (ptxas).
      spill_stores, spill_loads: bytes spilled to local memory per thread (ptxas).
      shared_memory: bytes of shared memory per block (XLA's launch), or None.
    """

    registers: int
    spill_stores: int
    spill_loads: int
    shared_memory: Optional[int]


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program compiled for a target.

    Attributes:
      compiled: the ``jax.stages.Compiled`` (``memory_analysis()``, ``as_text()``).
      seconds: wall time of lowering and compiling.
      kernels: ``{kernel name: KernelResources}`` of the Triton kernels (GPU with
        ``kernel_resources=True``), else None.
    """

    compiled: Any
    seconds: float
    kernels: Optional[Mapping[str, KernelResources]] = None


def with_vjp(fn: Callable) -> Callable:
    """``(q, k, v, dout) -> (out, (dq, dk, dv))``: ``fn(q, k, v)``'s forward and its
    backward at the given cotangent ``dout``, one program (what the byte and schedule
    measures compile for forward + backward)."""
    def forward_and_backward(q, k, v, dout):
        import jax
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(dout)

    return forward_and_backward


#: XLA's default backend (LLVM) optimization options, pinned for GPU and TPU programs.
PRODUCTION_CODEGEN = {"xla_backend_optimization_level": 3,
                      "xla_llvm_disable_expensive_passes": False}


def compile_for(fn: Callable, args: Any, platform: str, *, fail_on_spills: bool = False,
                kernel_resources: bool = False,
                compiler_options: Optional[Mapping[str, Any]] = None) -> Compiled:
    """Lower ``jax.jit(fn)(*args)`` for ``platform`` and compile it; nothing runs.

    The program compiles with the backend's production code generation, then
    ``compiler_options`` (e.g. a strategy's
    :func:`jax_seqpar.tools.targets.compile_options`: XLA:TPU's asynchronous all-to-all
    and all-gather).

    Args:
      fn: the function (jitted here); args: ``jax.ShapeDtypeStruct`` s with shardings
        on a :func:`jax_seqpar.tools.targets.target_mesh`.
      platform: ``"cuda"``, ``"tpu"`` or ``"cpu"`` (:func:`jax_seqpar.tools.targets.target_platform`).
      fail_on_spills: on GPU, a kernel that spills registers is a compile error.
      kernel_resources: on GPU, read every Triton kernel's :class:`KernelResources`
        (needs ``ptxas``, from the ``[aot]`` extra's ``nvidia-cuda-nvcc-cu12``).
      compiler_options: more XLA options, over the defaults above; an option given as
        None is not passed.

    Raises:
      Exception: the compiler's error (e.g. ``Compilation result discarded due to
        register spilling``, ``Shared memory size limit exceeded``, a VMEM overflow).
    """
    import jax

    # The backend's production code generation, whatever XLA_FLAGS the process has
    # (the test suite lowers LLVM's effort for its many small CPU programs).
    options: dict[str, Any] = {} if platform == "cpu" else dict(PRODUCTION_CODEGEN)
    if platform == "cuda" and fail_on_spills:
        options["xla_gpu_fail_ptx_compilation_on_register_spilling"] = True
    options.update(compiler_options or {})
    options = {key: value for key, value in options.items() if value is not None}
    dump = tempfile.mkdtemp(prefix="jax_seqpar_aot_") if (
        platform == "cuda" and kernel_resources) else None
    try:
        if dump:
            options["xla_dump_to"] = dump
        start = time.perf_counter()
        compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).compile(
            options or None)
        seconds = time.perf_counter() - start
        kernels = None
        if dump:
            names = {label.split(":", 1)[1] for label in hlo.kernel_calls(compiled)}
            kernels = _kernel_resources(dump, names)
        return Compiled(compiled, seconds, kernels)
    finally:
        if dump:
            shutil.rmtree(dump, ignore_errors=True)


def ptxas_path() -> Optional[str]:
    """``ptxas`` of the ``nvidia-cuda-nvcc-cu12`` wheel, else of ``PATH``, else None."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc") if importlib.util.find_spec(
        "nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(root, "bin", "ptxas")
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("ptxas")


def ptxas_resources(ptx: str, ptxas: Optional[str] = None) -> dict[str, tuple]:
    """``{function: (registers, spill_stores, spill_loads)}`` of ``ptxas -v`` on PTX text."""
    ptxas = ptxas or ptxas_path()
    if ptxas is None:
        raise FileNotFoundError("ptxas not found: install the [aot] extra "
                                "(nvidia-cuda-nvcc-cu12) or put ptxas on PATH.")
    arch = _TARGET_RE.search(ptx)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        done = subprocess.run([ptxas, "-v", "--gpu-name", arch.group(1) if arch else "sm_90a",
                               source.name, "-o", os.devnull],
                              capture_output=True, text=True, timeout=600, check=True)
    return {name: (int(regs), int(stores), int(loads))
            for name, _, stores, loads, regs in _PTXAS_FUNCTION_RE.findall(done.stderr)}


def _kernel_resources(dump: str, names: set) -> dict[str, KernelResources]:
    """Resources of the kernels ``names`` from an ``xla_dump_to`` folder."""
    shared: dict[str, int] = {}
    for file in os.listdir(dump):
        if file.endswith("thunk_sequence.txt"):
            with open(os.path.join(dump, file)) as f:
                shared.update((name, int(size)) for name, size in _THUNK_RE.findall(f.read()))
    found = {}
    for file in sorted(os.listdir(dump)):
        if not file.endswith(".ptx"):
            continue
        with open(os.path.join(dump, file)) as f:
            ptx = f.read()
        if not names & set(_ENTRY_RE.findall(ptx)):
            continue
        for name, (regs, stores, loads) in ptxas_resources(ptx).items():
            if name in names:
                found[name] = KernelResources(regs, stores, loads, shared.get(name))
    return found
