"""``jax-seqpar bench``: its options, tables and plots, over :mod:`jax_seqpar.tools.bench`
(run here) and :mod:`jax_seqpar.tools.bench_target` (compiled for a target, not run).

    jax-seqpar bench --seq 1024,2048 --mesh sp=8 --mesh dcn=2,ici=4 --plot b.png
    jax-seqpar bench --target h100:8 --seq 8192 --heads 16 --kv-heads 4 --head-dim 128
    jax-seqpar bench --target v5p:2x2x2 --max-seq --heads 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from jax_seqpar.core.shape import LayerShape
from jax_seqpar.tools import bench_target, targets
from jax_seqpar.tools.bench import (MIB, DEFAULT_MESHES, KERNELS, STRATEGIES,
                                    parse_mesh, run)
from jax_seqpar.tools.bench_target import DEFAULT_RESERVE, MAX_SEQ_TOLERANCE
from jax_seqpar.tools.cli_options import (HelpFormatter, add_shape_arguments, comma_list,
                                          shape_from_args)
from jax_seqpar.tools.report import format_projection, text_table

__all__ = ["add_bench_arguments", "format_table", "plot", "run_bench"]


def format_table(result: dict) -> str:
    """One text table of :func:`jax_seqpar.tools.bench.run`'s rows; plan's reasons, skips and notes below it."""
    if "target" in result:
        return format_target_table(result)
    def err(r):
        values = [e for e in (r["err_out"], r["err_grad"]) if e is not None]
        return f"{max(values):.1e}" if values else "-"

    lines = [[r["seq_len"], r["mesh"], r["strategy"] + " *" * r["planned"], r["kernel"],
              f"{r['fwd_ms']:.1f}", f"{r['fwd_bwd_ms']:.1f}",
              *(f"{r[key] / MIB:.2f}" for key in ("temp_fwd_bytes", "temp_fwd_bwd_bytes",
                                                   "hlo_fwd_bwd_bytes", "model_fwd_bwd_bytes")),
              f"{r['hlo_fwd_bwd_bytes'] / r['model_fwd_bwd_bytes']:.3f}"
              if r["model_fwd_bwd_bytes"] else "-", err(r)] for r in result["rows"]]
    headers = ["seq", "mesh", "strategy", "kernel", "fwd ms", "f+b ms", "temp fwd MiB",
               "temp f+b MiB", "HLO f+b MiB/dev", "model MiB", "HLO/model", "max err"]
    return "\n".join([text_table(headers, lines)] + _footer(result))


def _footer(result: dict) -> list[str]:
    """plan's choices, the skipped combinations and the notes of a result."""
    text = ["* = plan.plan's choice for that mesh:"] if result.get("plans") else []
    text += [f"  seq {p['seq_len']}, {p['mesh']}: {p['reason']}" for p in result.get("plans", [])]
    text += [f"skipped {s['strategy']} ({s['kernel']}) on {s['mesh']}, seq {s['seq_len']}: "
             f"{s['reason']}" for s in result["skipped"]]
    return text + [f"note: {n}" for n in result["notes"]]


def _overlap(program: dict) -> str:
    """``"enclosing compute / async pairs"`` of a compiled program (``-`` if none)."""
    pairs = program["overlap"]
    return f"{sum(bool(p['enclosed']) for p in pairs)}/{len(pairs)}" if pairs else "-"


def _hidden(program: dict) -> str:
    """Percent of the bytes sent whose transfer encloses a kernel (``-``: none sent)."""
    if not program["hlo_total_bytes"]:
        return "-"
    return f"{100 * program['hidden_fraction']:.0f}%"


def _enclosed(pair: dict) -> str:
    kernels = [e for e in pair["enclosed"] if ":" in e]
    others = len(pair["enclosed"]) - len(kernels)
    text = ", ".join(kernels + ([f"{others} other ops"] if others else [])) or "nothing"
    return text + (" (a kernel: hidden)" if pair.get("encloses_kernel") else "")


