"""Benchmark every sequence-parallel strategy on one shape over one or more meshes.

Each applicable (seq_len, mesh, kernel, strategy) is compiled as a per-shard
function in ``jax.shard_map``, forward and forward + vjp, with its tokens already
in the strategy's layout (zigzag for causal ring / hybrid / all-gather, as a model
applying its layout once to its inputs runs it), timed (median of ``runs`` after
``warmup``) and read by :mod:`jax_seqpar.tools.hlo`: per-device ``temp`` memory and
bytes sent, the latter next to :func:`jax_seqpar.comm_bytes`. Outputs (and
gradients, at small sizes) are checked against :mod:`jax_seqpar.core.reference`, and
:func:`jax_seqpar.planning.plan.plan`'s choice is given per mesh. Ulysses, ring and
all-gather use one axis (or two flattened); the hybrid two, ``outer,inner``.

The layer is a :class:`~jax_seqpar.core.shape.LayerShape` (its ``dtype`` one of
``DTYPES``; full or causal masks). The command line (``jax-seqpar bench``), the
table and the plot live in :mod:`jax_seqpar.tools.bench_report`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import sys
import time
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_seqpar.api import program as api
from jax_seqpar.tools import hlo
from jax_seqpar.core import layout, reference
from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import plan
from jax_seqpar import kernels
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.registry import comm_bytes
from jax_seqpar.kernels import KernelName
from jax_seqpar.strategies.registry import StrategyName

__all__ = ["Case", "DEFAULT_MESHES", "DEFAULT_SHAPE", "DTYPES", "KERNELS", "MIB",
           "STRATEGIES", "build", "compile_strategy", "configurations", "costs",
           "layout_for", "median_ms", "mesh_label", "parse_mesh", "run"]

STRATEGIES = tuple(registry.STRATEGIES)
KERNELS = kernels.KERNELS
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MESHES = ("sp=8", "dcn=2,ici=4")
#: What ``jax-seqpar bench`` runs without options.
DEFAULT_SHAPE = LayerShape(batch=1, seq_len=4096, num_heads=8, num_kv_heads=2, head_dim=64,
                           dtype="float32", causal=True)
#: B*H*S*S above which only the output is checked (in query blocks), not gradients.
REFERENCE_GRAD_LIMIT = 2**24
MIB = 2.0**20


def parse_mesh(text: str) -> dict:
    """``"sp=8"`` -> ``{"sp": 8}``; ``"dcn=2,ici=4"`` -> ``{"dcn": 2, "ici": 4}`` (outer first)."""
    axes = {}
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        if not name or not size.isdigit() or int(size) < 1 or name in axes:
            raise ValueError(f"mesh {text!r} must be distinct name=size pairs with positive "
                             f"sizes, e.g. 'sp=8' or 'dcn=2,ici=4'.")
        axes[name] = int(size)
    if len(axes) > 2:
        raise ValueError(f"mesh {text!r} has {len(axes)} axes; give one (sp=8) or two "
                         f"(dcn=2,ici=4, outer first).")
    return axes


def mesh_label(axes: Mapping[str, int]) -> str:
    return ",".join(f"{name}={size}" for name, size in axes.items())


def skip_reason(strategy: StrategyName, axes: Mapping[str, int], shape: LayerShape,
                one_axis_sizes: Sequence[int] = ()) -> Optional[str]:
    """Why ``strategy`` cannot (or need not) run on ``axes``, or None if it runs."""
    sizes = tuple(axes.values())
    devices = math.prod(sizes)
    if strategy == "hybrid" and len(sizes) != 2:
        return (f"hybrid needs a two-axis mesh outer,inner (ring over outer, ulysses over "
                f"inner); got {mesh_label(axes)}. Use e.g. --mesh dcn=2,ici={devices // 2}")
    if strategy != "hybrid" and len(sizes) == 2 and devices in one_axis_sizes:
        return f"over the flattened axes it is the {devices}-device one-axis run above"
    try:
        comm_bytes(strategy, axis_sizes=sizes if strategy == "hybrid" else devices,
                   **shape.comm_kwargs())
    except ValueError as error:
        return str(error)
    if layout_for(strategy, shape) == "zigzag" and shape.seq_len % (2 * devices):
        return (f"seq_len={shape.seq_len} is not divisible by 2*{devices}={2 * devices} "
                f"zigzag half-shards; use a multiple of {2 * devices}")
    return None


def layout_for(strategy: StrategyName, shape: LayerShape) -> layout.LayoutName:
    """The token order the strategy runs ``shape`` in (zigzag for causal rings)."""
    return registry.default_layout(strategy, MaskSpec(causal=shape.causal))


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration the bench compiles: a strategy over mesh ``axes`` (``{name:
    size}``, outer first) on a layer ``shape`` with a ``kernel`` (a name of
    :data:`~jax_seqpar.kernels.options.KERNELS`); ``overlap``: the strategy's own pipelining
    (``"auto"``), or False for Ulysses' and the hybrid's exchanges sent whole."""

    strategy: StrategyName
    axes: Mapping[str, int]
    shape: LayerShape
    kernel: KernelName = "xla"
    overlap: Union[bool, Literal["auto"]] = "auto"


