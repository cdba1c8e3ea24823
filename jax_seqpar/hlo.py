"""Read a compiled XLA program: bytes each device sends, and memory it needs.

This is the one place that measures what a program really does. Tests hold
:func:`jax_seqpar.plan.comm_bytes` against :func:`collective_bytes`, the CLI
bench and the notebooks report both, so the counting rules live here only.

Counting rules (those of ``plan.comm_bytes``), bytes ONE device sends over a group of ``P``
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
multiplier is the loop's ``known_trip_count`` (from its ``backend_config``)
times the multiplier of the computation that holds the loop, so nested loops
multiply. Each branch of a ``conditional`` counts as if it ran once (an upper
bound when branches differ).

Known honest limits:

* The XLA **CPU** backend promotes bf16/f16 collectives to f32 (the operand is
  a ``convert`` fusion and the reduction region is ``*_promoted``), so a bf16
  program on CPU sends 4 bytes per element here; GPU and TPU keep bf16. Compare
  against :func:`jax_seqpar.plan.comm_bytes` with ``dtype_bytes=4`` on CPU.
* ``ragged-all-to-all`` and ``collective-broadcast`` are rejected with a
  ``ValueError`` rather than guessed (their volume is data-dependent or not
  covered by the counting rules above).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping

__all__ = ["COLLECTIVE_KINDS", "Cost", "collective_bytes", "memory_bytes", "measure"]

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

# Bits per element of every HLO primitive type that can appear in a shape.
_ELEMENT_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8,
    "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
    "token": 0,
}
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALL_RE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_LIST_RE = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_EXPLICIT_GROUPS_RE = re.compile(r"replica_groups=\{(\{[\d,\s]*\}(?:\s*,\s*\{[\d,\s]*\})*)?\}")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[")
_PARTITIONS_RE = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS_RE = re.compile(r"\breplica_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string; tuples are summed, layouts ignored.

    >>> shape_bytes("(f32[8,2]{1,0}, bf16[4]{0}, s32[])")
    76.0
    """
    total_bits = 0
    for element_type, dims in _ARRAY_RE.findall(shape):
        if element_type not in _ELEMENT_BITS:
            raise ValueError(f"unknown HLO element type {element_type!r} in shape {shape!r}")
        count = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        total_bits += _ELEMENT_BITS[element_type] * count
    return total_bits / 8


def _split_balanced(text: str, start: int) -> tuple[str, int]:
    """Returns the text inside the bracket opening at ``start`` and the index after it."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch in pairs:
            depth += 1
        elif ch in pairs.values():
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in HLO line: {text!r}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if current:
        parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _parse_instruction(line: str) -> _Instruction | None:
    body = line.strip()
    if body.startswith("ROOT "):
        body = body[5:]
    if " = " not in body or not body.startswith("%") and not re.match(r"[\w.\-]+ = ", body):
        return None
    name, rest = body.split(" = ", 1)
    rest = re.sub(r"/\*.*?\*/", "", rest).lstrip()
    if rest.startswith("("):
        _, end = _split_balanced(rest, 0)
        shape = rest[:end]
    else:
        end = rest.find(" ")
        shape = rest[:end]
    rest = rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren].strip()
    operand_text, after = _split_balanced(rest, paren)
    operands = tuple(op.split()[-1].lstrip("%") for op in _split_top_level(operand_text))
    return _Instruction(name.lstrip("%"), shape, opcode, operands, rest[after:])


def _parse_module(text: str):
    """Splits HLO text into computations; returns (computations, entry name)."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER_RE.match(line)
        if header and " = " not in line.split("(", 1)[0]:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            computations[current].append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation found: pass compiled HLO text "
                         "(jax.jit(f).lower(...).compile().as_text()), not StableHLO")
    return computations, entry


def _multipliers(computations, entry, default_trip_count):
    """How many times each computation runs per program execution."""
    callers: dict[str, list[tuple[str, int]]] = {name: [] for name in computations}
    for caller, instructions in computations.items():
        for inst in instructions:
            trip = None
            if inst.opcode == "while":
                found = _TRIP_RE.search(inst.attributes)
                if found:
                    trip = int(found.group(1))
                elif default_trip_count is not None:
                    trip = default_trip_count
                else:  # unknown: an error only if a collective runs inside (see below)
                    trip = math.nan
            for role, callee in _CALL_RE.findall(inst.attributes):
                factor = trip if role == "body" else (trip + 1 if role == "condition" else 1)
                if callee in callers:
                    callers[callee].append((caller, factor))
            for group in _CALL_LIST_RE.findall(inst.attributes):
                for callee in _split_top_level(group):
                    callee = callee.lstrip("%")
                    if callee in callers:
                        callers[callee].append((caller, 1))
    memo: dict[str, int] = {entry: 1}

    def multiplier(name):
        if name not in memo:
            memo[name] = 0  # the call graph is a DAG; this only guards bad input
            memo[name] = sum(multiplier(caller) * factor for caller, factor in callers[name])
        return memo[name]

    return {name: multiplier(name) for name in computations}


def _group_size(inst: _Instruction, num_devices: int) -> int:
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
    text = _as_text(compiled_or_text)
    computations, entry = _parse_module(text)
    partitions = _PARTITIONS_RE.search(text)
    replicas = _REPLICAS_RE.search(text)
    num_devices = (int(partitions.group(1)) if partitions else 1) * (
        int(replicas.group(1)) if replicas else 1)
    multipliers = _multipliers(computations, entry, default_trip_count)
    shapes = {inst.name: inst.shape for insts in computations.values() for inst in insts}
    totals = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    for name, instructions in computations.items():
        if multipliers[name] == 0:
            continue
        for inst in instructions:
            if inst.opcode in _UNSUPPORTED:
                raise ValueError(f"%{inst.name} is a {inst.opcode}, whose traffic is not "
                                 "modelled by collective_bytes")
            if inst.opcode not in _OPCODES:
                continue
            if math.isnan(multipliers[name]):
                raise ValueError(
                    f"%{inst.name} runs inside a while loop with no known_trip_count in its "
                    "backend_config; pass default_trip_count=<iterations> to count it")
            kind, factor = _OPCODES[inst.opcode]
            operands = inst.operands
            if inst.opcode == "send" or "slice_sizes=" in inst.attributes:
                operands = operands[:1]  # token / in-place offsets are not payload
            payload = sum(shape_bytes(shapes[op]) for op in operands)
            totals[kind] += multipliers[name] * factor(_group_size(inst, num_devices)) * payload
    return totals


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
