"""One of two processes of a hybrid-attention run across a process boundary.

Usage: python hybrid_two_process.py PORT PROCESS_ID. Each process has 4 emulated CPU
devices; the ("dcn", "ici") = (2, 4) mesh puts the ring axis across the processes.
Exits non-zero (with a message) if any local output or gradient shard differs from
the reference.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def main(port: int, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    import jax_seqpar as sp
    from jax_seqpar.core import reference

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    devices = np.array(jax.devices()).reshape(2, 4)
    if {d.process_index for d in devices[process_id]} != {process_id}:
        raise SystemExit("the dcn axis does not follow the process boundary")
    mesh = jax.sharding.Mesh(devices, ("dcn", "ici"))
    batch, seq, heads, kv_heads, dim = 1, 64, 8, 2, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dim))
    weights = jax.random.normal(keys[3], q.shape)
    sharding = NamedSharding(mesh, P(None, ("dcn", "ici")))

    def shard(x):
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def loss(q, k, v, weights):
        out = sp.sequence_parallel_attention(q, k, v, mesh=mesh, seq_axes=("dcn", "ici"),
                                             strategy="hybrid", causal=True)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        shard(q), shard(k), shard(v), shard(weights))
    expected = reference.attention(q, k, v, causal=True)
    expected_grads = jax.grad(
        lambda q, k, v: jnp.sum(reference.attention(q, k, v, causal=True) * weights),
        argnums=(0, 1, 2))(q, k, v)
    checked = 0
    for got, want in [(out, expected), *zip(grads, expected_grads)]:
        for piece in got.addressable_shards:
            np.testing.assert_allclose(np.asarray(piece.data), np.asarray(want[piece.index]),
                                       atol=2e-5, rtol=2e-5)
            checked += 1
    print(f"process {process_id}: {checked} local shards match the reference", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
