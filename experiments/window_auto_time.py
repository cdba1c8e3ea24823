"""What ``strategy="auto"`` picks for a window on the 8-device CPU mesh, timed against the
halo ring and Ulysses (issue 41): B=1, S=8192 (``S=`` in the environment), H=8, D=64,
bf16, causal, ``window=(1024, 0)``, ``kernel="xla"``, jitted, sequence-sharded inputs;
the median and the minimum of 5 calls after one to compile, forward and forward+backward.

Run: ``JAX_PLATFORMS=cpu python experiments/window_auto_time.py``
"""
import os, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_seqpar as sp

B, S, H, D = 1, int(os.environ.get("S", 8192)), 8, 64
mesh = jax.make_mesh((8,), ("sp",))
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16) for _ in range(3))
with jax.set_mesh(mesh):
    q, k, v = (jax.reshard(x, P(None, "sp")) for x in (q, k, v))
    for strategy in ("ulysses", "ring", "auto"):
        def loss(q, k, v, strategy=strategy):
            out = sp.sequence_parallel_attention(q, k, v, mesh=mesh, seq_axes="sp", causal=True,
                                                 window=(1024, 0), strategy=strategy, kernel="xla")
            return jnp.sum(out.astype(jnp.float32) ** 2)
        fwd = jax.jit(lambda q, k, v, s=strategy: sp.sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes="sp", causal=True, window=(1024, 0), strategy=s, kernel="xla"))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        for name, fn in (("fwd", fwd), ("fwd+bwd", step)):
            jax.block_until_ready(fn(q, k, v))
            times = []
            for _ in range(5):
                t = time.perf_counter(); jax.block_until_ready(fn(q, k, v)); times.append(time.perf_counter() - t)
            print(f"{strategy:8s} {name:8s} median {np.median(times)*1e3:8.1f} ms  min {min(times)*1e3:8.1f} ms", flush=True)
