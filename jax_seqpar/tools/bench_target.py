"""Compile, without running, every strategy for a GPU or TPU target; and the longest S it fits.

:func:`run_target` compiles each applicable (seq_len, mesh, strategy) forward and
forward + vjp (the programs of :func:`jax_seqpar.tools.bench.build`) for a target of
:mod:`jax_seqpar.tools.targets` and reads, per device: ``memory_analysis`` (temp,
arguments, outputs), the bytes each collective kind sends (:mod:`jax_seqpar.tools.hlo`)
next to :func:`jax_seqpar.comm_bytes`, whether each asynchronous collective's
start/done pair encloses compute in the schedule (overlap) and the share of the bytes
sent behind a kernel (:func:`jax_seqpar.tools.schedule.bytes_hidden`), the Triton kernels'
registers, spills and shared memory (GPU), and compile time.

:func:`run_max_seq` finds the longest sequence each strategy fits in a device's
HBM less a reserve, by bisection on the compiled footprint (temp + arguments +
outputs - aliased bytes).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Optional, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar.core.shape import LayerShape
from jax_seqpar.tools import aot, bench, hlo, schedule, targets
from jax_seqpar.strategies.registry import comm_bytes
from jax_seqpar.kernels import KernelName
from jax_seqpar.strategies.registry import StrategyName

__all__ = ["DEFAULT_RESERVE", "MAX_SEQ_TOLERANCE", "PIPELINED", "compile_strategy",
           "footprint_bytes", "max_seq", "run_max_seq", "run_target"]

#: The strategies whose exchange pipelines behind their kernels (``overlap=``): the bench
#: compiles them with ``overlap=False`` as well.
PIPELINED = ("ulysses", "hybrid")
#: Share of a device's HBM kept for the runtime, collectives' buffers and the rest of
#: the model: a program fits when its footprint is at most ``(1 - reserve) * HBM``.
DEFAULT_RESERVE = 0.1
#: Bisection stops when the bracket is this fraction of the longest length that fits.
MAX_SEQ_TOLERANCE = 1 / 32


def default_meshes(num_devices: int) -> list[dict]:
    """One axis of every device, and ``dcn=2, ici=N/2`` for the hybrid (N even, N >= 4)."""
    meshes = [{"sp": num_devices}]
    if num_devices >= 4 and num_devices % 2 == 0:
        meshes.append({"dcn": 2, "ici": num_devices // 2})
    return meshes


def compile_strategy(target: str, case: bench.Case, *, backward: Optional[bool] = None,
                     fail_on_spills: bool = False, kernel_resources: bool = False):
    """``{"fwd": aot.Compiled, "fwd_bwd": aot.Compiled}`` of ``case`` on ``target``.

    ``case.axes`` is ``{name: size}`` (outer first; product: the target's devices);
    ``backward``: only the forward (False), only forward + vjp (True), or both (None).
    Compiled with the strategy's :func:`jax_seqpar.tools.targets.compile_options`.
    """
    axes = case.axes
    mesh = targets.target_mesh(target, tuple(axes), tuple(axes.values()))
    forward, forward_and_vjp = bench.build(case, mesh)
    sharding = NamedSharding(mesh, P(None, tuple(axes)))
    args = [jax.ShapeDtypeStruct(size, case.shape.dtype, sharding=sharding)
            for size in case.shape.operand_shapes()]
    platform = targets.target_platform(target)
    def compiled(fn, operands):
        return aot.compile_for(fn, operands, platform, fail_on_spills=fail_on_spills,
                               kernel_resources=kernel_resources,
                               compiler_options=targets.compile_options(platform, case.strategy))

    programs = {}
    if backward is not True:
        programs["fwd"] = compiled(forward, args[:3])
    if backward is not False:
        programs["fwd_bwd"] = compiled(forward_and_vjp, args)
    return programs


def footprint_bytes(compiled: jax.stages.Compiled) -> int:
    """Device memory a program needs: temp + arguments + outputs - aliased."""
    memory = hlo.memory_bytes(compiled)
    return memory["temp"] + memory["argument"] + memory["output"] - memory["alias"]


def _model(strategy: StrategyName, axes: dict, shape: LayerShape, backward: bool) -> float:
    sizes = tuple(axes.values())
    return comm_bytes(strategy, axis_sizes=sizes if strategy == "hybrid" else math.prod(sizes),
                      **shape.replace(backward=backward).comm_kwargs())


def measure_program(program: aot.Compiled, model_bytes: float) -> dict:
    """Everything :func:`run_target` reports about one compiled program."""
    compiled = program.compiled
    memory = hlo.memory_bytes(compiled)
    sent = {k: v for k, v in hlo.collective_bytes(compiled).items() if v}
    overlap = [dict(kind=r.kind, runs=r.runs, enclosed=list(r.enclosed),
                    encloses_kernel=r.encloses_kernel)
               for r in schedule.collective_schedule(compiled) if r.is_async]
    hidden = schedule.bytes_hidden(compiled)
    return dict(compile_s=program.seconds, temp_bytes=memory["temp"],
                hidden_bytes=hidden["hidden"], hidden_fraction=hidden["fraction"],
                argument_bytes=memory["argument"], output_bytes=memory["output"],
                footprint_bytes=footprint_bytes(compiled), hlo_bytes=sent,
                hlo_total_bytes=sum(sent.values()), model_bytes=model_bytes, overlap=overlap,
                kernel_calls=hlo.kernel_calls(compiled),
                kernels=None if program.kernels is None else {
                    name: dataclasses.asdict(r) for name, r in program.kernels.items()})


def _check_meshes(target: str, meshes) -> None:
    """``ValueError`` unless every mesh spans all of ``target``'s devices."""
    devices = targets.parse(target).num_devices
    for axes in meshes:
        if math.prod(axes.values()) != devices:
            raise ValueError(f"mesh {bench.mesh_label(axes)} has {math.prod(axes.values())} "
                             f"devices but target {target!r} has {devices}.")


def run_target(shape: LayerShape, target: str, meshes: Optional[Sequence] = None, *,
               seq_lens: Optional[Sequence[int]] = None,
               strategies: Sequence[StrategyName] = bench.STRATEGIES, kernel: KernelName = "auto",
               progress: bool = True) -> dict:
    """Compiles (runs nothing) every applicable (seq_len, mesh, strategy) for ``target``.

    Args:
      shape: the layer; ``seq_lens`` (if given) sweeps its ``seq_len``.
      target: a name of :mod:`jax_seqpar.tools.targets` (``"h100:8"``, ``"v5p:2x2x2"``, ...).
      meshes: ``"sp=8"`` strings or ``{name: size}`` dicts over all the target's
        devices (default ``default_meshes``).
      strategies, kernel: what to compile (``kernel="auto"``: Triton on GPU).

    Returns:
      ``{"target", "platform", "shape", "rows", "skipped", "plans", "notes"}``; each
      row has ``seq_len, mesh, strategy, kernel, layout, planned`` and ``fwd`` /
      ``fwd_bwd``: the dicts of ``measure_program``.
    """
    from tqdm.auto import tqdm

    parsed = targets.parse(target)
    meshes = [bench.parse_mesh(m) if isinstance(m, str) else dict(m)
              for m in meshes or default_meshes(parsed.num_devices)]
    shapes = [shape.replace(seq_len=int(s)) for s in seq_lens or [shape.seq_len]]
    _check_meshes(target, meshes)
    todo, skipped, plans = bench.configurations(shapes, meshes, strategies, [kernel])
    rows = []
    # The strategies that pipeline their exchange are also compiled with overlap=False
    # (each exchange whole): the hidden share and temp memory of both, side by side.
    todo = [(each, chosen) for case, chosen in todo for each in (
        [case, dataclasses.replace(case, overlap=False)]
        if case.strategy in PIPELINED else [case])]
    for case, chosen in tqdm(todo, desc=f"compile for {target}", disable=not progress,
                             file=sys.stderr):
        programs = compile_strategy(target, case, kernel_resources=parsed.platform == "cuda")
        shape_, axes, strategy = case.shape, case.axes, case.strategy
        rows.append(dict(
            seq_len=shape_.seq_len, mesh=bench.mesh_label(axes), strategy=strategy,
            kernel=case.kernel, layout=bench.layout_for(strategy, shape_),
            planned=strategy == chosen and case.overlap == "auto", overlap=case.overlap,
            **{mode: measure_program(program, _model(strategy, axes, shape_, mode != "fwd"))
               for mode, program in programs.items()}))
    return dict(target=target, platform=parsed.platform, shape=dataclasses.asdict(shape),
                rows=rows, skipped=skipped, plans=plans, notes=_notes(parsed, todo))


def _notes(parsed: targets.Target, todo) -> list[str]:
    notes = [f"compiled for {parsed.name}, not run: memory is XLA's memory_analysis per "
             "device, bytes are read from the compiled HLO."]
    if parsed.platform == "tpu" and any(case.kernel == "auto" for case, _ in todo):
        notes.append("kernel=auto lowers to the Mosaic kernel on TPU (the XLA kernel for "
                     "float16).")
    return notes


def _longest_fitting(fits, granule: int, start: int, limit: int) -> int:
    """Largest multiple of ``granule`` up to ``limit`` that ``fits`` (0 if none), assuming
    that what fits at a length fits at every shorter one: doubling, then bisection."""
    low, high, length = 0, None, max(granule, start // granule * granule)
    while length <= limit:
        if not fits(length):
            high = length
            break
        low, length = length, 2 * length
    if high is None:
        return low
    while high - low > max(granule, low * MAX_SEQ_TOLERANCE):
        middle = (low + high) // 2 // granule * granule
        if middle <= low:
            break
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def max_seq(target: str, case: bench.Case, *, backward: bool,
            reserve: float = DEFAULT_RESERVE, limit: int = 2**24) -> dict:
    """The longest sequence ``case`` (its strategy, mesh, kernel and layer, at any length)
    fits on ``target``, by compiling and bisecting.

    A length fits when :func:`footprint_bytes` of the compiled forward (or forward
    + vjp with ``backward``) is at most ``(1 - reserve)`` of a device's HBM (a
    compiler that refuses the program for lack of memory, as XLA:TPU does, means
    it does not fit).
    Lengths are multiples of ``2 * devices * 128`` (whole zigzag half-shards of 128
    tokens); the search stops within :data:`MAX_SEQ_TOLERANCE` of the answer.

    Returns:
      ``{"max_seq", "footprint_bytes", "budget_bytes", "compiles"}`` (``max_seq`` 0
      when even the smallest length does not fit).
    """
    parsed = targets.parse(target)
    if parsed.hbm_bytes is None:
        raise ValueError(f"target {target!r} has no known device memory; --max-seq needs a "
                         "GPU or TPU target.")
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve={reserve} must be a fraction in [0, 1).")
    budget = (1 - reserve) * parsed.hbm_bytes
    granule = 2 * math.prod(case.axes.values()) * 128
    mode = "fwd_bwd" if backward else "fwd"
    footprints: dict[int, Optional[int]] = {}  # None: over the device's memory

    def fits(seq_len):
        sized = dataclasses.replace(case, shape=case.shape.replace(seq_len=seq_len))
        try:
            program = compile_strategy(target, sized, backward=backward)
        except jax.errors.JaxRuntimeError as error:  # XLA:TPU refuses programs over HBM
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            footprints[seq_len] = None
            return False
        footprint = footprint_bytes(program[mode].compiled)
        footprints[seq_len] = footprint
        return footprint <= budget

    best = _longest_fitting(fits, granule, case.shape.seq_len, limit)
    return dict(max_seq=best, footprint_bytes=footprints.get(best), budget_bytes=budget,
                compiles=len(footprints))


def run_max_seq(shape: LayerShape, target: str, meshes: Optional[Sequence] = None, *,
                strategies: Sequence[StrategyName] = bench.STRATEGIES, kernel: KernelName = "auto",
                reserve: float = DEFAULT_RESERVE, progress: bool = True) -> dict:
    """:func:`max_seq` forward and forward + backward for every applicable strategy."""
    from tqdm.auto import tqdm

    parsed = targets.parse(target)
    meshes = [bench.parse_mesh(m) if isinstance(m, str) else dict(m)
              for m in meshes or default_meshes(parsed.num_devices)]
    _check_meshes(target, meshes)
    todo, skipped, _ = bench.configurations([shape], meshes, strategies, [kernel])
    rows = []
    for case, _ in tqdm(todo, desc=f"max seq on {target}", disable=not progress,
                        file=sys.stderr):
        row = dict(mesh=bench.mesh_label(case.axes), strategy=case.strategy, kernel=case.kernel)
        for mode, backward in (("fwd", False), ("fwd_bwd", True)):
            row[mode] = max_seq(target, case, backward=backward, reserve=reserve)
        rows.append(row)
    return dict(target=target, platform=parsed.platform, shape=dataclasses.asdict(shape),
                hbm_bytes=parsed.hbm_bytes, reserve=reserve, rows=rows, skipped=skipped,
                notes=_notes(parsed, todo))
