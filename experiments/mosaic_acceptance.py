"""Ring and Ulysses forward+backward through the global API with kernel="auto", compiled
(not run) for TPU v5e:2x4, v5p:2x2x2 and v6e:2x4 at D=128, D=256 and MLA 576/512: each
program must carry the Mosaic kernels (``tpu_custom_call``). Needs the [aot] extra.

    JAX_PLATFORMS=cpu python experiments/mosaic_acceptance.py
"""
import functools
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_seqpar as sp
from jax_seqpar.tools import aot, hlo, targets

S = 4096
for target in ("v5e:2x4", "v5p:2x2x2", "v6e:2x4"):
    mesh = targets.target_mesh(target, ("sp",))
    seq = NamedSharding(mesh, P(None, "sp"))
    for strategy in ("ring", "ulysses"):
        for dqk, dv, heads, kv in ((128, 128, 16, 4), (256, 256, 16, 4), (576, 512, 16, 1)):
            shapes = [jax.ShapeDtypeStruct((1, S, h, d), jnp.bfloat16, sharding=seq)
                      for h, d in ((heads, dqk), (kv, dqk), (kv, dv))]
            f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy=strategy,
                                  causal=True, kernel="auto")
            def fwd_bwd(q, k, v):
                out, vjp = jax.vjp(f, q, k, v)
                return out, vjp(out)
            start = time.perf_counter()
            try:
                program = aot.compile_for(fwd_bwd, shapes, "tpu")
                calls = hlo.kernel_calls(program.compiled)
                mem = hlo.memory_bytes(program.compiled)["temp"] / 2**20
                ok = any(c.startswith("mosaic:") for c in calls)
                print(f"{target:10s} {strategy:8s} {dqk}/{dv}: {'OK' if ok else 'NO MOSAIC'} "
                      f"calls={sorted(calls)} temp={mem:.1f} MiB {time.perf_counter()-start:.0f}s",
                      flush=True)
            except Exception as e:
                print(f"{target:10s} {strategy:8s} {dqk}/{dv}: FAIL {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
