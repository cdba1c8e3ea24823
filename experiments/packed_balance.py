"""Packed documents: how evenly each token order spreads the work over the devices.

Makes the tables of ``experiments/packed_results.md`` and its plots
(``results/packed_balance.png``, ``results/packed_masked.png``; numbers in
``results/packed_balance*.json``), for ``docs/benchmarks.md``.

For three document mixes (one long document per row; uniform short documents; heavy-tailed
lengths) and the orders contiguous, zigzag, striped and per_document, prints the busiest
device's token work and computed tiles over the mean (median/worst over ``--seeds``
draws; tiles per-row classified with segment signatures, at each kernel's default tiles
and at 128), then the CPU-mesh time of a causal ring layer (XLA kernel) for zigzag vs
per_document, and saves a plot of the work per device (and, with ``--json``, every
number). Then the masked mixes (prefix-LM documents with heavy-tailed lengths,
vision-language documents with 1-4 images, chunked causal rows with chunks of 2560,
3000, 6000 tokens): zigzag, striped and the per-document order balanced by the mask,
busiest/mean visible pairs and computed 128-token tiles, plotted to ``--masked-plot``.
The balance is counted at ``--seq`` (host numpy, no attention is run); the ring is
timed at ``--time-seq`` (the CPU mesh is slow; 0 skips the timing).

    python experiments/packed_balance.py                 # B=2, S=16384, P=8, ring at 4096
    python experiments/packed_balance.py --seeds 2 --time-seq 0 --plot /tmp/packed.png

The same bench at one size: ``jax-seqpar bench --packed --batch 2 --seq 16384``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def plot_masked(result: dict, path: str) -> None:
    """PNG: per masked mix, the worst busiest/mean pairs and tiles of each layout
    (``result``: :func:`jax_seqpar.tools.packed_bench.run_packed`'s)."""
    import numpy as np
    from matplotlib.figure import Figure

    from jax_seqpar.tools.packed_bench import MASKED_LAYOUTS

    rows = result["masked"]
    mixes_seen = list(dict.fromkeys(r["mix"] for r in rows))
    figure = Figure(figsize=(9, 6), layout="constrained")
    axes = figure.subplots(2, 1, squeeze=False)[:, 0]
    width = 0.8 / len(MASKED_LAYOUTS)
    for ax, key in zip(axes, ("pairs", "tiles")):
        for i, name in enumerate(MASKED_LAYOUTS):
            values = [next(r[key]["worst"] for r in rows if r["mix"] == m and r["layout"] == name)
                      for m in mixes_seen]
            ax.bar(np.arange(len(mixes_seen)) + i * width, values, width, label=name)
        ax.axhline({"pairs": 1.05, "tiles": 1.10}[key], color="k", linewidth=0.6, ls="--")
        ax.set(title=f"busiest/mean {key} (worst over {result['seeds']} seeds)",
               ylabel="/ mean", ylim=(0.9, None))
        ax.set_xticks(np.arange(len(mixes_seen)) + 0.4 - width / 2, mixes_seen)
    axes[0].legend(fontsize=7)
    figure.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16384, help="tokens per row (balance)")
    parser.add_argument("--shards", type=int, default=8, help="devices P")
    parser.add_argument("--seeds", type=int, default=8, help="draws of each mix")
    parser.add_argument("--time-seq", type=int, default=4096,
                        help="tokens per row of the timed ring layer (0: no timing)")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "packed_balance.png"))
    parser.add_argument("--masked-plot", default=os.path.join(
        os.path.dirname(__file__), "results", "packed_masked.png"),
        help="plot of the masked mixes (prefix-LM, images, chunks) per layout")
    parser.add_argument("--json", default=None, help="also write every number here")
    args = parser.parse_args(argv)

    from jax_seqpar.tools import targets

    targets.emulate_cpu_devices(args.shards, cpu_only=True)  # before JAX starts a backend
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.tools import packed_bench

    def shape(seq):
        return LayerShape(args.batch, seq, args.heads, args.kv_heads, args.head_dim,
                          causal=True)

    result = packed_bench.run_packed(shape(args.seq), args.shards, seeds=args.seeds,
                                     time_ring=False)
    if args.time_seq:
        result["times"] = packed_bench.ring_times(shape(args.time_seq), args.shards,
                                                  runs=args.runs, warmup=1)
        result["time_seq"] = args.time_seq
        result["load"] = ("load average %.1f %.1f %.1f" % os.getloadavg()
                          if hasattr(os, "getloadavg") else "")
    print(packed_bench.format_packed(result))
    if args.time_seq:
        print(f"(ring timed at S={args.time_seq})")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot saved")
        args.plot = args.masked_plot = None
    for path, plot in ((args.plot, packed_bench.plot_packed),
                       (args.masked_plot, plot_masked)):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            plot(result, path)
            print(f"plot: {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
