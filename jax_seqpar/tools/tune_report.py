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

from jax_seqpar.tools.cli_options import add_shape_arguments, positive_int, shape_from_args

__all__ = ["add_tune_arguments", "run_tune"]

_MIB = 2.0**20


#: ``jax-seqpar tune --help``'s description (plain text).
DESCRIPTION = (
    "Predict every strategy and factorization of the mesh for the layer, time the best "
    "--top on the mesh, print them (predicted and measured ms, predicted memory, bytes per "
    "device, rejections) and store the fastest in the tuned-plan file, which "
    "strategy=\"auto\" reads when $JAX_SEQPAR_TUNED_PLANS names it. Without devices of "
    "the mesh's size, emulated CPU devices are used (--mesh sp=8 asks for 8). With several "
    "--seq lengths, each is tuned in turn.")


def add_tune_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``tune`` options to ``parser`` (the ``jax-seqpar tune`` subparser)."""
    add = parser.add_argument
    add_shape_arguments(parser)
    add("--window", type=positive_int, default=None,
        help="sliding window of this many tokens on both sides (default: none)")
    add("--mesh", default="sp=8", metavar="NAME=SIZE[,NAME=SIZE]",
        help="the sequence axes of the mesh, outer first (devices of this process)")
    add("--hardware", default=None,
        help="a preset (h100, h200, a100, tpu-v5e, tpu-v5p, tpu-v6e, cpu) or 'calibrate' "
             "(measure the cpu preset first); default: the devices' preset")
    add("--memory-budget-gib", type=float, default=None,
        help="per-device memory budget in GiB (default: the hardware's HBM)")
    add("--top", type=positive_int, default=3,
        help="how many of the best predicted candidates to time")
    add("--runs", type=positive_int, default=3, help="timed calls per candidate (median)")
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
        chosen = [tune.tune_layer(shape_from_args(args, seq_len, window=args.window), mesh,
                                  hardware=hardware, memory_budget=budget, cache=args.cache,
                                  top=args.top, runs=args.runs)
                  for seq_len in args.seq]
    except ValueError as error:
        print(f"jax-seqpar tune: {error}", file=sys.stderr)
        return 2
    for seq_len, plan in zip(args.seq, chosen):
        print(f"seq {seq_len}, " + format_plan(plan, mesh_label(axes)))
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
