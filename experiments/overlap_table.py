"""The bytes-hidden / temp-memory table, before and after, at one shape.

``dump --program loss`` compiles what a training step compiles: ``jax.grad`` of a scalar
loss of the global ``sequence_parallel_attention(..., positions=...)`` (tokens kept in
the strategy's order, no relayout), with ``--overlap false|auto|true`` (Ulysses / hybrid;
``true``: the sequence-chunk pipeline);
``--program vjp`` (default) the per-shard program with a given cotangent of
``bench_target.compile_strategy``.

Two steps, so that "before" can be compiled by another checkout of the library (one
whose ``jax_seqpar.tools.hlo`` may not yet read schedules):

1. ``dump``: compile each (target, strategy, mode) with that checkout's
   ``bench_target.compile_strategy`` (the library's target compile: its compiler
   options included) and write the optimized HLO text and ``memory_analysis`` to DIR.
2. ``report``: read DIR with THIS checkout's :mod:`jax_seqpar.tools.hlo` and print
   bytes hidden, async collectives (those enclosing a kernel) and temp per device.

    export JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
    PYTHONPATH=<checkout> nice -n 10 python experiments/overlap_table.py dump DIR \\
        --targets h100:8,v5p:2x2x2 --strategies ring,ulysses,allgather,hybrid --seq 16384
    PYTHONPATH=$PWD python experiments/overlap_table.py report DIR [DIR2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

MESHES = {"hybrid": {"dcn": 2, "ici": 4}}


def loss_program(target, strategy, axes, shape, *, backward, overlap="auto"):
    """``jax.grad`` of a loss of the global call (``backward``) or the call alone, with
    zigzag (causal) positions, compiled with the strategy's target options."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_seqpar as sp
    from jax_seqpar.tools import aot, targets

    mesh = targets.target_mesh(target, tuple(axes), tuple(axes.values()))
    seq_axes = tuple(axes) if len(axes) > 1 else tuple(axes)[0]
    sharding = NamedSharding(mesh, P(None, tuple(axes)))
    args = [jax.ShapeDtypeStruct(size, shape.dtype, sharding=sharding)
            for size in shape.operand_shapes()[:3]]
    args.append(jax.ShapeDtypeStruct((shape.batch, shape.seq_len), jnp.int32,
                                     sharding=sharding))
    extra = {} if overlap == "auto" else dict(overlap=overlap)

    def attend(q, k, v, positions):
        return sp.sequence_parallel_attention(q, k, v, mesh=mesh, seq_axes=seq_axes,
                                              strategy=strategy, causal=shape.causal,
                                              positions=positions, **extra)

    def loss(q, k, v, positions):
        return jnp.mean(jnp.square(attend(q, k, v, positions).astype(jnp.float32)))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else attend
    platform = targets.target_platform(target)
    return aot.compile_for(fn, args, platform,
                           compiler_options=targets.compile_options(platform, strategy))


def dump(args):
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.tools import bench, bench_target, hlo

    os.makedirs(args.dir, exist_ok=True)
    shape = LayerShape(batch=1, seq_len=args.seq, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                       dtype="bfloat16", causal=True)
    for target in args.targets.split(","):
        for strategy in args.strategies.split(","):
            for mode in args.modes.split(","):
                name = (f"{target.replace(':', '_')}-{strategy}-{args.kernel}-{args.seq}-{mode}"
                        f"{dict(auto='', false='-serial', true='-pieces')[args.overlap]}")
                path = os.path.join(args.dir, name)
                if os.path.exists(path + ".json"):
                    continue
                start = time.perf_counter()
                axes = MESHES.get(strategy, {"sp": 8})
                if args.program == "loss":
                    program = loss_program(target, strategy, axes, shape,
                                           backward=mode == "fwd_bwd",
                                           overlap=dict(auto="auto", false=False,
                                                        true=True)[args.overlap])
                else:
                    program = bench_target.compile_strategy(
                        target, bench.Case(strategy, axes, shape, args.kernel),
                        backward=mode == "fwd_bwd")[mode]
                with open(path + ".hlo", "w") as f:
                    f.write(program.compiled.as_text())
                memory = hlo.memory_bytes(program.compiled)
                with open(path + ".json", "w") as f:
                    json.dump(dict(target=target, strategy=strategy, kernel=args.kernel,
                                   seq=args.seq, mode=mode, memory=memory,
                                   overlap=args.overlap, program=args.program,
                                   compile_s=time.perf_counter() - start), f)
                print(f"{name}: temp {memory['temp'] / 2**20:.1f} MiB "
                      f"[{time.perf_counter() - start:.0f} s]", flush=True)


