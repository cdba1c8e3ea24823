"""Sliding-window attention under sequence parallelism: what each strategy sends.

Makes ``results/window_bench_{cpu,h100}.{txt,json}`` and ``results/window_bytes_vs_p*.png``
(the commands are on their ``$`` lines), quoted by the README's sliding-window section
(``docs/benchmarks.md``).

For a causal window ``W`` at sequence length ``S`` on ``P`` devices, compiles the
forward + backward (``jax.vjp`` with a given cotangent) of the window ring (halo
exchange), the full ring (the same window with explicit positions, which forbid
skipping), the windowed all-gather and Ulysses, with ``kernel="auto"``, and prints
per device: the bytes every collective sends (read from the compiled HLO by
:mod:`jax_seqpar.tools.hlo`), the model's :func:`jax_seqpar.comm_bytes`, XLA's temp
memory and the hand-written kernels in the program (``xla`` when there are none).

By default the programs are compiled for this host's CPU mesh (8 emulated devices);
``--time`` also runs each one there (median of ``--runs`` calls, with the load
average). ``--target`` compiles, without running, for a target of
:mod:`jax_seqpar.tools.targets` (``h100:8``, ``v5p:2x2x2``, ...) on the first ``P`` of its
devices, with register spills as compile errors on GPU; ``kernel="auto"`` lowers to
the Triton kernel there where the call's options allow it. ``--json`` writes the
table, ``--plot`` a PNG of the bytes per device vs ``P`` (log scale), one line per
(strategy, W).

    python experiments/window_bench.py                       # S=32768, W=128,1024,4096, P=2,4,8
    python experiments/window_bench.py --seq 8192 --windows 128 1024 --time
    python experiments/window_bench.py --json bytes.json --plot bytes.png
    JAX_PLATFORMS=cpu python experiments/window_bench.py --target h100:8 --shards 8

Shapes: q, k, v, cotangent ``[B=1, S, H=Hkv=8, D=64]`` float32, split over ``S``
(the CPU backend sends bf16 as f32 anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # compile-only GPUs

from jax_seqpar.tools import targets  # noqa: E402

targets.emulate_cpu_devices(8, cpu_only=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar as sp  # noqa: E402
from jax_seqpar.tools import aot, hlo  # noqa: E402
from jax_seqpar import comm_bytes  # noqa: E402
from jax_seqpar.core import layout  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 8, 64
# (label, per-shard function, comm_bytes strategy, whether the window is modelled)
VARIANTS = (("window ring", "ring", True), ("full ring", "ring", False),
            ("allgather", "allgather", True), ("ulysses", "ulysses", True))


def _mesh(target: str, num_shards: int) -> Mesh:
    """A one-axis ``("sp",)`` mesh of the first ``num_shards`` devices of ``target``."""
    devices = targets.target_mesh(target).devices.ravel()
    if num_shards > len(devices):
        raise ValueError(f"P={num_shards} but target {target!r} has {len(devices)} devices.")
    return Mesh(devices[:num_shards], ("sp",))


def _program(strategy: str, mesh: Mesh, seq: int, window, full_ring: bool):
    """``(forward + vjp of q, k, v, cotangent, their ShapeDtypeStructs)`` on ``mesh``."""
    spec = P(None, "sp")
    fn = getattr(sp, f"{strategy}_attention")

    def body(q, k, v):
        positions = None
        if full_ring:  # explicit (contiguous) positions: the ring may not skip a hop
            positions = layout.shard_positions("contiguous", q.shape[1], axis_name="sp")
            positions = jnp.broadcast_to(positions, q.shape[:2])
        return fn(q, k, v, seq_axes="sp", causal=True, window=window, positions=positions,
                  kernel="auto")

    attend = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    f_and_vjp = aot.with_vjp(attend)
    sharding = NamedSharding(mesh, spec)
    shapes = [jax.ShapeDtypeStruct((1, seq, h, HEAD_DIM), jnp.float32, sharding=sharding)
              for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    return f_and_vjp, shapes


def _time(compiled, shapes, runs: int) -> float:
    """Median seconds of ``runs`` calls of ``compiled`` on ones (after one warm-up)."""
    args = [jax.device_put(jnp.ones(s.shape, s.dtype), s.sharding) for s in shapes]
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kernels(compiled) -> str:
    """``"triton:name x2, ..."`` of the program's kernel calls, or ``"xla"`` if none."""
    calls = hlo.kernel_calls(compiled)
    return ", ".join(f"{name} x{n}" for name, n in sorted(calls.items())) or "xla"


