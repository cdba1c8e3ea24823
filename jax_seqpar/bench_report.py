"""``jax-seqpar bench``: its options, its table and its plot, over :mod:`jax_seqpar.bench`.

    jax-seqpar bench --seq 1024,2048 --mesh sp=8 --mesh dcn=2,ici=4 --plot b.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from jax_seqpar.bench import (_MIB, DEFAULT_MESHES, DTYPES, KERNELS, STRATEGIES, BenchShape,
                              parse_mesh, run)


def format_table(result: dict) -> str:
    """One text table of :func:`run`'s rows; plan's reasons, skips and notes below it."""
    from jax_seqpar.projection import text_table

    def err(r):
        values = [e for e in (r["err_out"], r["err_grad"]) if e is not None]
        return f"{max(values):.1e}" if values else "-"

    lines = [[r["seq_len"], r["mesh"], r["strategy"] + " *" * r["planned"], r["kernel"],
              f"{r['fwd_ms']:.1f}", f"{r['fwd_bwd_ms']:.1f}",
              *(f"{r[key] / _MIB:.2f}" for key in ("temp_fwd_bytes", "temp_fwd_bwd_bytes",
                                                   "hlo_fwd_bwd_bytes", "model_fwd_bwd_bytes")),
              f"{r['hlo_fwd_bwd_bytes'] / r['model_fwd_bwd_bytes']:.3f}"
              if r["model_fwd_bwd_bytes"] else "-", err(r)] for r in result["rows"]]
    headers = ["seq", "mesh", "strategy", "kernel", "fwd ms", "f+b ms", "temp fwd MiB",
               "temp f+b MiB", "HLO f+b MiB/dev", "model MiB", "HLO/model", "max err"]
    text = [text_table(headers, lines), "* = plan.plan's choice for that mesh:"]
    text += [f"  seq {p['seq_len']}, {p['mesh']}: {p['reason']}" for p in result["plans"]]
    text += [f"skipped {s['strategy']} ({s['kernel']}) on {s['mesh']}, seq {s['seq_len']}: "
             f"{s['reason']}" for s in result["skipped"]]
    return "\n".join(text + [f"note: {n}" for n in result["notes"]])


def plot(result: dict, path: str) -> None:
    """PNG: time and per-device temp memory (fwd dashed, fwd+bwd solid) vs seq length."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    panels = zip(figure.subplots(1, 2), (("fwd_ms", "fwd_bwd_ms"),
                                         ("temp_fwd_bytes", "temp_fwd_bwd_bytes")),
                 (1.0, _MIB), ("time (ms, median)", "temp memory per device (MiB)"))
    series: dict[str, list] = {}
    for r in result["rows"]:
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


def _comma_list(convert):
    return lambda text: [convert(v.strip()) for v in text.split(",") if v.strip()]


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``bench`` options to ``parser`` (e.g. the ``jax-seqpar bench`` subparser)."""
    add = parser.add_argument
    add("--batch", type=int, default=1, help="sequences per call (B)")
    add("--seq", type=_comma_list(int), default=[4096],
        help="global sequence length(s), comma-separated for a sweep, e.g. 1024,2048,4096")
    add("--heads", type=int, default=8, help="query heads H")
    add("--kv-heads", type=int, default=2, help="key/value heads Hkv (H %% Hkv == 0)")
    add("--head-dim", type=int, default=64, help="q/k head dim Dqk")
    add("--v-head-dim", type=int, default=None, help="v head dim Dv (default: Dqk)")
    add("--dtype", choices=DTYPES, default="float32", help="q/k/v dtype")
    add("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask")
    add("--mesh", action="append", default=None, metavar="NAME=SIZE[,NAME=SIZE]",
        help="a mesh of emulated CPU devices, outer axis first; repeat it to sweep "
             f"factorizations (default: {' and '.join(DEFAULT_MESHES)})")
    add("--strategies", type=_comma_list(str), default=list(STRATEGIES),
        help=f"comma-separated, from {','.join(STRATEGIES)}; ulysses/ring/allgather use one "
             "axis (or the axes flattened), hybrid two; combinations a mesh or shape cannot "
             "run are listed as skipped with the reason (an error if nothing is left)")
    add("--kernels", type=_comma_list(str), default=["xla"],
        help=f"comma-separated local kernels from {','.join(KERNELS)}; pallas runs in the "
             "Pallas interpreter on CPU, which is very slow (use a small --seq)")
    add("--warmup", type=int, default=1, help="untimed calls before timing")
    add("--runs", type=int, default=3, help="timed calls; the median is reported")
    add("--no-check", action="store_true",
        help="skip the comparison with the reference attention (max err column)")
    add("--json", metavar="PATH", help="also write every number as JSON to PATH")
    add("--plot", metavar="PATH", help="also write a PNG of time and memory vs seq length")
    add("--no-progress", action="store_true", help="hide the progress bar")
    add("--project", action="store_true",
        help="instead print the MODELLED communication time of this shape on 8..1024 chips "
             "(8 per node) for 32K..1M tokens (jax_seqpar.projection); runs nothing")
    return parser


def run_bench(args: argparse.Namespace) -> int:
    """Runs ``jax-seqpar bench`` from :func:`add_bench_arguments` options; the exit status."""
    try:
        if args.project:
            from jax_seqpar import projection

            print(projection.format_table(projection.project(
                args.heads, args.kv_heads, args.head_dim, args.v_head_dim, batch=args.batch,
                causal=args.causal, dtype_bytes=4 if args.dtype == "float32" else 2)))
            return 0
        meshes = [parse_mesh(m) for m in args.mesh or DEFAULT_MESHES]
        from jax_seqpar.cli import _emulate_cpu_devices  # before JAX starts a backend

        _emulate_cpu_devices(max(math.prod(m.values()) for m in meshes))
        result = run(BenchShape(args.batch, args.seq[0], args.heads, args.kv_heads,
                                args.head_dim, args.v_head_dim, args.dtype, args.causal),
                     meshes, seq_lens=args.seq, strategies=args.strategies, kernels=args.kernels,
                     warmup=args.warmup, runs=args.runs, check=not args.no_check,
                     progress=not args.no_progress)
    except ValueError as error:
        print(f"jax-seqpar bench: {error}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(run_bench(add_bench_arguments(argparse.ArgumentParser(
        prog="python -m jax_seqpar.bench_report", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)).parse_args()))
