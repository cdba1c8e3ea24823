"""The planner's predicted time against measured time on 8 emulated CPU devices.

Makes ``results/planner_validation.json``, which ``planner_validation.ipynb`` plots and
tabulates (``docs/planner.md``).

Calibrates the ``"cpu"`` hardware preset (``jax_seqpar.tools.calibrate.calibrate_cpu``),
then, for every shape of ``SHAPES`` and every candidate the planner considers
on one axis of 8 devices (Ulysses 1x8, ring 8x1, all-gather, hybrids 4x2 and
2x4 where the heads allow), predicts one layer's forward + backward and times
it (median of ``--runs`` calls; tokens already in the strategy's layout, as a
model applying its layout once runs it; a hybrid runs on the ``(ring,
ulysses)`` split of the same 8 devices). Prints per shape the Spearman rank
correlation of predicted vs measured times and whether the predicted fastest
is the measured fastest, then the summary, and writes everything as JSON.

The host is shared: the load average is recorded before and after; timings
under load are noisy, which the rank statistics tolerate better than ratios.

    PYTHONPATH=. python experiments/planner_validation.py --out /tmp/planner_validation.json

``--hardware FILE`` reuses a saved calibration (``FILE.hardware.json`` is written next to
``--out``); ``--first``/``--shapes`` time a slice of ``SHAPES`` and ``--merge`` joins the
JSON of slices timed by separate processes. ``--repredict JSON`` times nothing: it
predicts the measured rows of a results file again with the current model and its
calibration (how a change to the model moves the agreement, in seconds):

    PYTHONPATH=. python experiments/planner_validation.py \
        --repredict experiments/results/planner_validation.json --out /tmp/repredicted.json
"""

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_seqpar.core import layout  # noqa: E402
from jax_seqpar.core.shape import LayerShape  # noqa: E402
from jax_seqpar.planning import hardware, plan, predict  # noqa: E402
from jax_seqpar.tools import bench, calibrate  # noqa: E402
from jax_seqpar.tools.report import text_table  # noqa: E402

# (seq_len, heads, kv_heads, head_dim, causal): MHA, GQA, MQA; 8, 12 and 16 heads
# (12: no Ulysses over 8); compute-heavy and communication-heavy ends.
SHAPES = [
    (1024, 8, 8, 64, True), (2048, 8, 8, 64, True), (1024, 8, 1, 128, False),
    (2048, 8, 2, 64, True), (1024, 12, 12, 32, False), (2048, 12, 12, 64, True),
    (1024, 16, 16, 128, False), (2048, 16, 2, 32, True), (2048, 12, 1, 64, False),
    (4096, 8, 1, 32, True), (4096, 12, 12, 32, True), (2048, 12, 4, 128, False),
    (4096, 16, 16, 32, True), (4096, 8, 8, 64, True),
]


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic) if len(a) > 2 else float(
        np.sign(a[1] - a[0]) * np.sign(b[1] - b[0]))


def measure(candidate: predict.Candidate, shape, runs: int) -> float:
    """Median seconds of the candidate's forward + vjp on the first 8 devices."""
    devices = np.array(jax.devices()[:8])
    if candidate.strategy == "hybrid":
        axes = {"ring": candidate.ring, "ulysses": candidate.ulysses}
    else:
        axes = {"sp": 8}
    mesh = Mesh(devices.reshape(tuple(axes.values())), tuple(axes))
    seq_len, heads, kv_heads, head_dim, causal = shape
    bench_shape = LayerShape(batch=1, seq_len=seq_len, num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=head_dim, dtype="float32", causal=causal)
    _, forward_and_vjp = bench.build(bench.Case(candidate.strategy, dict(zip(mesh.axis_names, mesh.devices.shape)), bench_shape), mesh)
    sharding = NamedSharding(mesh, P(None, tuple(axes)))
    zigzag = bench.layout_for(candidate.strategy, bench_shape) == "zigzag"
    args = [jax.random.normal(key, size, bench_shape.dtype) for key, size in
            zip(jax.random.split(jax.random.key(0), 4), bench_shape.operand_shapes())]
    args = [jax.device_put(layout.zigzag_permute(x, 8) if zigzag else x, sharding) for x in args]
    compiled = jax.jit(forward_and_vjp).lower(*args).compile()
    seconds, _ = bench.median_ms(compiled, args, warmup=1, runs=runs)
    return seconds / 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="timed calls per candidate")
    parser.add_argument("--first", type=int, default=0, help="index of the first shape")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="how many shapes")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="instead merge the results of runs over parts of SHAPES")
    parser.add_argument("--hardware", help="a JSON Hardware (skip calibration)")
    parser.add_argument("--repredict", metavar="JSON",
                        help="instead predict the measured rows of JSON again (its "
                             "calibration, the current model; nothing is timed)")
    parser.add_argument("--out", default="planner_validation.json", help="JSON results")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    start = time.time()
    if args.merge:
        parts = [json.load(open(path)) for path in args.merge]
        cpu = _hardware(parts[0]["hardware"])
        result = _write(args.out, cpu, sum((p["rows"] for p in parts), []),
                        sum((p["summary"] for p in parts), []),
                        parts[0]["load_before"], start - sum(p["seconds"] for p in parts))
        result["load_after"] = parts[-1]["load_after"]
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)
        print(f"merged {len(result['summary'])} shapes into {args.out}")
        return 0
    if args.repredict:
        stored = json.load(open(args.repredict))
        cpu = _hardware(stored["hardware"])
        measured = {}
        for row in stored["rows"]:
            measured.setdefault(tuple(row["shape"]), {})[row["label"]] = row["measured"]
        rows, summary = [], []
        for shape, timed in measured.items():
            shape_rows, shape_summary = _compare(shape, cpu, timed)
            rows += shape_rows
            summary.append(shape_summary)
        result = _write(args.out, cpu, rows, summary, stored["load_before"], start)
        result.update(load_after=stored["load_after"], seconds=stored["seconds"],
                      repredicted_from=args.repredict)
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)
        _report(result)
        return 0
    if args.hardware:
        cpu = _hardware(json.load(open(args.hardware)))
    else:
        cpu = calibrate.calibrate_cpu()
        with open(args.out + ".hardware.json", "w") as file:
            json.dump(dataclasses.asdict(cpu), file, indent=1)
    print(f"calibrated: {cpu}", flush=True)
    rows, summary = [], []
    for shape in SHAPES[args.first:args.first + args.shapes]:
        heads = shape[1]
        measured = {}
        for candidate in predict.candidates(8, heads):
            measured[candidate.label] = measure(candidate, shape, args.runs)
            print(f"  {shape} {candidate.label}: measured "
                  f"{measured[candidate.label] * 1e3:.1f} ms", flush=True)
        shape_rows, shape_summary = _compare(shape, cpu, measured)
        rows += shape_rows
        summary.append(shape_summary)
        _write(args.out, cpu, rows, summary, load_before, start)  # partial results survive
    _report(_write(args.out, cpu, rows, summary, load_before, start))
    return 0