def measure(target: str, seq: int, window: int, num_shards: int, label: str, strategy: str,
            windowed: bool, *, runs: int = 0) -> dict:
    """One row: ``hlo_bytes``, ``model_bytes``, ``temp_mib``, ``kernels`` (and ``time_s``
    when ``runs``), or ``error`` when the compiler refuses the program."""
    row = dict(window=window, shards=num_shards, variant=label)
    fn, shapes = _program(strategy, _mesh(target, num_shards), seq, (window, 0),
                          full_ring=not windowed)
    try:
        program = aot.compile_for(fn, shapes, targets.target_platform(target),
                                  fail_on_spills=True)
    except Exception as error:  # noqa: BLE001 - a refused program is a result
        return dict(row, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    compiled = program.compiled
    row.update(
        hlo_bytes=sum(hlo.collective_bytes(compiled).values()),
        model_bytes=comm_bytes(strategy, batch=1, seq_len=seq, num_heads=HEADS,
                               num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               axis_sizes=num_shards, dtype_bytes=4, backward=True,
                               window=(window, 0) if windowed else None, causal=True),
        temp_mib=hlo.memory_bytes(compiled)["temp"] / 2**20, kernels=_kernels(compiled),
        compile_s=program.seconds)
    if runs:
        row["time_s"] = _time(compiled, shapes, runs)
        row["load_avg_1min"] = os.getloadavg()[0]
    return row


def format_row(row: dict) -> str:
    """One line of the printed table."""
    head = f"{row['window']:>5} {row['shards']:>2} {row['variant']:<12}"
    if "error" in row:
        return f"{head} FAILED {row['error']}"
    line = (f"{head} {row['hlo_bytes']:>13,.0f} {row['model_bytes']:>13,.0f} "
            f"{row['temp_mib']:>9.1f}")
    if "time_s" in row:
        line += f" {row['time_s']:7.3f} {row['load_avg_1min']:5.2f}"
    return f"{line}  {row['kernels']}"


def plot(rows, title: str, path: str) -> None:
    """PNG at ``path``: forward + backward bytes per device vs P, log y, a line per
    (variant, W): colour and marker by variant (the window ring's hollow, as it sends
    what the all-gather does), dash by W."""
    from matplotlib.figure import Figure  # the Agg canvas: no display needed

    figure = Figure(figsize=(8.5, 4.8), layout="constrained")
    axes = figure.subplots()
    windows = sorted({r["window"] for r in rows})
    markers = dict(zip((v[0] for v in VARIANTS), ("o", "s", ".", "^")))
    for colour, (label, _, _) in enumerate(VARIANTS):
        for dash, window in zip(("-", "--", ":", "-."), windows):
            points = sorted((r["shards"], r["hlo_bytes"]) for r in rows
                            if r["variant"] == label and r["window"] == window
                            and "error" not in r)
            if points:
                axes.plot(*zip(*points), dash, marker=markers[label], color=f"C{colour}",
                          markersize=11 if label == "window ring" else 6,
                          markerfacecolor="none" if label == "window ring" else None,
                          label=f"{label} W={window}")
    axes.set(xscale="log", yscale="log", xlabel="P (devices)",
             ylabel="bytes sent per device, fwd+bwd (HLO)", title=title)
    shards = sorted({r["shards"] for r in rows})
    axes.set_xticks(shards, [str(p) for p in shards])
    axes.minorticks_off()
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--target", default="cpu",
                        help="a jax_seqpar.tools.targets name (h100:8, v5p:2x2x2, ...); default: "
                             "this host's CPU mesh")
    parser.add_argument("--time", action="store_true", help="also run (CPU mesh only)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the table as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write bytes per device vs P (PNG)")
    args = parser.parse_args(argv)
    platform = targets.target_platform(args.target)
    if args.time and platform != "cpu":
        parser.error(f"--time runs on the CPU mesh; {args.target} is compile-only.")
    title = (f"causal window, S={args.seq}, B=1, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, "
             f"float32, forward+backward, per device, {args.target} ({platform})")
    print(title)
    header = f"{'W':>5} {'P':>2} {'strategy':<12} {'HLO bytes':>13} {'comm_bytes':>13} {'temp MiB':>9}"
    print(header + (" time s  load" if args.time else "") + "  kernels", flush=True)
    rows = []
    for window in args.windows:
        for num_shards in args.shards:
            for label, strategy, windowed in VARIANTS:
                rows.append(measure(args.target, args.seq, window, num_shards, label, strategy,
                                    windowed, runs=args.runs if args.time else 0))
                print(format_row(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(title=title, target=args.target, seq=args.seq, rows=rows), f,
                      indent=1)
    if args.plot:
        plot(rows, f"causal window, S={args.seq}, {args.target}", args.plot)


if __name__ == "__main__":
    main()
