"""Issue 22: which XLA:TPU options make all-to-all / all-gather asynchronous and hidden?

Compiles (deviceless, for v5p:2x2x2) two small pipelines that have a kernel to hide
a collective behind, each under subsets of ``jax_seqpar.tools.targets.compile_options("tpu")``
(every strategy's options), and prints per collective whether it is asynchronous and
encloses a kernel (``jax_seqpar.tools.schedule.collective_schedule``):

* ``a2a``: Ulysses over 2 head groups: group 1's q/k/v all-to-all can hide behind group
  0's kernel, group 0's output all-to-all behind group 1's kernel;
* ``gather``: all-gather attention over 2 key pieces (K and V of a piece stacked: one
  collective per piece): piece 1's all-gather can hide behind piece 0's kernel.

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD nice -n 10 python experiments/tpu_async_options.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_seqpar.core.masks import MaskSpec, Tokens  # noqa: E402
from jax_seqpar.kernels import make_options  # noqa: E402
from jax_seqpar.kernels.tpu import mosaic  # noqa: E402
from jax_seqpar.tools import aot, hlo, schedule, targets  # noqa: E402

S, H, D, DEVICES = 16384, 16, 128, 8
SPEC = MaskSpec()


def _tokens(n):
    return Tokens(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (1, n)))


def _attend(q, k, v, accumulate=None):
    n = k.shape[1]
    return mosaic.forward(q, k, v, _tokens(q.shape[1]), _tokens(n),
                          make_options(q, SPEC, scale=D**-0.5, kernel="mosaic"), accumulate)


def a2a(q, k, v):  # local [1, S/P, H, D]
    outs, groups = [], 2
    per = H // groups
    arrived = [tuple(jax.lax.all_to_all(x[:, :, g * per:(g + 1) * per], "sp", 2, 1, tiled=True)
                     for x in (q, k, v)) for g in range(groups)]
    for qg, kg, vg in arrived:  # [1, S, H/(groups P), D]
        out = _attend(qg, kg, vg)[0].astype(q.dtype)
        outs.append(jax.lax.all_to_all(out, "sp", 1, 2, tiled=True))
    return jnp.concatenate(outs, axis=2)


def gather(q, k, v):
    pieces, half = 2, k.shape[1] // 2
    result = None
    stacked = [jnp.stack([k[:, c * half:(c + 1) * half], v[:, c * half:(c + 1) * half]])
               for c in range(pieces)]
    gathered = [jax.lax.all_gather(x, "sp", axis=2, tiled=True) for x in stacked]
    for kv in gathered:
        result = _attend(q, kv[0], kv[1], result)
    return result[0].astype(q.dtype)


PROGRAMS = {"a2a": a2a, "gather": gather}


def compile_program(name, options):
    mesh = targets.target_mesh("v5p:2x2x2")
    fn = jax.shard_map(PROGRAMS[name], mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                       out_specs=P(None, "sp"), check_vma=False)
    sharding = NamedSharding(mesh, P(None, "sp"))
    args = [jax.ShapeDtypeStruct((1, S, H, D), jnp.bfloat16, sharding=sharding)] * 3
    return aot.compile_for(fn, args, "tpu", compiler_options=options).compiled


def main(argv):
    names = argv or list(PROGRAMS)
    library = targets.compile_options("tpu")  # every strategy's
    for name in names:
        variants = {"none": {}, "library": library}
        for key in library:
            variants[f"library - {key}"] = dict(library, **{key: None})
        for label, options in variants.items():
            compiled = compile_program(name, options)
            rows = schedule.collective_schedule(compiled)
            hidden = schedule.bytes_hidden(compiled)
            cells = " ".join(f"{r.kind}:{'A' if r.is_async else 'S'}"
                             f"{'K' if r.encloses_kernel else ''}" for r in rows)
            print(f"{name:6s} {label:70s} hidden {100 * hidden['fraction']:5.1f}% temp "
                  f"{hlo.memory_bytes(compiled)['temp'] / 2**20:6.1f} MiB  {cells}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
