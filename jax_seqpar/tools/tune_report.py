"""``jax-seqpar tune``: predict every candidate, time the best on the mesh, cache the winner.

Prints one table (predicted and measured ms, predicted memory, bytes per
device, rejections) and the cache file; ``strategy="auto"`` of
:func:`jax_seqpar.sequence_parallel_attention` then reuses the winner for this
shape and mesh. Without devices of the mesh's size, emulated CPU devices are
used (``--mesh sp=8`` asks for 8).
"""

from __future__ import annotations

import argparse
import math
import sys

__all__ = ["add_tune_arguments", "run_tune"]

_MIB = 2.0**20


def add_tune_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``tune`` options to ``parser`` (the ``jax-seqpar tune`` subparser)."""
    add = parser.add_argument
    add("--batch", type=int, default=1, help="sequences per call (B)")
    add("--seq", type=int, default=4096, help="global sequence length S")
    add("--heads", type=int, default=8, help="query heads H")
    add("--kv-heads", type=int, default=8, help="key/value heads Hkv (H %% Hkv == 0)")
    add("--head-dim", type=int, default=64, help="q/k head dim Dqk")
    add("--v-head-dim", type=int, default=None, help="v head dim Dv (default: Dqk)")
    add("--dtype", choices=("float32", "bfloat16"), default="float32", help="q/k/v dtype")
    add("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask")
    add("--window", type=int, default=None, help="sliding window (both sides), or none")
    add("--mesh", default="sp=8", metavar="NAME=SIZE[,NAME=SIZE]",
        help="the sequence axes of the mesh, outer first (devices of this process)")
    add("--hardware", default=None,
        help="a preset (h100, h200, a100, tpu-v5e, tpu-v5p, tpu-v6e, cpu) or 'calibrate' "
             "(measure the cpu preset first); default: the devices' preset")
    add("--memory-budget-gib", type=float, default=None,
        help="per-device memory budget in GiB (default: the hardware's HBM)")
    add("--top", type=int, default=3, help="how many of the best predicted candidates to time")
    add("--runs", type=int, default=3, help="timed calls per candidate (median)")
    add("--cache", default=None, help="the tuned-plan file to write (default: "
                                      "$JAX_SEQPAR_TUNED_PLANS or the user cache dir)")
    return parser


def run_tune(args: argparse.Namespace) -> int:
    """Runs ``jax-seqpar tune``; returns the exit status."""
    from jax_seqpar.tools.bench import mesh_label, parse_mesh
    from jax_seqpar.tools.targets import emulate_cpu_devices  # before JAX starts a backend

    try:
        axes = parse_mesh(args.mesh)
        emulate_cpu_devices(math.prod(axes.values()))
        import jax
        import numpy as np
        from jax.sharding import Mesh

        from jax_seqpar.planning import tuned
        from jax_seqpar.tools import calibrate, tune

        devices = math.prod(axes.values())
        if jax.device_count() < devices:
            raise ValueError(f"mesh {args.mesh} needs {devices} devices; JAX has "
                             f"{jax.device_count()}.")
        mesh = Mesh(np.array(jax.devices()[:devices]).reshape(tuple(axes.values())),
                    tuple(axes))
        hardware = calibrate.calibrate_cpu() if args.hardware == "calibrate" else args.hardware
        budget = None if args.memory_budget_gib is None else args.memory_budget_gib * 2.0**30
        chosen = tune.tune(
            args.seq, args.heads, args.kv_heads, args.head_dim, mesh, batch=args.batch,
            v_head_dim=args.v_head_dim, dtype_bytes=4 if args.dtype == "float32" else 2,
            causal=args.causal, window=args.window, hardware=hardware, memory_budget=budget,
            cache=args.cache, top=args.top, runs=args.runs)
    except ValueError as error:
        print(f"jax-seqpar tune: {error}", file=sys.stderr)
        return 2
    print(format_plan(chosen, mesh_label(axes)))
    path = args.cache or tuned.default_cache_path()
    print(f"stored in {path}; strategy=\"auto\" uses it with {tuned.ENV_VAR}={path}")
    return 0


def format_plan(chosen, mesh: str) -> str:
    """A table of every candidate of a measured :class:`~jax_seqpar.planning.plan.Plan`."""
    from jax_seqpar.tools.report import text_table

    rows = []
    for label in chosen.candidates:
        predicted = chosen.predicted_seconds.get(label)
        measured = chosen.measured_seconds.get(label)
        rows.append([label + (" *" if label == _label(chosen) else ""),
                     None if predicted is None else f"{predicted * 1e3:.3g}",
                     None if measured is None else f"{measured * 1e3:.3g}",
                     f"{chosen.memory_bytes[label] / _MIB:.1f}",
                     f"{chosen.candidates[label] / _MIB:.2f}",
                     chosen.rejected.get(label, "")])
    table = text_table(["candidate", "predicted ms", "measured ms", "memory MiB",
                        "sent MiB", "rejected"], rows)
    return f"mesh {mesh}: {chosen.reason}\n{table}"


def _label(chosen) -> str:
    if chosen.strategy != "hybrid":
        return chosen.strategy
    ring, ulysses = chosen.factorization
    return f"hybrid {ring}x{ulysses}"
