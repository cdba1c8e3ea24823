"""What a compiled strategy program hides behind its kernels, with per-shard pipeline keywords.

Makes the rows of "Steps measured on the way" in ``experiments/pipelines_results.md``.

Compiles (deviceless AOT, nothing runs) one strategy's global program, forward or
forward + vjp, for a GPU or TPU target, with per-shard keywords (``--kw
head_groups=2``, ``--kw pieces=8``) and extra compiler options (``--opt KEY=VALUE``;
the target compile's :data:`jax_seqpar.tools.targets.COMPILE_OPTIONS` are always
passed unless ``--no-target-options``), and prints every collective (kind, MiB per run,
runs, async, encloses a kernel), bytes hidden (:func:`jax_seqpar.tools.schedule.bytes_hidden`)
and temp memory per device.

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=$PWD nice -n 10 \\
      python experiments/pipeline_probe.py --target v5p:2x2x2 --strategy ulysses \\
      --seq 16384 [--mode fwd|fwd_bwd|both] [--kw head_groups=2] [--opt KEY=VALUE] [--rows]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_seqpar.api import program as api  # noqa: E402
from jax_seqpar.core import layout  # noqa: E402
from jax_seqpar.core.shape import LayerShape  # noqa: E402
from jax_seqpar.strategies import registry  # noqa: E402
from jax_seqpar.tools import aot, bench, hlo, schedule, targets  # noqa: E402


def build(strategy, mesh, shape, kernel, kwargs):
    """:func:`jax_seqpar.tools.bench.build` with keywords for the per-shard function."""
    axes = tuple(mesh.axis_names)
    axis_name = api.axis_name_of(axes)
    attend = functools.partial(registry.get(strategy).attention, seq_axes=axis_name, **kwargs)
    order = bench.layout_for(strategy, shape)

    def body(q, k, v):
        positions = layout.shard_positions(order, q.shape[1], axis_name=axis_name)
        positions = jnp.broadcast_to(positions, q.shape[:2])
        return attend(q, k, v, causal=shape.causal, positions=positions, kernel=kernel)

    forward = jax.shard_map(body, mesh=mesh, in_specs=(P(None, axis_name),) * 3,
                            out_specs=P(None, axis_name), check_vma=api.can_check_vma(kernel))

    return forward, aot.with_vjp(forward)


def measure(target, strategy, axes, shape, *, kernel="auto", mode="fwd", kwargs=None,
            options=None, target_options=True):
    mesh = targets.target_mesh(target, tuple(axes), tuple(axes.values()))
    forward, forward_and_vjp = build(strategy, mesh, shape, kernel, kwargs or {})
    sharding = NamedSharding(mesh, P(None, tuple(axes)))
    args = [jax.ShapeDtypeStruct(s, shape.dtype, sharding=sharding)
            for s in shape.operand_shapes()]
    fn, fargs = (forward, args[:3]) if mode == "fwd" else (forward_and_vjp, args)
    start = time.perf_counter()
    platform = targets.target_platform(target)
    options = dict(options or {})
    if not target_options:  # an option given as None is not passed
        options = {**{key: None for key in targets.compile_options(platform)}, **options}
    program = aot.compile_for(fn, fargs, platform, compiler_options=options)
    seconds = time.perf_counter() - start
    compiled = program.compiled
    rows = schedule.collective_schedule(compiled)
    hidden = schedule.bytes_hidden(compiled)
    return dict(mode=mode, seconds=seconds, temp_mib=hlo.memory_bytes(compiled)["temp"] / 2**20,
                hidden=hidden["fraction"], total_mib=hidden["total"] / 2**20,
                hidden_mib=hidden["hidden"] / 2**20,
                async_pairs=sum(r.is_async for r in rows),
                enclosing=sum(r.encloses_kernel for r in rows),
                rows=[dict(kind=r.kind, mib=r.bytes / 2**20, runs=r.runs, is_async=r.is_async,
                           kernel=r.encloses_kernel, enclosed=list(r.enclosed)[:6])
                      for r in rows])


def _value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--mesh", default=None, help="e.g. sp=8 or dcn=2,ici=4")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--mode", choices=("fwd", "fwd_bwd", "both"), default="both")
    parser.add_argument("--kw", action="append", default=[], metavar="KEY=JSON")
    parser.add_argument("--opt", action="append", default=[], metavar="XLA_OPTION=VALUE")
    parser.add_argument("--no-target-options", action="store_true")
    parser.add_argument("--rows", action="store_true", help="print every collective")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    mesh = args.mesh or ("dcn=2,ici=4" if args.strategy == "hybrid" else "sp=8")
    axes = bench.parse_mesh(mesh)
    shape = LayerShape(1, args.seq, args.heads, args.kv_heads, args.head_dim,
                       dtype=args.dtype, causal=not args.no_causal)
    kwargs = {k: _value(v) for k, v in (kw.split("=", 1) for kw in args.kw)}
    options = {k: _value(v) for k, v in (o.split("=", 1) for o in args.opt)}
    results = []
    for mode in (("fwd", "fwd_bwd") if args.mode == "both" else (args.mode,)):
        r = measure(args.target, args.strategy, axes, shape, kernel=args.kernel, mode=mode,
                    kwargs=kwargs, options=options, target_options=not args.no_target_options)
        results.append(r)
        print(f"{args.target} {args.strategy} {mesh} {kwargs or ''} {options or ''} {mode}: "
              f"hidden {100 * r['hidden']:.1f}% of {r['total_mib']:.1f} MiB, temp "
              f"{r['temp_mib']:.1f} MiB, async {r['async_pairs']} ({r['enclosing']} enclose a "
              f"kernel), compile {r['seconds']:.0f} s", flush=True)
        if args.rows:
            for row in r["rows"]:
                print(f"    {row['kind']:<18} {row['mib']:8.2f} MiB x{row['runs']:<3g} "
                      f"{'async' if row['is_async'] else 'sync '} "
                      f"{'KERNEL' if row['kernel'] else '      '} {row['enclosed']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