def _compare(shape, cpu, measured: dict) -> tuple[list, dict]:
    """``(rows, summary)`` of one shape: the planner's predictions on ``cpu`` against the
    ``measured`` seconds per candidate label."""
    seq_len, heads, kv_heads, head_dim, causal = shape
    chosen = plan.plan(seq_len, heads, kv_heads, head_dim, 8, dtype_bytes=4, causal=causal,
                       hardware=cpu)
    by_bytes = plan.plan(seq_len, heads, kv_heads, head_dim, 8, dtype_bytes=4, causal=causal)
    labels = list(measured)
    predicted = [chosen.predicted_seconds[label] for label in labels]
    timed = [measured[label] for label in labels]
    best = min(measured, key=measured.get)
    pick = min(chosen.predicted_seconds, key=chosen.predicted_seconds.get)
    bytes_pick = by_bytes.strategy
    summary = dict(shape=list(shape), labels=labels, rho=spearman(predicted, timed),
                   predicted_best=pick, measured_best=best, top1=pick == best,
                   regret=measured[pick] / measured[best], bytes_pick=bytes_pick,
                   bytes_regret=measured.get(bytes_pick, float("nan")) / measured[best])
    rows = [dict(shape=list(shape), label=label, predicted=p, measured=m)
            for label, p, m in zip(labels, predicted, timed)]
    return rows, summary


def _report(result: dict) -> None:
    """Prints the per-shape table and the summary line of a results dict."""
    summary, rows = result["summary"], result["rows"]
    print(text_table(["S x H/Hkv x D", "cands", "spearman", "predicted best",
                      "measured best", "top-1", "regret"], [
        [f"{s}x{h}/{kv}x{d}{' causal' if c else ''}", len(x["labels"]), f"{x['rho']:.2f}",
         x["predicted_best"], x["measured_best"], "yes" if x["top1"] else "no",
         f"{x['regret']:.2f}"] for x in summary for s, h, kv, d, c in [x["shape"]]]))
    print(f"mean per-shape Spearman {result['mean_spearman']:.3f}; pooled Spearman (all "
          f"{len(rows)} points) {result['pooled_spearman']:.3f}; top-1 agreement "
          f"{result['top1']}/{len(summary)}; mean regret {result['mean_regret']:.3f}; load "
          f"average {result['load_before'][0]:.1f} -> {result['load_after'][0]:.1f}; "
          f"{result['seconds']:.0f} s")


def _hardware(fields: dict) -> hardware.Hardware:
    """A Hardware from its ``dataclasses.asdict`` form (older files: ``overlap``, a bool)."""
    fields = dict(fields, **{name: hardware.Link(**fields[name]) for name in ("ici", "dcn")})
    if "overlap" in fields:
        fields["overlaps"] = hardware.COLLECTIVES if fields.pop("overlap") else ()
    return hardware.Hardware(**dict(fields, overlaps=tuple(fields.get("overlaps", ()))))


def _write(path, cpu, rows, summary, load_before, start) -> dict:
    """Writes (and returns) the results so far as JSON."""
    result = dict(
        hardware=dataclasses.asdict(cpu), rows=rows, summary=summary,
        mean_spearman=float(np.mean([x["rho"] for x in summary])),
        pooled_spearman=spearman([r["predicted"] for r in rows], [r["measured"] for r in rows]),
        top1=sum(x["top1"] for x in summary), shapes=len(summary),
        mean_regret=float(np.mean([x["regret"] for x in summary])),
        load_before=load_before, load_after=os.getloadavg(), seconds=time.time() - start)
    with open(path, "w") as file:
        json.dump(result, file, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main())
