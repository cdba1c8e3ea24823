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

:func:`async_collectives` reads the schedule of a compiled program (its text is
in execution order): which compute each asynchronous collective's start/done
pair encloses, i.e. whether its transfer is scheduled to overlap compute.
:func:`collective_schedule` lists every collective (synchronous ones and XLA:TPU's
async collective fusions too) with its bytes and whether a kernel runs inside its
transfer; :func:`bytes_hidden` sums it up: the share of the bytes a device sends that
is scheduled behind a kernel.
:func:`kernel_calls` counts hand-written kernels (Triton on GPU, Mosaic on TPU).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping

from jax_seqpar.tools.hlo_text import Instruction, multipliers, parse_module, shape_bytes

__all__ = ["COLLECTIVE_KINDS", "AsyncCollective", "Cost", "ScheduledCollective",
           "async_collectives", "bytes_hidden", "collective_bytes", "collective_schedule",
           "kernel_calls", "memory_bytes", "measure"]

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
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[")
_PARTITIONS_RE = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS_RE = re.compile(r"\breplica_count=(\d+)")
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")


def _group_size(inst: Instruction, num_devices: int) -> int:
    iota = _IOTA_GROUPS_RE.search(inst.attributes)
    if iota:
        return int(iota.group(2))
    explicit = _EXPLICIT_GROUPS_RE.search(inst.attributes)
    if explicit and explicit.group(1):
        first_group = re.match(r"\{([^}]*)\}", explicit.group(1)).group(1)
        return len([d for d in first_group.split(",") if d.strip()])
    return num_devices


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

    >>> f = jax.shard_map(lambda x: jax.lax.all_gather(x, "sp", tiled=True),
    ...                   mesh=mesh, in_specs=P("sp"), out_specs=P("sp"))
    >>> collective_bytes(jax.jit(f).lower(jnp.ones((64, 16))).compile())["all-gather"]
    3584.0
    """
    program = _Program.of(compiled_or_text, default_trip_count)
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
class _Program:
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
    def of(cls, compiled_or_text: Any, default_trip_count: int | None) -> "_Program":
        text = _as_text(compiled_or_text)
        computations, entry = parse_module(text)
        partitions = _PARTITIONS_RE.search(text)
        replicas = _REPLICAS_RE.search(text)
        num_devices = (int(partitions.group(1)) if partitions else 1) * (
            int(replicas.group(1)) if replicas else 1)
        shapes = {inst.name: inst.shape for insts in computations.values() for inst in insts}
        return cls(computations, entry, multipliers(computations, entry, default_trip_count),
                   shapes, num_devices, _repeated_fusion_bodies(computations))

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
_COMPUTE = ("fusion", "custom-call", "dot", "convolution", "while", "conditional", "call")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_KERNEL_NAME_RE = re.compile(r'\bname = "([^"]+)"|"kernel_name"\s*:\s*"([^"]+)"')


def _label(inst: Instruction) -> str:
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
            label = _label(inst)
            if label.split(":")[0] in KERNEL_TARGETS.values():
                counts[label] = counts.get(label, 0) + 1
    return counts


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    """One asynchronous collective as scheduled: what runs between its start and done.

    Attributes:
      name: the ``*-start`` (or ``async-start``) instruction.
      kind: its kind, one of :data:`COLLECTIVE_KINDS`.
      computation: the computation holding it (a loop body for the ring's steps).
      runs: how many times it runs per program run (loop trips multiplied).
      enclosed: labels of the compute scheduled between start and done, in order:
        ``"triton:<kernel>"``, ``"mosaic:<kernel>"``, ``"fusion"``, ``"while"``, ...
    """

    name: str
    kind: str
    computation: str
    runs: float
    enclosed: tuple[str, ...]

    @property
    def overlapped(self) -> bool:
        """Whether any compute is scheduled while the transfer is in flight."""
        return bool(self.enclosed)


def _async_kind(inst: Instruction, computations) -> str | None:
    if inst.opcode.endswith("-start") and inst.opcode in _OPCODES:
        return _OPCODES[inst.opcode][0]
    if inst.opcode == "async-start":
        called = _CALLS_RE.search(inst.attributes)
        for wrapped in computations.get(called.group(1), ()) if called else ():
            if wrapped.opcode in _OPCODES:
                return _OPCODES[wrapped.opcode][0]
    return None


def async_collectives(compiled_or_text: Any, *, default_trip_count: int | None = None
                      ) -> list[AsyncCollective]:
    """Every asynchronous collective of a scheduled program and the compute it encloses.

    The optimized HLO of ``jax.jit(f).lower(...).compile()`` is printed in schedule
    order (``is_scheduled=true``), so the instructions between a ``*-start`` and
    its ``*-done`` in the same computation are what the device runs while the
    transfer is in flight. GPU and TPU programs have such pairs; CPU runs
    collectives synchronously and has none.

    Args:
      compiled_or_text: as in :func:`collective_bytes`.
      default_trip_count: as in :func:`collective_bytes` (for ``runs``).

    Returns:
      :class:`AsyncCollective` s in program order, one per start/done pair.
    """
    text = _as_text(compiled_or_text)
    computations, entry = parse_module(text)
    loop_runs = multipliers(computations, entry, default_trip_count)
    found = []
    for computation, instructions in computations.items():
        for i, inst in enumerate(instructions):
            kind = _async_kind(inst, computations)
            if kind is None:
                continue
            done = next((j for j, later in enumerate(instructions[i + 1:], i + 1)
                         if later.operands[:1] == (inst.name,)
                         and later.opcode.endswith("-done")), None)
            if done is None:
                raise ValueError(f"%{inst.name} has no matching *-done in {computation}")
            enclosed = tuple(_label(between) for between in instructions[i + 1:done]
                             if between.opcode in _COMPUTE)
            found.append(AsyncCollective(inst.name, kind, computation, loop_runs[computation],
                                         enclosed))
    return found


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of a scheduled program: its bytes, and whether a kernel hides it.

    Attributes:
      name: the instruction that starts it (``*-start``, ``async-start``, ``send``,
        an XLA:TPU async collective fusion) or the synchronous collective itself.
      kind: one of :data:`COLLECTIVE_KINDS`.
      computation: the computation holding it.
      runs: how many times it runs per program run (loop trips multiplied).
      bytes: bytes ONE device sends per run (the rules of :func:`collective_bytes`).
      is_async: a start/done pair; a synchronous collective hides behind nothing.
      enclosed: labels of the compute scheduled between start and done (as in
        :class:`AsyncCollective`); for a pair whose done is in the next trip of a loop,
        the rest of the body after the start and the head of the body before the done.
      encloses_kernel: a kernel runs between start and done (see :func:`bytes_hidden`).
    """

    name: str
    kind: str
    computation: str
    runs: float
    bytes: float
    is_async: bool
    enclosed: tuple[str, ...]
    encloses_kernel: bool

    @property
    def total_bytes(self) -> float:
        """Bytes one device sends in all its runs."""
        return self.runs * self.bytes


_CALLEES_RE = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LIST_RE = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
# Custom calls that are matrix products (cuBLAS / cuBLASLt on GPU).
_MATMUL_TARGET_RE = re.compile(r"gemm|matmul", re.IGNORECASE)


def _callees(inst: Instruction) -> list[str]:
    names = _CALLEES_RE.findall(inst.attributes)
    for group in _CALLEE_LIST_RE.findall(inst.attributes):
        names += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
    return names


def _is_collective(inst: Instruction) -> bool:
    return inst.opcode in _OPCODES or inst.opcode in _UNSUPPORTED


def _fusion_marker(inst: Instruction, computations) -> str | None:
    """``"start"`` / ``"done"`` for the fusions of an XLA:TPU async collective fusion:
    their bodies hold an ``AsyncCollectiveStart`` / ``AsyncCollectiveDone`` custom call
    (next to a copy of the collective)."""
    if inst.opcode != "fusion":
        return None
    for callee in _CALLS_RE.findall(inst.attributes):
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


def _async_fusion_done(instructions: list, start: int, computations, index: dict):
    """Index of the done fusion of the async collective fusion started at ``start``."""
    return next((j for j in range(start + 1, len(instructions))
                 if _fusion_marker(instructions[j], computations) == "done"
                 and _reads(instructions, j, start, index)), None)


def _repeated_fusion_bodies(computations) -> set:
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
            marker = _fusion_marker(inst, computations)
            for callee in _CALLS_RE.findall(inst.attributes):
                if marker == "done" or callee.startswith("async_collective_fusion"):
                    repeated.add(callee)
            if marker != "start":
                continue
            index = index or {x.name: k for k, x in enumerate(instructions)}
            done = _async_fusion_done(instructions, i, computations, index)
            for j in range(i + 1, len(instructions) if done is None else done):
                between = instructions[j]
                if between.opcode == "fusion" and _reads(instructions, j, i, index):
                    repeated.update(c for c in _CALLS_RE.findall(between.attributes)
                                    if any(map(_is_collective, computations.get(c, ()))))
    return repeated


def _kernel_test(computations) -> Callable[[Instruction], bool]:
    """``test(inst)``: whether ``inst`` is or runs a kernel: a Triton / Mosaic call; a
    ``while`` loop whose body holds one or a matrix product (the XLA kernel's loop over
    tiles); or a fusion, call or conditional whose computations hold one of those."""
    matmul_memo: dict[str, bool] = {}
    kernel_memo: dict[str, bool] = {}

    def is_call(inst: Instruction) -> bool:
        return _label(inst).split(":")[0] in KERNEL_TARGETS.values()

    def has_matmul(name: str) -> bool:
        if name not in matmul_memo:
            matmul_memo[name] = False  # guards cycles
            matmul_memo[name] = any(
                inst.opcode in ("dot", "convolution") or is_call(inst)
                or (inst.opcode == "custom-call" and bool(_MATMUL_TARGET_RE.search(
                    _label(inst)))) or any(map(has_matmul, _callees(inst)))
                for inst in computations.get(name, ()))
        return matmul_memo[name]

    def holds_kernel(name: str) -> bool:
        if name not in kernel_memo:
            kernel_memo[name] = False
            kernel_memo[name] = any(map(test, computations.get(name, ())))
        return kernel_memo[name]

    def test(inst: Instruction) -> bool:
        if is_call(inst):
            return True
        if inst.opcode == "while":
            return any(map(has_matmul, _callees(inst)))
        return inst.opcode in _COMPUTE and any(map(holds_kernel, _callees(inst)))

    return test


def _control_computations(computations, entry) -> list:
    """The entry and what it runs through loops, conditionals and calls, in text order
    (not fusion bodies or async wrappers: their collectives belong to the op calling them)."""
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for inst in computations[name]:
            if inst.opcode in ("while", "conditional", "call"):
                todo.extend(_callees(inst))
    return [name for name in computations if name in seen]


def _is_done(inst: Instruction, computations) -> bool:
    return inst.opcode.endswith("-done") or _fusion_marker(inst, computations) == "done"


def collective_schedule(compiled_or_text: Any, *, default_trip_count: int | None = None
                        ) -> list[ScheduledCollective]:
    """Every collective of a scheduled program, its bytes, and what hides it.

    The optimized HLO is printed in schedule order, so what runs between an
    asynchronous collective's start and its done is what the transfer overlaps. Three
    asynchronous forms are read: ``*-start`` / ``*-done`` pairs (and ``send`` /
    ``send-done``), ``async-start`` / ``async-done`` wrappers (XLA:GPU's all-to-all), and
    XLA:TPU's async collective fusions: a fusion holding an ``AsyncCollectiveStart``
    custom call starts the transfer, compute fusions that read it carry it on (their
    bodies hold the kernel and a copy of the collective) and a fusion holding
    ``AsyncCollectiveDone`` ends it. Every other collective is synchronous, including
    those XLA:TPU compiles without these options (all-to-all and all-gather by
    default, see :data:`jax_seqpar.tools.targets.COMPILE_OPTIONS`).

    Args:
      compiled_or_text: as in :func:`collective_bytes`.
      default_trip_count: as in :func:`collective_bytes`.

    Returns:
      :class:`ScheduledCollective` s, one per collective (a start/done pair is one),
      in text order; their ``total_bytes`` sum to the total of :func:`collective_bytes`.
    """
    program = _Program.of(compiled_or_text, default_trip_count)
    computations = program.computations
    is_kernel = _kernel_test(computations)
    control = _control_computations(computations, program.entry)
    rows, wrapped = [], set()
    for computation in control:
        instructions, runs = computations[computation], program.runs[computation]
        if runs == 0:
            continue
        index = {inst.name: i for i, inst in enumerate(instructions)}
        for i, inst in enumerate(instructions):
            marker = _fusion_marker(inst, computations)
            if _is_done(inst, computations) or inst.opcode == "recv":
                continue
            if inst.opcode == "async-start" or marker == "start":
                callees = _CALLS_RE.findall(inst.attributes)
                inner = [w for c in callees for w in computations.get(c, ()) if _is_collective(w)]
                if not inner:  # an asynchronous op that sends nothing
                    continue
                wrapped.update(callees)
                sent = [program.payload(w, computation) for w in inner]
                kind, per_run = sent[0][0], sum(b for _, b in sent)
            elif _is_collective(inst):
                kind, per_run = program.payload(inst, computation)
            else:
                continue
            is_async = inst.opcode.endswith("-start") or inst.opcode == "send" or bool(marker)
            between: list[Instruction] = []
            if is_async:
                if marker:
                    done = _async_fusion_done(instructions, i, computations, index)
                else:
                    done = next((j for j in range(i + 1, len(instructions))
                                 if instructions[j].operands[:1] == (inst.name,)
                                 and instructions[j].opcode.endswith("-done")), None)
                if done is not None:
                    between = instructions[i + 1:done]
                else:  # carried to the next trip of the loop: done at the body's head
                    form = "done" if marker else inst.opcode.replace("-start", "-done")
                    head = next((j for j in range(i) if form in (
                        instructions[j].opcode, _fusion_marker(instructions[j], computations))),
                        0)
                    between = instructions[i + 1:] + instructions[:head]
            compute = [b for b in between if b.opcode in _COMPUTE
                       and _fusion_marker(b, computations) is None]
            rows.append(ScheduledCollective(
                inst.name, kind, computation, runs, per_run, is_async,
                tuple(_label(b) for b in compute), any(map(is_kernel, compute))))
    # Collectives inside other computations (e.g. fused into a fusion): synchronous.
    skip = set(control) | wrapped | program.repeated
    for name, instructions in computations.items():
        if name in skip or program.runs[name] == 0:
            continue
        for inst in filter(_is_collective, instructions):
            kind, per_run = program.payload(inst, name)
            rows.append(ScheduledCollective(inst.name, kind, name, program.runs[name], per_run,
                                            False, (), False))
    return rows


def bytes_hidden(compiled_or_text: Any, *, default_trip_count: int | None = None
                 ) -> dict[str, float]:
    """How much of what a device sends is scheduled to hide behind a kernel.

    A collective's bytes are hidden when it is asynchronous and its start..done
    encloses a kernel: a Triton or Mosaic call, or the XLA kernel's loop over tiles
    (:func:`collective_schedule`). "Hidden" is about the schedule, not time: a
    transfer longer than the kernel it encloses still shows partly.

    Returns:
      ``{"hidden": bytes, "total": bytes, "fraction": hidden / total}`` one device
      sends per program run (``fraction`` 1.0 when nothing is sent).

    A ring's forward on 8 devices: 7 K/V hops; with every hop around a step's kernel,
    ``fraction`` is 1.0; its backward's last hop home (dK/dV, after the last kernel)
    cannot hide.
    """
    rows = collective_schedule(compiled_or_text, default_trip_count=default_trip_count)
    total = sum(r.total_bytes for r in rows)
    hidden = sum(r.total_bytes for r in rows if r.is_async and r.encloses_kernel)
    return dict(hidden=hidden, total=total, fraction=hidden / total if total else 1.0)


def memory_bytes(compiled: Any) -> dict[str, int]:
    """Per-device memory of a compiled program, from ``compiled.memory_analysis()``.

    Deterministic and machine-independent for a given backend, which makes it
    the memory measure tests rely on.

    Returns:
      ``{"temp", "argument", "output", "alias", "generated_code"}`` in bytes, plus
      ``"peak"`` where the backend reports it. ``temp`` is the scratch XLA
      allocates beyond inputs and outputs: the quantity that must grow like
      ``S/P`` for the ring.

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


def measure(fn: Callable, *args, **kwargs) -> Cost:
    """Jits, lowers and compiles ``fn(*args, **kwargs)`` and reads its :class:`Cost`.

    ``fn`` may already be jitted; ``args`` may be arrays or
    ``jax.ShapeDtypeStruct`` (with shardings), nothing is executed.

    >>> cost = measure(jax.shard_map(lambda x: jax.lax.psum(x, "sp"), mesh=mesh,
    ...                              in_specs=P("sp"), out_specs=P("sp")),
    ...                jnp.ones((64, 16)))
    >>> cost.collective_bytes["all-reduce"]  # 2 * 7/8 * 512
    896.0
    """
    import jax  # deferred: no work at import time

    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    return Cost(collective_bytes=collective_bytes(compiled), memory=memory_bytes(compiled))