def build(case: Case, mesh: jax.sharding.Mesh):
    """``(forward, forward_and_vjp)`` on global arrays already in the strategy's layout.

    ``forward(q, k, v) -> out [B, S, H, Dv]``; ``forward_and_vjp(q, k, v, dout) ->
    (out, (dq, dk, dv))``; all sequence-sharded over every axis of ``mesh``.
    """
    axes = tuple(mesh.axis_names)
    axis_name = api.axis_name_of(axes)
    attend = functools.partial(registry.get(case.strategy).attention, seq_axes=axis_name)
    order = layout_for(case.strategy, case.shape)

    def body(q, k, v):  # [B, S/P, H, D] each
        positions = layout.shard_positions(order, q.shape[1], axis_name=axis_name)  # [S/P]
        positions = jnp.broadcast_to(positions, q.shape[:2])  # [B, S/P]
        pipeline = {} if case.overlap == "auto" else dict(overlap=case.overlap)
        return attend(q, k, v, causal=case.shape.causal, positions=positions,
                      kernel=case.kernel, **pipeline)

    forward = jax.shard_map(body, mesh=mesh, in_specs=(P(None, axis_name),) * 3,
                            out_specs=P(None, axis_name),
                            check_vma=api.can_check_vma(case.kernel))

    def forward_and_vjp(q, k, v, dout):  # a given cotangent: no loss reduction in the program
        out, vjp = jax.vjp(forward, q, k, v)
        return out, vjp(dout)

    return forward, forward_and_vjp


def compile_strategy(case: Case):
    """Compiles without running: ``(mesh, compiled_forward, compiled_forward_and_vjp)``,
    over the first devices of ``jax.devices()``."""
    axes = case.axes
    devices = np.array(jax.devices()[:math.prod(axes.values())])
    mesh = Mesh(devices.reshape(tuple(axes.values())), tuple(axes))
    sharding = NamedSharding(mesh, P(None, tuple(axes)))
    forward, forward_and_vjp = build(case, mesh)
    args = [jax.ShapeDtypeStruct(size, case.shape.dtype, sharding=sharding)
            for size in case.shape.operand_shapes()]
    return (mesh, jax.jit(forward).lower(*args[:3]).compile(),
            jax.jit(forward_and_vjp).lower(*args).compile())


def costs(strategy: StrategyName, axes: dict, shape: LayerShape,
          compiled: Sequence[jax.stages.Compiled] | None = None) -> dict:
    """``{temp, hlo, model}_{fwd, fwd_bwd}_bytes`` per device: ``memory_analysis`` temp,
    bytes sent read from the compiled HLO, and :func:`jax_seqpar.comm_bytes`.

    ``compiled``: the programs of :func:`compile_strategy` (compiled here if None).
    On CPU the model counts 16-bit elements as 4 bytes, as XLA:CPU sends them.
    """
    fwd, fwd_bwd = compiled or compile_strategy(Case(strategy, axes, shape))[1:]
    if jax.default_backend() == "cpu" and shape.dtype_bytes < 4:
        shape = shape.replace(dtype="float32")  # what goes on XLA:CPU's wire
    sizes = tuple(axes.values())
    axis_sizes = sizes if strategy == "hybrid" else math.prod(sizes)
    return dict(temp_fwd_bytes=hlo.memory_bytes(fwd)["temp"],
                temp_fwd_bwd_bytes=hlo.memory_bytes(fwd_bwd)["temp"],
                hlo_fwd_bytes=_bytes_sent(fwd), hlo_fwd_bwd_bytes=_bytes_sent(fwd_bwd),
                **{f"model_{mode}_bytes": comm_bytes(strategy, axis_sizes=axis_sizes,
                                                     **shape.replace(backward=backward)
                                                     .comm_kwargs())
                   for mode, backward in (("fwd", False), ("fwd_bwd", True))})