def format_target_table(result: dict) -> str:
    """The table of :func:`jax_seqpar.tools.bench_target.run_target`: compiled, not run."""
    lines = []
    for r in result["rows"]:
        fwd, both = r["fwd"], r["fwd_bwd"]
        lines.append([
            r["seq_len"], r["mesh"],
            r["strategy"] + " *" * r["planned"] + (" overlap=False" if r.get("overlap") is False
                                                   else ""),
            f"{fwd['compile_s']:.1f}/{both['compile_s']:.1f}",
            *(f"{x / MIB:.1f}" for x in (fwd["temp_bytes"], both["temp_bytes"])),
            _hidden(fwd), _hidden(both),
            *(f"{x / MIB:.1f}" for x in (both["argument_bytes"], both["hlo_total_bytes"],
                                          both["model_bytes"])),
            f"{both['hlo_total_bytes'] / both['model_bytes']:.3f}" if both["model_bytes"] else "-",
            _overlap(fwd), _overlap(both)])
    headers = ["seq", "mesh", "strategy", "compile s f/f+b", "temp fwd MiB", "temp f+b MiB",
               "hidden fwd", "hidden f+b", "args f+b MiB", "HLO f+b MiB/dev", "model MiB",
               "HLO/model", "overlap fwd", "overlap f+b"]
    text = [f"compiled for {result['target']}, not run ({result['shape']['dtype']}, batch "
            f"{result['shape']['batch']}, H={result['shape']['num_heads']}, "
            f"Hkv={result['shape']['num_kv_heads']}, D={result['shape']['head_dim']}, "
            f"causal={result['shape']['causal']}); per device:", text_table(headers, lines),
            "hidden = bytes sent by collectives whose start..done encloses a kernel (Triton, "
            "Mosaic or the XLA kernel's loop) / all bytes sent (jax_seqpar.tools."
            "schedule.bytes_hidden); overlap = async collectives whose start..done encloses "
            "compute / all async collectives.",
            "fwd+bwd collectives (MiB/device, model in brackets) and what each async pair "
            "encloses (x runs):"]
    for r in result["rows"]:
        both = r["fwd_bwd"]
        sent = ", ".join(f"{kind} {b / MIB:.1f}" for kind, b in both["hlo_bytes"].items())
        text.append(f"  {r['strategy']} {r['mesh']}, seq {r['seq_len']}: {sent or 'none'} "
                    f"[{both['model_bytes'] / MIB:.1f}]")
        text += [f"    {p['kind']} x{p['runs']:g}: {_enclosed(p)}" for p in both["overlap"]]
    kernels: dict[tuple, list[str]] = {}
    for r in result["rows"]:
        for mode in ("fwd", "fwd_bwd"):
            for name, k in (r[mode]["kernels"] or {}).items():
                key = (name, k["registers"], k["spill_stores"], k["spill_loads"],
                       k["shared_memory"])
                kernels.setdefault(key, []).append(f"{r['strategy']} {r['mesh']}")
    if kernels:
        text.append("Triton kernels (ptxas: registers/thread, spill stores/loads bytes; "
                    "XLA: shared memory/block):")
        text += [f"  {name}: {regs} registers, spills {stores}/{loads} B, shared "
                 f"{'-' if smem is None else f'{smem / 1024:.0f} KiB'} "
                 f"({', '.join(sorted(set(where)))})"
                 for (name, regs, stores, loads, smem), where in sorted(kernels.items())]
    return "\n".join(text + _footer(result))


def format_max_seq_table(result: dict) -> str:
    """The table of :func:`jax_seqpar.tools.bench_target.run_max_seq`."""
    gib = 2.0**30
    lines = [[r["mesh"], r["strategy"],
              *(x for mode in ("fwd", "fwd_bwd") for x in (
                  r[mode]["max_seq"], "-" if r[mode]["footprint_bytes"] is None
                  else f"{r[mode]['footprint_bytes'] / gib:.1f}")),
              r["fwd"]["compiles"] + r["fwd_bwd"]["compiles"]] for r in result["rows"]]
    headers = ["mesh", "strategy", "max seq fwd", "GiB/dev", "max seq f+b", "GiB/dev",
               "compiles"]
    shape = result["shape"]
    budget = (1 - result["reserve"]) * result["hbm_bytes"] / gib
    return "\n".join([
        f"longest sequence that fits, compiled for {result['target']}, not run: "
        f"{shape['dtype']}, batch {shape['batch']}, H={shape['num_heads']}, "
        f"Hkv={shape['num_kv_heads']}, D={shape['head_dim']}, causal={shape['causal']}; "
        f"footprint = temp + arguments + outputs - aliased <= {budget:.1f} GiB "
        f"({1 - result['reserve']:.0%} of {result['hbm_bytes'] / gib:.1f} GiB HBM per device); "
        f"one attention layer, lengths in multiples of 2 x devices x 128, within "
        f"{MAX_SEQ_TOLERANCE:.1%}.", text_table(headers, lines)] + _footer(result))


