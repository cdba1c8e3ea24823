"""Read the schedule of a compiled XLA program: which transfers hide behind a kernel.

The optimized HLO of ``jax.jit(f).lower(...).compile()`` is printed in schedule order
(``is_scheduled=true``), so what runs between an asynchronous collective's start and its
done is what the device computes while the transfer is in flight.
:func:`collective_schedule` lists every collective of a program (synchronous ones and
XLA:TPU's async collective fusions too) with its bytes (the rules of
:func:`jax_seqpar.tools.hlo.collective_bytes`) and whether a kernel runs inside its
transfer; :func:`bytes_hidden` sums it up: the share of the bytes a device sends that is
scheduled behind a kernel. CPU runs collectives synchronously: nothing hides there.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from jax_seqpar.tools.hlo import (COMPUTE_OPS, KERNEL_TARGETS, Program, async_fusion_done,
                                  device_groups, fusion_marker, is_collective, label)
from jax_seqpar.tools.hlo_text import Instruction, bodies, callees

__all__ = ["ScheduledCollective", "bytes_by_link", "bytes_hidden", "collective_schedule"]


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of a scheduled program: its bytes, and whether a kernel hides it.

    Attributes:
      name: the instruction that starts it (``*-start``, ``async-start``, ``send``,
        an XLA:TPU async collective fusion) or the synchronous collective itself.
      kind: one of :data:`jax_seqpar.tools.hlo.COLLECTIVE_KINDS`.
      computation: the computation holding it.
      runs: how many times it runs per program run (loop trips multiplied).
      bytes: bytes ONE device sends per run (the rules of
        :func:`jax_seqpar.tools.hlo.collective_bytes`).
      is_async: a start/done pair; a synchronous collective hides behind nothing.
      enclosed: labels of the compute scheduled between start and done, in order
        (``"triton:<kernel>"``, ``"mosaic:<kernel>"``, ``"fusion"``, ``"while"``, ...); for a
        pair whose done is in the next trip of a loop, the rest of the body after the start
        and the head of the body before the done.
      encloses_kernel: a kernel runs between start and done (see :func:`bytes_hidden`).
      groups: the devices that exchange data in it
        (:func:`jax_seqpar.tools.hlo.device_groups`), within one program (one slice's).
      between_slices: a transfer between TPU slices over DCN (XLA:TPU's multi-slice
        programs are compiled per slice and send to the other slices with ``send`` ops
        marked ``_xla_megascale_target``).
    """

    name: str
    kind: str
    computation: str
    runs: float
    bytes: float
    is_async: bool
    enclosed: tuple[str, ...]
    encloses_kernel: bool
    groups: tuple[tuple[int, ...], ...] = ()
    between_slices: bool = False

    @property
    def total_bytes(self) -> float:
        """Bytes one device sends in all its runs."""
        return self.runs * self.bytes


# The mark of XLA:TPU's transfers between slices (DCN).
_MEGASCALE = "_xla_megascale_target"
# Custom calls that are matrix products (cuBLAS / cuBLASLt on GPU).
_MATMUL_TARGET_RE = re.compile(r"gemm|matmul", re.IGNORECASE)


def _callees(inst: Instruction) -> list[str]:
    return [callee for _, callee in callees(inst)]