def _bytes_sent(compiled) -> float:
    return sum(hlo.collective_bytes(compiled).values())


def _reference(shape: LayerShape, q, k, v, dout):
    """``(out, grads or None)`` of :mod:`jax_seqpar.core.reference`; the output in query blocks."""
    b, s, h = shape.batch, shape.seq_len, shape.num_heads
    attend = lambda q, k, v, **kw: reference.attention(q, k, v, causal=shape.causal, **kw)
    if b * h * s * s <= REFERENCE_GRAD_LIMIT:
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(dout)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    chunk = jax.jit(lambda q, k, v, at: attend(q, k, v, positions=at, kv_positions=positions))
    rows = max(1, 2**23 // (b * h * s))  # 32 MiB of float32 scores per chunk
    out = [chunk(q[:, i:i + rows], k, v, positions[:, i:i + rows]) for i in range(0, s, rows)]
    return jnp.concatenate(out, axis=1), None


def _max_error(actual, expected) -> float:
    return float(np.max(np.abs(np.asarray(actual, np.float32) - np.asarray(expected, np.float32))))


def median_ms(compiled: jax.stages.Compiled, args: Any, warmup: int, runs: int):
    """``(median milliseconds of runs calls after warmup calls, the last result)``."""
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(max(1, runs)):
        start = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, result


def configurations(shapes: Sequence[LayerShape], meshes: Sequence[Mapping[str, int]],
                   strategies: Sequence[StrategyName], kernels: Sequence[KernelName]):
    """``(todo, skipped, plans)``: what runs (``(Case, planned strategy)`` pairs), what
    cannot (and why), plan's choices."""
    for name, given, known in (("strategy", strategies, STRATEGIES), ("kernel", kernels, KERNELS)):
        if not given or set(given) - set(known):
            raise ValueError(f"{name} names must be some of {known}. Got {list(given)}.")
    one_axis = [math.prod(m.values()) for m in meshes if len(m) == 1]
    todo, skipped, plans = [], [], []
    for shape in shapes:
        if shape.dtype not in DTYPES:
            raise ValueError(f"the bench runs dtype one of {DTYPES}; got {shape.dtype!r}.")
        if shape.window is not None or shape.segment_ids:
            raise ValueError(f"the bench runs full or causal masks; got window={shape.window}, "
                             f"segment_ids={shape.segment_ids} (windows: "
                             f"experiments/window_bench.py).")
        for axes in meshes:
            chosen = plan.plan_layer(shape.replace(backward=True), axes)
            where = dict(seq_len=shape.seq_len, mesh=mesh_label(axes))
            plans.append(dict(where, strategy=chosen.strategy, reason=chosen.reason))
            for name in kernels:
                for strategy in strategies:
                    reason = skip_reason(strategy, axes, shape, one_axis)
                    if reason is None:
                        todo.append((Case(strategy, axes, shape, name), chosen.strategy))
                    else:
                        skipped.append(dict(where, strategy=strategy, kernel=name,
                                            reason=reason))
    if not todo:
        raise ValueError("nothing to run: " + "; ".join(
            f"{s['strategy']} on {s['mesh']} (seq {s['seq_len']}): {s['reason']}"
            for s in skipped))
    return todo, skipped, plans


def run(shape: LayerShape = DEFAULT_SHAPE, meshes: Sequence = DEFAULT_MESHES, *,
        seq_lens: Optional[Sequence[int]] = None, strategies: Sequence[StrategyName] = STRATEGIES,
        kernels: Sequence[KernelName] = ("auto",), warmup: int = 1, runs: int = 3,
        check: bool = True, progress: bool = True) -> dict:
    """Compiles, times and measures every applicable (seq_len, mesh, kernel, strategy).

    Args:
      shape: the layer; ``seq_lens`` (if given) sweeps its ``seq_len``.
      meshes: ``"sp=8"`` / ``"dcn=2,ici=4"`` strings or ``{name: size}`` dicts.
      strategies, kernels: what to try (``"pallas"`` is interpreted off GPU: slow).
      warmup, runs: untimed calls, then timed calls (the median is reported).
      check: compare with the reference; progress: a tqdm bar (stderr).

    Returns:
      ``{"shape", "rows", "skipped", "plans", "notes"}``; each row has ``seq_len,
      mesh, strategy, kernel, layout, fwd_ms, fwd_bwd_ms, err_out, err_grad,
      planned`` and the keys of :func:`costs`.

    Raises:
      ValueError: too few devices, a dtype not in ``DTYPES``, a window or segment
        ids, or nothing left to run (with every skip reason).

    .. code-block:: python

        print(format_table(run(DEFAULT_SHAPE.replace(seq_len=1024), ["sp=8"],
                               strategies=["ring"])))
    """
    from tqdm.auto import tqdm

    meshes = [parse_mesh(m) if isinstance(m, str) else dict(m) for m in meshes]
    shapes = [shape.replace(seq_len=int(s)) for s in seq_lens or [shape.seq_len]]
    needed = max(math.prod(m.values()) for m in meshes)
    if jax.device_count() < needed:
        raise ValueError(f"a mesh needs {needed} devices but JAX has {jax.device_count()}; "
                         f"set XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
                         f"before JAX starts.")
    todo, skipped, plans = configurations(shapes, meshes, strategies, kernels)
    rows, references = [], {}
    for case, chosen in tqdm(todo, desc="bench", disable=not progress, file=sys.stderr):
        shape_, axes, strategy = case.shape, case.axes, case.strategy
        mesh, *compiled = compile_strategy(case)
        shards, zigzag = mesh.devices.size, layout_for(strategy, shape_) == "zigzag"
        natural = [jax.random.normal(key, size, shape_.dtype) for key, size in
                   zip(jax.random.split(jax.random.key(0), 4), shape_.operand_shapes())]
        args = [jax.device_put(layout.zigzag_permute(x, shards) if zigzag else x,
                               NamedSharding(mesh, P(None, tuple(axes)))) for x in natural]
        fwd_ms, out = median_ms(compiled[0], args[:3], warmup, runs)
        fwd_bwd_ms, (_, grads) = median_ms(compiled[1], args, warmup, runs)
        row = dict(seq_len=shape_.seq_len, mesh=mesh_label(axes), strategy=strategy,
                   kernel=case.kernel, layout="zigzag" if zigzag else "contiguous",
                   fwd_ms=fwd_ms,
                   fwd_bwd_ms=fwd_bwd_ms, **costs(strategy, axes, shape_, compiled),
                   err_out=None, err_grad=None, planned=strategy == chosen)
        if check:
            if shape_ not in references:
                references[shape_] = _reference(shape_, *natural)
            ref_out, ref_grads = references[shape_]
            natural_order = (lambda x, n=shards: layout.zigzag_unpermute(x, n)) if zigzag else (
                lambda x: x)
            row["err_out"] = _max_error(natural_order(out), ref_out)
            if ref_grads is not None:
                row["err_grad"] = max(map(_max_error, map(natural_order, grads), ref_grads))
        rows.append(row)
    return dict(shape=dataclasses.asdict(shape), rows=rows, skipped=skipped, plans=plans,
                notes=_notes(rows, jax.default_backend(), shape.dtype))


def _notes(rows, backend: str, dtype: str) -> list[str]:
    notes = []
    if backend == "cpu" and dtype != "float32":
        notes.append("XLA:CPU sends 16-bit collectives as f32: the model uses 4-byte elements.")
    if any(r["strategy"] == "hybrid" and r["mesh"].split(",")[0].endswith("=2") for r in rows):
        notes.append("a ring of 2 compiled with its backward: XLA merges the backward's one "
                     "K/V hop with the forward's (CSE), so HLO/model < 1 for fwd+bwd.")
    if any(r["kernel"] == "pallas" for r in rows) and backend != "gpu":
        notes.append("pallas ran in the Pallas interpreter (no GPU): not kernel speed.")
    return notes