def plot(result: dict, path: str) -> None:
    """PNG: time (compiled for a target: bytes sent) and per-device temp memory (fwd
    dashed, fwd+bwd solid) vs seq length; for ``--max-seq`` the longest lengths."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    if "reserve" in result:
        _plot_max_seq(figure, result)
        figure.savefig(path, dpi=110)
        return
    rows = result["rows"]
    if "target" in result:  # compiled, not run: flatten to the keys the panels read
        rows = [dict(r, fwd_ms=r["fwd"]["hlo_total_bytes"], fwd_bwd_ms=r["fwd_bwd"][
            "hlo_total_bytes"], temp_fwd_bytes=r["fwd"]["temp_bytes"],
            temp_fwd_bwd_bytes=r["fwd_bwd"]["temp_bytes"]) for r in rows]
        figure.suptitle(f"compiled for {result['target']}, not run")
    first = ("bytes sent per device (MiB, HLO)", MIB) if "target" in result else (
        "time (ms, median)", 1.0)
    panels = zip(figure.subplots(1, 2), (("fwd_ms", "fwd_bwd_ms"),
                                         ("temp_fwd_bytes", "temp_fwd_bwd_bytes")),
                 (first[1], MIB), (first[0], "temp memory per device (MiB)"))
    series: dict[str, list] = {}
    for r in rows:
        series.setdefault(f"{r['strategy']} {r['mesh']} {r['kernel']}", []).append(r)
    for axes, keys, unit, what in panels:
        for i, (label, group) in enumerate(series.items()):
            group = sorted(group, key=lambda r: r["seq_len"])
            for key, style, name in zip(keys, ("o--", "s-"), ("fwd", "f+b")):
                axes.plot([r["seq_len"] for r in group], [r[key] / unit for r in group],
                          style, color=f"C{i}", label=f"{label} {name}")
        axes.set(xscale="log", yscale="log", xlabel="sequence length", ylabel=what)
        axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.savefig(path, dpi=110)


def _plot_max_seq(figure, result: dict) -> None:
    axes = figure.subplots(1, 1)
    labels = [f"{r['strategy']}\n{r['mesh']}" for r in result["rows"]]
    for i, (mode, name) in enumerate((("fwd", "forward"), ("fwd_bwd", "forward+backward"))):
        axes.bar([x + 0.4 * i for x in range(len(labels))],
                 [r[mode]["max_seq"] for r in result["rows"]], width=0.4, label=name)
    axes.set_xticks([x + 0.2 for x in range(len(labels))], labels)
    axes.set(ylabel="longest sequence that fits", yscale="log",
             title=f"compiled for {result['target']}, not run")
    axes.legend()


#: ``jax-seqpar bench --help``'s description (plain text).
DESCRIPTION = (
    "Benchmark the sequence-parallel strategies: compile and run every applicable strategy "
    "forward and forward+backward on this machine (its accelerator, else emulated CPU "
    "devices) and print time, per-device memory, bytes sent (from the compiled HLO) next to "
    "jax_seqpar.comm_bytes, the error against the reference and plan's choice. With --target "
    "NAME (h100:8, v5p:2x2x2, ...) compile for that target without running (needs the [aot] "
    "extra): memory per device, bytes per collective, overlap scheduled, Triton kernel "
    "registers/spills/shared memory and compile time; with --max-seq the longest sequence "
    "each strategy fits.")


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``bench`` options to ``parser`` (e.g. the ``jax-seqpar bench`` subparser)."""
    add = parser.add_argument
    add_shape_arguments(parser)
    add("--mesh", action="append", default=None, metavar="NAME=SIZE[,NAME=SIZE]",
        help="a mesh, outer axis first; repeat it to sweep factorizations (default: "
             f"{' and '.join(DEFAULT_MESHES)}; with --target: sp=N and dcn=2,ici=N/2 over "
             "the target's N devices)")
    add("--target", metavar="NAME", default=None,
        help="compile for this target without running: h100:N, h200:N, a100:N, a TPU "
             "topology (v5p:2x2x2, v5e:2x4, v6e:2x4, ...), needs the [aot] extra; 'cpu' runs "
             "on emulated CPU devices; default: run on this machine's default backend (its "
             "accelerator, else emulated CPU devices)")
    add("--max-seq", action="store_true",
        help="with --target: the longest sequence each strategy fits per device, fwd and "
             "fwd+bwd (bisection on the compiled footprint; --seq is the first length tried)")
    add("--reserve", type=float, default=DEFAULT_RESERVE,
        help="with --max-seq: fraction of HBM kept free for the runtime and the rest of the "
             "model")
    add("--strategies", type=comma_list(str), default=list(STRATEGIES),
        help=f"comma-separated, from {','.join(STRATEGIES)}; ulysses/ring/allgather use one "
             "axis (or the axes flattened), hybrid two; combinations a mesh or shape cannot "
             "run are listed as skipped with the reason (an error if nothing is left)")
    add("--kernels", type=comma_list(str), default=["auto"],
        help=f"comma-separated local kernels from {','.join(KERNELS)} (auto: Triton when "
             "compiled for CUDA, Mosaic for TPU, XLA elsewhere); pallas runs in the Pallas interpreter on CPU, "
             "which is very slow (use a small --seq); with --target, one kernel")
    add("--warmup", type=int, default=1, help="untimed calls before timing")
    add("--runs", type=int, default=3, help="timed calls; the median is reported")
    add("--no-check", action="store_true",
        help="skip the comparison with the reference attention (max err column)")
    add("--json", metavar="PATH", help="also write every number as JSON to PATH")
    add("--plot", metavar="PATH", help="also write a PNG of time and memory vs seq length")
    add("--no-progress", action="store_true", help="hide the progress bar")
    add("--packed", action="store_true",
        help="instead measure packed documents (jax_seqpar.tools.packed_bench): busiest/mean "
             "token work and computed tiles per device for contiguous, zigzag, striped and "
             "per_document on three document mixes, and a causal ring layer's CPU time, "
             "zigzag vs per_document, over the first --mesh's devices (default 8); --plot "
             "writes the work per device")
    add("--seeds", type=int, default=4, help="with --packed: draws of each document mix")
    add("--project", action="store_true",
        help="instead print the MODELLED communication time of this shape on 8..1024 chips "
             "(8 per node) for 32K..1M tokens (jax_seqpar.planning.projection, from the "
             "planner's time model); runs nothing")
    return parser


