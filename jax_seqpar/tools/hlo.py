"""Read a compiled XLA program: bytes each device sends, memory, kernels, overlap.

This is the one place that measures what a program really does. Tests hold
:func:`jax_seqpar.comm_bytes` against :func:`collective_bytes`, the CLI
bench and the notebooks report both, so the counting rules live here only.

Counting rules (those of ``jax_seqpar.comm_bytes``), bytes ONE device sends over a group of ``P``
devices with bandwidth-optimal algorithms:

============================  ==============================================
HLO op                        bytes sent by one device
============================  ==============================================
``all-to-all``                ``(P-1)/P`` of its buffer (input = output size)
``all-gather``                ``(P-1)/P`` of its OUTPUT (``(P-1)`` x input)
``reduce-scatter``            ``(P-1)/P`` of its INPUT
``all-reduce``                ``2 (P-1)/P`` of its buffer
``collective-permute``        its whole buffer (``send`` counts the same)
============================  ==============================================

``P`` is the replica-group size parsed from ``replica_groups`` (the explicit
``{{0,1,2,3},{4,5,6,7}}`` form and the iota ``[2,4]<=[8]`` form); an empty
group list means every device of the program. Tuple-shaped (combined)
collectives count the sum of their elements. Asynchronous pairs count once, at
the ``*-start`` op (``all-gather-start``, ``collective-permute-start``,
``all-reduce-start``; collectives wrapped in ``async-start`` are found in the
wrapped computation); ``*-done`` ops are skipped.

Collectives inside ``while`` bodies count once per iteration: the body's
multiplier is the loop's ``known_trip_count`` (from its ``backend_config``;
XLA:TPU prints none, so a counted loop ``i = c0; i < n; i += step`` is
recognized from its condition, initial tuple and body) times the multiplier of
the computation that holds the loop, so nested loops multiply. Each branch of a
``conditional`` counts as if it ran once (an upper bound when branches differ).

Known honest limits:

* The XLA **CPU** backend promotes bf16/f16 collectives to f32 (the operand is
  a ``convert`` fusion and the reduction region is ``*_promoted``), so a bf16
  program on CPU sends 4 bytes per element here; GPU and TPU keep bf16. Compare
  against :func:`jax_seqpar.comm_bytes` with ``dtype_bytes=4`` on CPU.
* ``ragged-all-to-all`` and ``collective-broadcast`` are rejected with a
  ``ValueError`` rather than guessed (their volume is data-dependent or not
  covered by the counting rules above).

:func:`kernel_calls` counts hand-written kernels (Triton on GPU, Mosaic on TPU);
:mod:`jax_seqpar.tools.schedule` reads which transfers the schedule hides behind them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping

import numpy as np

from jax_seqpar.tools.hlo_text import (Instruction, bodies, multipliers, parse_module,
                                       shape_bytes)

__all__ = ["COLLECTIVE_KINDS", "Cost", "collective_bytes", "device_groups", "kernel_calls", "memory_bytes",
           "measure"]

#: Keys of the dict returned by :func:`collective_bytes`, always all present.
COLLECTIVE_KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce",
                    "collective-permute")

# HLO opcode -> (kind it counts as, bytes-sent factor as a function of P,
# applied to the summed operand bytes of the op).
_OPCODES: dict[str, tuple[str, Callable[[int], float]]] = {}
for _suffix in ("", "-start"):
    _OPCODES["all-to-all" + _suffix] = ("all-to-all", lambda p: (p - 1) / p)
    _OPCODES["all-gather" + _suffix] = ("all-gather", lambda p: p - 1)
    _OPCODES["reduce-scatter" + _suffix] = ("reduce-scatter", lambda p: (p - 1) / p)
    _OPCODES["all-reduce" + _suffix] = ("all-reduce", lambda p: 2 * (p - 1) / p)
    _OPCODES["collective-permute" + _suffix] = ("collective-permute", lambda p: 1)
_OPCODES["send"] = ("collective-permute", lambda p: 1)
_UNSUPPORTED = ("ragged-all-to-all", "collective-broadcast")

_EXPLICIT_GROUPS_RE = re.compile(r"replica_groups=\{(\{[\d,\s]*\}(?:\s*,\s*\{[\d,\s]*\})*)?\}")
_IOTA_GROUPS_RE = re.compile(
    r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS_RE = re.compile(r"source_target_pairs=\{(\{[\d,\s]*\}(?:\s*,\s*\{[\d,\s]*\})*)?\}")
_PARTITIONS_RE = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS_RE = re.compile(r"\breplica_count=(\d+)")


def _int_groups(text: str | None) -> tuple[tuple[int, ...], ...]:
    """``"{0,1},{2,3}"`` -> ``((0, 1), (2, 3))``."""
    return tuple(tuple(int(d) for d in group.split(",") if d.strip())
                 for group in re.findall(r"\{([^}]*)\}", text or ""))


def device_groups(inst: Instruction, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The devices (the program's partition ids, i.e. positions in the mesh's device order)
    that exchange data in collective ``inst``: its replica groups (the explicit
    ``{{0,1},{2,3}}`` and the iota ``[2,4]<=[4,2]T(1,0)`` forms; none: every device), or a
    collective-permute's ``(source, target)`` pairs."""
    pairs = _PAIRS_RE.search(inst.attributes)
    if pairs:
        return _int_groups(pairs.group(1))
    iota = _IOTA_GROUPS_RE.search(inst.attributes)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(d) for d in iota.group(4).split(",")])
        return tuple(tuple(int(d) for d in row) for row in ids.reshape(count, size))
    explicit = _EXPLICIT_GROUPS_RE.search(inst.attributes)
    if explicit and explicit.group(1):
        return _int_groups(explicit.group(1))
    return (tuple(range(num_devices)),)