def _kernel_test(computations) -> Callable[[Instruction], bool]:
    """``test(inst)``: whether ``inst`` is or runs a kernel: a Triton / Mosaic call; a
    ``while`` loop whose body holds one or a matrix product (the XLA kernel's loop over
    tiles); or a fusion, call or conditional whose computations hold one of those."""
    matmul_memo: dict[str, bool] = {}
    kernel_memo: dict[str, bool] = {}

    def is_call(inst: Instruction) -> bool:
        return label(inst).split(":")[0] in KERNEL_TARGETS.values()

    def has_matmul(name: str) -> bool:
        if name not in matmul_memo:
            matmul_memo[name] = False  # guards cycles
            matmul_memo[name] = any(
                inst.opcode in ("dot", "convolution") or is_call(inst)
                or (inst.opcode == "custom-call" and bool(_MATMUL_TARGET_RE.search(
                    label(inst)))) or any(map(has_matmul, _callees(inst)))
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
        return inst.opcode in COMPUTE_OPS and any(map(holds_kernel, _callees(inst)))

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
    return inst.opcode.endswith("-done") or fusion_marker(inst, computations) == "done"


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
      compiled_or_text: as in :func:`jax_seqpar.tools.hlo.collective_bytes`.
      default_trip_count: as in :func:`jax_seqpar.tools.hlo.collective_bytes`.

    Returns:
      :class:`ScheduledCollective` s, one per collective (a start/done pair is one),
      in text order; their ``total_bytes`` sum to the total of
      :func:`jax_seqpar.tools.hlo.collective_bytes`.
    """
    program = Program.of(compiled_or_text, default_trip_count)
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
            marker = fusion_marker(inst, computations)
            if _is_done(inst, computations) or inst.opcode == "recv":
                continue
            if inst.opcode == "async-start" or marker == "start":
                called = bodies(inst)
                inner = [w for c in called for w in computations.get(c, ()) if is_collective(w)]
                if not inner:  # an asynchronous op that sends nothing
                    continue
                wrapped.update(called)
                sent = [program.payload(w, computation) for w in inner]
                kind, per_run = sent[0][0], sum(b for _, b in sent)
                groups = device_groups(inner[0], program.num_devices)
                dcn = _MEGASCALE in inner[0].attributes
            elif is_collective(inst):
                kind, per_run = program.payload(inst, computation)
                groups = device_groups(inst, program.num_devices)
                dcn = _MEGASCALE in inst.attributes
            else:
                continue
            is_async = inst.opcode.endswith("-start") or inst.opcode == "send" or bool(marker)
            between: list[Instruction] = []
            if is_async:
                if marker:
                    done = async_fusion_done(instructions, i, computations, index)
                else:
                    done = next((j for j in range(i + 1, len(instructions))
                                 if instructions[j].operands[:1] == (inst.name,)
                                 and instructions[j].opcode.endswith("-done")), None)
                if done is not None:
                    between = instructions[i + 1:done]
                else:  # carried to the next trip of the loop: done at the body's head
                    form = "done" if marker else inst.opcode.replace("-start", "-done")
                    head = next((j for j in range(i) if form in (
                        instructions[j].opcode, fusion_marker(instructions[j], computations))),
                        0)
                    between = instructions[i + 1:] + instructions[:head]
            compute = [b for b in between if b.opcode in COMPUTE_OPS
                       and fusion_marker(b, computations) is None]
            rows.append(ScheduledCollective(
                inst.name, kind, computation, runs, per_run, is_async,
                tuple(label(b) for b in compute), any(map(is_kernel, compute)), groups, dcn))
    # Collectives inside other computations (e.g. fused into a fusion): synchronous.
    skip = set(control) | wrapped | program.repeated
    for name, instructions in computations.items():
        if name in skip or program.runs[name] == 0:
            continue
        for inst in filter(is_collective, instructions):
            kind, per_run = program.payload(inst, name)
            rows.append(ScheduledCollective(inst.name, kind, name, program.runs[name], per_run,
                                            False, (), False,
                                            device_groups(inst, program.num_devices),
                                            _MEGASCALE in inst.attributes))
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


def bytes_by_link(compiled_or_text: Any, domain_size: int, *,
                  default_trip_count: int | None = None) -> dict[str, dict[str, float]]:
    """What a device sends over the fast links and over the slow ones, and what hides.

    A mesh's devices (the program's partition ids, in the mesh's device order) fall into
    domains of ``domain_size`` consecutive devices: a host's GPUs (NVLink inside, the
    network across) or a TPU slice (ICI inside, DCN across;
    :func:`jax_seqpar.tools.targets.domains`). A collective is *across* when one of its
    groups (or a permute's pair) holds devices of two domains, or it is a transfer
    between TPU slices (a multi-slice program is one slice's), else *within*.

    Returns:
      ``{"within": {...}, "across": {...}}``, each ``{"hidden": bytes, "total": bytes,
      "fraction": hidden / total}`` one device sends per program run (the rules of
      :func:`bytes_hidden`).
    """
    rows = collective_schedule(compiled_or_text, default_trip_count=default_trip_count)
    links = {link: dict(hidden=0.0, total=0.0) for link in ("within", "across")}
    for row in rows:
        spans = row.between_slices or any(
            len({device // domain_size for device in group}) > 1 for group in row.groups)
        link = links["across" if spans else "within"]
        link["total"] += row.total_bytes
        link["hidden"] += row.total_bytes if row.is_async and row.encloses_kernel else 0.0
    for link in links.values():
        link["fraction"] = link["hidden"] / link["total"] if link["total"] else 1.0
    return links