def _compile_for_target(args: argparse.Namespace, shape: LayerShape) -> tuple[dict, str]:
    """``(result, table)`` of ``--target`` (compiled, not run) or ``--target --max-seq``."""
    targets.compile_only_environment()  # nothing runs: start no accelerator backend
    targets.require_plugin(targets.target_platform(args.target))
    if len(args.kernels) != 1:
        raise ValueError(f"--target compiles one kernel; got --kernels {','.join(args.kernels)}.")
    options = dict(strategies=args.strategies, kernel=args.kernels[0],
                   progress=not args.no_progress)
    if args.max_seq:
        result = bench_target.run_max_seq(shape, args.target, args.mesh, reserve=args.reserve,
                                          **options)
        return result, format_max_seq_table(result)
    result = bench_target.run_target(shape, args.target, args.mesh, seq_lens=args.seq, **options)
    return result, format_target_table(result)


def _run_packed(args: argparse.Namespace, shape: LayerShape) -> int:
    """``jax-seqpar bench --packed``: print (and save) the packed-documents bench."""
    from jax_seqpar.tools import packed_bench

    num_shards = math.prod(parse_mesh(args.mesh[0]).values()) if args.mesh else 8
    targets.emulate_cpu_devices(num_shards, cpu_only=True)
    result = packed_bench.run_packed(shape, num_shards, seeds=args.seeds, runs=args.runs,
                                     warmup=args.warmup)
    print(packed_bench.format_packed(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        packed_bench.plot_packed(result, args.plot)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Runs ``jax-seqpar bench`` from :func:`add_bench_arguments` options; the exit status."""
    try:
        shape = shape_from_args(args, args.seq[0])
        if args.project:
            from jax_seqpar.planning import projection

            print(format_projection(projection.project(
                shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.v_head_dim,
                batch=shape.batch, causal=shape.causal, dtype_bytes=shape.dtype_bytes)))
            return 0
        if args.packed:
            return _run_packed(args, shape)
        compile_only = args.target is not None and targets.parse(args.target).platform != "cpu"
        if args.max_seq and not compile_only:
            raise ValueError("--max-seq needs a GPU or TPU --target, e.g. --target h100:8.")
        if compile_only:
            result, text = _compile_for_target(args, shape)
        else:
            meshes = [parse_mesh(m) for m in args.mesh or DEFAULT_MESHES]
            # Before JAX starts a backend: --target cpu forces the CPU platform.
            targets.emulate_cpu_devices(max(math.prod(m.values()) for m in meshes),
                                        cpu_only=args.target is not None)
            result = run(shape, meshes, seq_lens=args.seq, strategies=args.strategies,
                         kernels=args.kernels, warmup=args.warmup, runs=args.runs,
                         check=not args.no_check, progress=not args.no_progress)
            text = format_table(result)
    except (ValueError, ImportError) as error:
        print(f"jax-seqpar bench: {error}", file=sys.stderr)
        return 2
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(run_bench(add_bench_arguments(argparse.ArgumentParser(
        prog="python -m jax_seqpar.tools.bench_report", description=DESCRIPTION,
        formatter_class=HelpFormatter)).parse_args()))