def _group_size(inst: Instruction, num_devices: int) -> int:
    return len(device_groups(inst, num_devices)[0])


def _as_text(compiled_or_text: Any) -> str:
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    if hasattr(compiled_or_text, "compile") and not hasattr(compiled_or_text, "memory_analysis"):
        compiled_or_text = compiled_or_text.compile()  # a jax.stages.Lowered
    return compiled_or_text.as_text()


def collective_bytes(compiled_or_text: Any, *, default_trip_count: int | None = None
                     ) -> dict[str, float]:
    """Bytes ONE device sends, per collective kind, in one run of a compiled program.

    Args:
      compiled_or_text: a ``jax.stages.Compiled`` (``jax.jit(f).lower(*a).compile()``),
        a ``jax.stages.Lowered`` (compiled here), or its optimized HLO text.
      default_trip_count: iterations to assume for a ``while`` loop without a
        ``known_trip_count``; by default such a loop is a ``ValueError``.

    Returns:
      ``{kind: bytes}`` for every kind in :data:`COLLECTIVE_KINDS` (0.0 when
      absent), counted per the module docstring; ``sum(d.values())`` is the total.

    Example, 8 devices, local shard ``f32[8, 16]`` (512 bytes):

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: jax.lax.all_gather(x, "sp", tiled=True),
    ...                   mesh=mesh, in_specs=jax.P("sp"), out_specs=jax.P("sp"))
    >>> collective_bytes(jax.jit(f).lower(jnp.ones((64, 16))).compile())["all-gather"]
    3584.0
    """
    program = Program.of(compiled_or_text, default_trip_count)
    totals = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    for name, instructions in program.computations.items():
        if program.runs[name] == 0 or name in program.repeated:
            continue
        for inst in instructions:
            if inst.opcode in _UNSUPPORTED or inst.opcode in _OPCODES:
                kind, sent = program.payload(inst, name)
                totals[kind] += program.runs[name] * sent
    return totals


