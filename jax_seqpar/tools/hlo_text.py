"""Parse XLA's optimized HLO text: computations, instructions, how often each runs.

The reading rules that turn this structure into bytes, memory and schedules live
in :mod:`jax_seqpar.tools.hlo`; this module only knows HLO's text syntax.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

__all__ = ["Instruction", "bodies", "callees", "multipliers", "parse_module",
           "shape_bytes", "split_top_level"]

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

_INDEX_RE = re.compile(r"\bindex=(\d+)")
_DIRECTION_RE = re.compile(r"\bdirection=(\w+)")
# Ops that hand their operand's value on unchanged (for following a loop counter).
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    is_root: bool = False


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


def split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
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


def _parse_instruction(line: str) -> Instruction | None:
    body = line.strip()
    is_root = body.startswith("ROOT ")
    if is_root:
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
    operands = tuple(op.split()[-1].lstrip("%") for op in split_top_level(operand_text))
    return Instruction(name.lstrip("%"), shape, opcode, operands, rest[after:], is_root)


def parse_module(text: str):
    """Splits HLO text into computations; returns (computations, entry name)."""
    computations: dict[str, list[Instruction]] = {}
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


def callees(inst: Instruction) -> list[tuple[str, str]]:
    """``(role, computation)`` for every computation ``inst`` calls, in text order by
    role: ``"body"`` / ``"condition"`` of a loop, ``"calls"`` (a fusion's or an async
    wrapper's body), ``"to_apply"``, ``"true_computation"`` / ``"false_computation"``, and
    ``"branch"`` for each of ``branch_computations`` / ``called_computations``."""
    found = _CALL_RE.findall(inst.attributes)
    for group in _CALL_LIST_RE.findall(inst.attributes):
        found += [("branch", c.lstrip("%")) for c in split_top_level(group)]
    return found


def bodies(inst: Instruction) -> list[str]:
    """The computations ``inst`` runs through ``calls=``: a fusion's, an async wrapper's."""
    return [callee for role, callee in callees(inst) if role == "calls"]


def multipliers(computations: Mapping[str, list[Instruction]], entry: str,
                default_trip_count: int | None):
    """How many times each computation runs per program execution (a ``while`` loop with
    no trip count XLA prints and no counted form: ``default_trip_count`` trips, or NaN
    for None)."""
    # Trip counts are ints, or NaN where unknown.
    callers: dict[str, list[tuple[str, float]]] = {name: [] for name in computations}
    for caller, instructions in computations.items():
        for inst in instructions:
            trip: float = 1  # only loops have a body and a condition
            if inst.opcode == "while":
                found = _TRIP_RE.search(inst.attributes)
                counted = (int(found.group(1)) if found
                           else _counted_loop_trips(inst, instructions, computations))
                if counted is not None:
                    trip = counted
                elif default_trip_count is not None:
                    trip = default_trip_count
                else:  # unknown: an error only if a collective runs inside
                    trip = math.nan
            for role, callee in callees(inst):
                factor = trip if role == "body" else (trip + 1 if role == "condition" else 1)
                if callee in callers:
                    callers[callee].append((caller, factor))
    memo: dict[str, float] = {entry: 1}

    def multiplier(name):
        if name not in memo:
            memo[name] = 0  # the call graph is a DAG; this only guards bad input
            memo[name] = sum(multiplier(caller) * factor for caller, factor in callers[name])
        return memo[name]

    return {name: multiplier(name) for name in computations}


def _defining(name: str, by_name: dict) -> Instruction | None:
    """The instruction that makes ``name``'s value, looking through copies and bitcasts."""
    inst = by_name.get(name)
    while inst is not None and inst.opcode in _PASS_THROUGH and inst.operands:
        inst = by_name.get(inst.operands[0])
    return inst


def _integer_constant(name: str, by_name: dict) -> int | None:
    inst = _defining(name, by_name)
    if inst is None or inst.opcode != "constant" or len(inst.operands) != 1:
        return None
    try:
        return int(inst.operands[0])
    except ValueError:
        return None


def _tuple_index(inst: Instruction | None) -> int | None:
    if inst is None or inst.opcode != "get-tuple-element":
        return None
    found = _INDEX_RE.search(inst.attributes)
    return int(found.group(1)) if found else None


def _counted_loop_trips(loop: Instruction, caller: list,
                        computations: Mapping[str, list[Instruction]]) -> int | None:
    """Trips of ``for (i = c0; i < n; i += step)`` loops, or None for any other loop.

    XLA:TPU prints no ``known_trip_count``; its scan and fori loops still have this
    shape: the condition compares tuple element ``k`` with a constant, the loop's
    initial tuple holds a constant there, and the body adds a constant to it.
    """
    roles: dict[str, str] = dict(_CALL_RE.findall(loop.attributes))
    # No computation is named "": a loop that names no condition or body is not counted.
    condition, body = (computations.get(roles.get(role, "")) for role in ("condition", "body"))
    if not condition or not body or len(loop.operands) != 1:
        return None
    in_condition = {i.name: i for i in condition}
    compare = next((i for i in condition if i.is_root), None)
    direction = _DIRECTION_RE.search(compare.attributes) if compare is not None else None
    if compare is None or compare.opcode != "compare" or direction is None:
        return None
    left, right = compare.operands
    op = direction.group(1)
    if _tuple_index(_defining(right, in_condition)) is not None:  # n > i is i < n
        left, right = right, left
        op = {"GT": "LT", "GE": "LE"}.get(op)
    index, limit = _tuple_index(_defining(left, in_condition)), _integer_constant(right, in_condition)
    if op not in ("LT", "LE") or index is None or limit is None:
        return None
    init = _defining(loop.operands[0], {i.name: i for i in caller})
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = _integer_constant(init.operands[index], {i.name: i for i in caller})
    in_body = {i.name: i for i in body}
    update = next((i for i in body if i.is_root), None)
    if start is None or update is None or update.opcode != "tuple":
        return None
    add = _defining(update.operands[index], in_body)
    if add is None or add.opcode != "add":
        return None
    step = [s for s in (_integer_constant(o, in_body) for o in add.operands) if s is not None]
    counter = [_tuple_index(_defining(o, in_body)) for o in add.operands]
    if len(step) != 1 or step[0] <= 0 or index not in counter:
        return None
    end = limit + 1 if op == "LE" else limit
    return max(0, -(-(end - start) // step[0]))