def summary(path):
    from jax_seqpar.tools import schedule

    with open(path + ".json") as f:
        meta = json.load(f)
    with open(path + ".hlo") as f:
        text = f.read()
    rows = schedule.collective_schedule(text)
    hidden = schedule.bytes_hidden(text)
    asyncs = [r for r in rows if r.is_async]
    return meta, dict(temp=meta["memory"]["temp"] / 2**20, hidden=hidden,
                      n_async=len(asyncs), n_kernel=sum(r.encloses_kernel for r in asyncs),
                      n_sync=len(rows) - len(asyncs), rows=rows)


def report(args):
    table = {}
    for directory in args.dirs:
        for file in sorted(os.listdir(directory)):
            if file.endswith(".json"):
                meta, s = summary(os.path.join(directory, file[:-5]))
                key = (meta["target"], meta["strategy"], meta["kernel"], meta["seq"],
                       meta.get("overlap", "auto"))
                table.setdefault(key, {})[(directory, meta["mode"])] = s
                if args.rows:
                    print(f"# {directory} {key} {meta['mode']}")
                    for r in s["rows"]:
                        print(f"  {'A' if r.is_async else 'S'} {r.kind:18s} "
                              f"{r.bytes / 2**20:8.2f} MiB x{r.runs:<3g} "
                              f"{'KERNEL' if r.encloses_kernel else '      '} "
                              f"{' '.join(r.enclosed)[:90]}")
    print("| target | strategy | kernel | S | overlap | checkout | fwd async (kernel) + sync | fwd hidden "
          "| fwd temp MiB | f+b async (kernel) + sync | f+b hidden | f+b temp MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, modes in sorted(table.items()):
        for directory in args.dirs:
            cells = []
            for mode in ("fwd", "fwd_bwd"):
                s = modes.get((directory, mode))
                if s is None:
                    cells += ["", "", ""]
                    continue
                h = s["hidden"]
                cells += [f"{s['n_async']} ({s['n_kernel']}) + {s['n_sync']}",
                          f"{100 * h['fraction']:.1f}% of {h['total'] / 2**20:.1f} MiB",
                          f"{s['temp']:.1f}"]
            print("| " + " | ".join([*map(str, key), os.path.basename(directory.rstrip("/")),
                                     *cells]) + " |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("dir")
    d.add_argument("--targets", default="h100:8,v5p:2x2x2")
    d.add_argument("--strategies", default="ring,ulysses,allgather,hybrid")
    d.add_argument("--modes", default="fwd,fwd_bwd")
    d.add_argument("--seq", type=int, default=16384)
    d.add_argument("--heads", type=int, default=16)
    d.add_argument("--kv-heads", type=int, default=4)
    d.add_argument("--head-dim", type=int, default=128)
    d.add_argument("--kernel", default="auto")
    d.add_argument("--program", choices=("vjp", "loss"), default="vjp")
    d.add_argument("--overlap", choices=("auto", "false", "true"), default="auto")
    r = sub.add_parser("report")
    r.add_argument("dirs", nargs="+")
    r.add_argument("--rows", action="store_true")
    args = parser.parse_args(argv)
    dump(args) if args.command == "dump" else report(args)


if __name__ == "__main__":
    sys.exit(main())