@dataclasses.dataclass
class Program:
    """A parsed program and what both the byte count and the schedule read from it."""

    computations: dict
    entry: str
    runs: dict
    shapes: dict
    num_devices: int
    #: Computations whose collectives are copies of one counted elsewhere: the bodies of
    #: XLA:TPU's async collective fusions that carry a transfer on or end it.
    repeated: set

    @classmethod
    def of(cls, compiled_or_text: Any, default_trip_count: int | None) -> "Program":
        text = _as_text(compiled_or_text)
        computations, entry = parse_module(text)
        partitions = _PARTITIONS_RE.search(text)
        replicas = _REPLICAS_RE.search(text)
        num_devices = (int(partitions.group(1)) if partitions else 1) * (
            int(replicas.group(1)) if replicas else 1)
        shapes = {inst.name: inst.shape for insts in computations.values() for inst in insts}
        return cls(computations, entry, multipliers(computations, entry, default_trip_count),
                   shapes, num_devices, _repeatedbodies(computations))

    def payload(self, inst: Instruction, computation: str) -> tuple[str, float]:
        """``(kind, bytes one device sends per run)`` of collective ``inst``."""
        if inst.opcode in _UNSUPPORTED:
            raise ValueError(f"%{inst.name} is a {inst.opcode}, whose traffic is not "
                             "modelled by collective_bytes")
        if math.isnan(self.runs[computation]):
            raise ValueError(
                f"%{inst.name} runs inside a while loop with no known_trip_count in its "
                "backend_config; pass default_trip_count=<iterations> to count it")
        kind, factor = _OPCODES[inst.opcode]
        operands = inst.operands
        if inst.opcode == "send" or "slice_sizes=" in inst.attributes:
            operands = operands[:1]  # token / in-place offsets are not payload
        payload = sum(shape_bytes(self.shapes[op]) for op in operands)
        return kind, factor(_group_size(inst, self.num_devices)) * payload


#: ``custom_call_target`` of a Pallas kernel: Triton on GPU, Mosaic on TPU.
KERNEL_TARGETS = {"__gpu$xla.gpu.triton": "triton", "tpu_custom_call": "mosaic"}
# Ops that do work a transfer can hide behind (the rest move or name buffers).
COMPUTE_OPS = ("fusion", "custom-call", "dot", "convolution", "while", "conditional", "call")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_KERNEL_NAME_RE = re.compile(r'\bname = "([^"]+)"|"kernel_name"\s*:\s*"([^"]+)"')


def label(inst: Instruction) -> str:
    """``"triton:seqpar_flash_forward"`` for a kernel call, else the opcode."""
    target = _TARGET_RE.search(inst.attributes) if inst.opcode == "custom-call" else None
    if target is None:
        return inst.opcode
    kind = KERNEL_TARGETS.get(target.group(1))
    if kind is None:
        return f"custom-call:{target.group(1)}"
    name = _KERNEL_NAME_RE.search(inst.attributes)
    return f"{kind}:{(name.group(1) or name.group(2)) if name else inst.name}"


def kernel_calls(compiled_or_text: Any) -> dict[str, int]:
    """``{"triton:<kernel name>" | "mosaic:<kernel name>": call sites}`` in the program.

    A Pallas kernel lowered for a GPU is a ``custom_call_target="__gpu$xla.gpu.triton"``
    custom call, for a TPU a ``"tpu_custom_call"``; the Pallas interpreter leaves none.
    Call sites are counted once wherever they are (a loop body is one site).
    """
    computations, _ = parse_module(_as_text(compiled_or_text))
    counts: dict[str, int] = {}
    for instructions in computations.values():
        for inst in instructions:
            called = label(inst)
            if called.split(":")[0] in KERNEL_TARGETS.values():
                counts[called] = counts.get(called, 0) + 1
    return counts


def is_collective(inst: Instruction) -> bool:
    return inst.opcode in _OPCODES or inst.opcode in _UNSUPPORTED


def fusion_marker(inst: Instruction, computations) -> str | None:
    """``"start"`` / ``"done"`` for the fusions of an XLA:TPU async collective fusion:
    their bodies hold an ``AsyncCollectiveStart`` / ``AsyncCollectiveDone`` custom call
    (next to a copy of the collective)."""
    if inst.opcode != "fusion":
        return None
    for callee in bodies(inst):
        for wrapped in computations.get(callee, ()):
            target = _TARGET_RE.search(wrapped.attributes) if wrapped.opcode == "custom-call" \
                else None
            if target and target.group(1) == "AsyncCollectiveStart":
                return "start"
            if target and target.group(1) == "AsyncCollectiveDone":
                return "done"
    return None


def _reads(instructions: list, later: int, earlier: int, index: dict) -> bool:
    """Whether ``instructions[later]`` (transitively) reads ``instructions[earlier]``."""
    todo, seen = [later], set()
    while todo:
        k = todo.pop()
        if k == earlier:
            return True
        if k in seen or k < earlier:
            continue
        seen.add(k)
        todo.extend(index[o] for o in instructions[k].operands if o in index)
    return False


def async_fusion_done(instructions: list, start: int, computations, index: dict):
    """Index of the done fusion of the async collective fusion started at ``start``."""
    return next((j for j in range(start + 1, len(instructions))
                 if fusion_marker(instructions[j], computations) == "done"
                 and _reads(instructions, j, start, index)), None)


def _repeatedbodies(computations) -> set:
    """Bodies of XLA:TPU async collective fusions that repeat the collective of the start
    fusion: the compute fusions that carry the transfer on while they run (XLA names them
    ``async_collective_fusion*``; they read the start and hold a copy of the collective)
    and the done fusion."""
    repeated = set()
    for instructions in computations.values():
        index = None
        for i, inst in enumerate(instructions):
            if inst.opcode != "fusion":
                continue
            marker = fusion_marker(inst, computations)
            for callee in bodies(inst):
                if marker == "done" or callee.startswith("async_collective_fusion"):
                    repeated.add(callee)
            if marker != "start":
                continue
            index = index or {x.name: k for k, x in enumerate(instructions)}
            done = async_fusion_done(instructions, i, computations, index)
            for j in range(i + 1, len(instructions) if done is None else done):
                between = instructions[j]
                if between.opcode == "fusion" and _reads(instructions, j, i, index):
                    repeated.update(c for c in bodies(between)
                                    if any(map(is_collective, computations.get(c, ()))))
    return repeated


def memory_bytes(compiled: Any) -> dict[str, int]:
    """Per-device memory of a compiled program, from ``compiled.memory_analysis()``.

    Deterministic and machine-independent for a given backend, which makes it
    the memory measure tests rely on.

    Returns:
      ``{"temp", "argument", "output", "alias", "generated_code"}`` in bytes, plus
      ``"peak"`` where the backend reports it. ``temp`` is the scratch XLA
      allocates beyond inputs and outputs: the quantity that must grow like
      ``S/P`` for the ring.

    >>> import jax, jax.numpy as jnp
    >>> memory_bytes(jax.jit(lambda x: x @ x).lower(jnp.ones((64, 64))).compile())["argument"]
    16384
    """
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError("this backend reports no memory_analysis() for the compiled program")
    result = {
        "temp": int(stats.temp_size_in_bytes),
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
        "generated_code": int(stats.generated_code_size_in_bytes),
    }
    peak = getattr(stats, "peak_memory_in_bytes", None)
    if peak:
        result["peak"] = int(peak)
    return result


@dataclasses.dataclass(frozen=True)
class Cost:
    """What one compiled call costs one device.

    Attributes:
      collective_bytes: ``{kind: bytes sent}``, see :func:`collective_bytes`.
      memory: ``{"temp", "argument", "output", ...}`` bytes, see :func:`memory_bytes`.
    """

    collective_bytes: Mapping[str, float]
    memory: Mapping[str, int]

    @property
    def total_collective_bytes(self) -> float:
        """Bytes one device sends over all collective kinds."""
        return float(sum(self.collective_bytes.values()))

    @property
    def temp_bytes(self) -> int:
        """Scratch memory per device (``memory["temp"]``)."""
        return self.memory["temp"]


def measure(fn: Callable, *args: Any, **kwargs: Any) -> Cost:
    """Jits, lowers and compiles ``fn(*args, **kwargs)`` and reads its :class:`Cost`.

    ``fn`` may already be jitted; ``args`` may be arrays or
    ``jax.ShapeDtypeStruct`` (with shardings), nothing is executed.

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> cost = measure(jax.shard_map(lambda x: jax.lax.psum(x, "sp"), mesh=mesh,
    ...                              in_specs=jax.P("sp"), out_specs=jax.P("sp")),
    ...                jnp.ones((64, 16)))
    >>> cost.collective_bytes["all-reduce"]  # 2 * 7/8 * 512
    896.0
    """
    import jax  # deferred: no work at import time

    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    return Cost(collective_bytes=collective_bytes(compiled), memory=memory_bytes(compiled))
