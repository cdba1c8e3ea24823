"""Decode against a sequence-sharded KV cache: per-token latency and per-device memory.

Makes the decode table (per-token latency and per-device memory vs cache length) and the
compiled 1M-token number for 8 H100s that the README's inference section quotes
(``docs/inference.md``).

For a Llama-3-8B-shaped attention layer (32 query heads, 8 KV heads, head_dim 128,
bfloat16 cache, batch 1, one new token per step) and growing cache lengths:

* ``sharded``: :func:`jax_seqpar.api.inference.decode` with the cache split over the 8
  devices (round-robin slots; one ``pmax`` and two ``psum`` s per token);
* ``one device``: the same decode with the whole (gathered) cache on one device.

Per-device memory is ``memory_analysis()`` of the compiled step (arguments, i.e.
the cache shard, plus temporaries): deterministic, so it is reported for every
length; latency is the median wall time of a donated (in-place) step, run only
up to ``--max-run`` tokens. On emulated CPU devices the 8 shards share the host's
cores: the latency shows the local work, not a network.

``--target h100:8`` instead compiles (does not run) the sharded step for 8 H100s
with XLA:GPU, deviceless (needs the CUDA plugin: ``jax[cuda12]``), kernel="xla",
and reports memory per device. Commands::

    PYTHONPATH=. python experiments/decode_bench.py
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. \\
        /path/to/cuda-venv/bin/python experiments/decode_bench.py --target h100:8 --lengths 1048576
"""

import argparse
import functools
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_seqpar.tools import hlo
from jax_seqpar.api import inference  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B attention
_MIB = 2**20

# The H100 SXM's facts XLA:GPU compiles against (a GpuTargetConfigProto).
H100_TARGET_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 1 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def _specs(mesh, batch, capacity, dtype):
    """Abstract arguments of one decode step: new q, k, v and a full cache."""
    seq, rep = NamedSharding(mesh, P(None, "sp")), NamedSharding(mesh, P())
    struct = jax.ShapeDtypeStruct
    new = lambda heads: struct((batch, 1, heads, HEAD_DIM), dtype, sharding=rep)
    cache = inference.KVCache(
        k=struct((batch, capacity, KV_HEADS, HEAD_DIM), dtype, sharding=seq),
        v=struct((batch, capacity, KV_HEADS, HEAD_DIM), dtype, sharding=seq),
        positions=struct((batch, capacity), jnp.int32, sharding=seq),
        length=struct((batch,), jnp.int32, sharding=rep), mesh=mesh, seq_axes=("sp",))
    return new(HEADS), new(KV_HEADS), new(KV_HEADS), cache


def _full_cache(mesh, batch, capacity, length, dtype):
    """A cache holding positions ``0 .. length-1`` round-robin, random K/V (made sharded)."""
    shards = mesh.shape["sp"]
    seq = NamedSharding(mesh, P(None, "sp"))

    @functools.partial(jax.jit, out_shardings=(seq, seq, seq))
    def make():
        k = jax.random.normal(jax.random.key(0), (batch, capacity, KV_HEADS, HEAD_DIM), dtype)
        v = jax.random.normal(jax.random.key(1), (batch, capacity, KV_HEADS, HEAD_DIM), dtype)
        slot = jnp.arange(capacity, dtype=jnp.int32)  # shard r, local slot a: a * P + r
        per_shard = capacity // shards
        position = (slot % per_shard) * shards + slot // per_shard
        position = jnp.where(position < length, position, inference.EMPTY_POSITION)
        return k, v, jnp.broadcast_to(position, (batch, capacity))

    k, v, positions = make()
    length = jax.device_put(jnp.full((batch,), length, jnp.int32), NamedSharding(mesh, P()))
    return inference.KVCache(k, v, positions, length, mesh=mesh, seq_axes=("sp",))


def _step(kernel):
    return jax.jit(lambda q, k, v, cache: inference.decode(q, k, v, cache, kernel=kernel),
                   donate_argnums=3)


def _memory(compiled):
    memory = hlo.memory_bytes(compiled)
    return memory["argument"] / _MIB, memory["temp"] / _MIB


def run_cpu(lengths, max_run, steps, kernel):
    devices = np.array(jax.devices())
    meshes = {"sharded": Mesh(devices, ("sp",), axis_types=(jax.sharding.AxisType.Explicit,)),
              "one device": Mesh(devices[:1], ("sp",),
                                 axis_types=(jax.sharding.AxisType.Explicit,))}
    dtype = jnp.bfloat16
    print(f"decode, 1 new token, batch 1, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, bf16 cache, "
          f"kernel={kernel}, {len(devices)} {devices[0].platform} devices")
    header = (f"{'cache tokens':>12} | {'sharded ms/tok':>14} {'arg MiB/dev':>11} "
              f"{'temp MiB/dev':>12} {'sent B/tok':>10} | {'1-dev ms/tok':>12} "
              f"{'arg MiB/dev':>11} {'temp MiB/dev':>12}")
    print(header)
    print("-" * len(header))
    for length in lengths:
        capacity = length + 8 * steps + 64
        row = [f"{length:>12}"]
        for name, mesh in meshes.items():
            step = _step(kernel)
            compiled = step.lower(*_specs(mesh, 1, capacity, dtype)).compile()
            argument, temp = _memory(compiled)
            latency = "-"
            if length <= max_run:
                cache = _full_cache(mesh, 1, capacity, length, dtype)
                new = [jax.device_put(jnp.ones(s.shape, s.dtype), s.sharding)
                       for s in _specs(mesh, 1, capacity, dtype)[:3]]
                times = []
                for index in range(steps + 2):
                    start = time.perf_counter()
                    out, cache = compiled(*new, cache)
                    out.block_until_ready()
                    if index >= 2:  # the first calls warm up
                        times.append(time.perf_counter() - start)
                latency = f"{1e3 * statistics.median(times):.2f}"
                del cache
            row.append(f"{latency:>14} {argument:>11.1f} {temp:>12.1f}" if name == "sharded"
                       else f"{latency:>12} {argument:>11.1f} {temp:>12.1f}")
            if name == "sharded":
                sent = sum(hlo.collective_bytes(compiled).values())
                row[-1] += f" {sent:>10.0f}"
        print(row[0] + " | " + row[1] + " | " + row[2], flush=True)


def run_h100(lengths):
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", topology_name="h100",
                                            target_config=H100_TARGET_CONFIG, topology="1x1x8")
    devices = np.array(topology.devices)
    print(f"compiled for {topology.devices[0].device_kind}, not run; decode, 1 new token, "
          f"batch 1, H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, bf16 cache, kernel=xla")
    for length in lengths:
        for name, mesh in (("8 GPUs, sharded", Mesh(devices, ("sp",))),
                           ("1 GPU, whole cache", Mesh(devices[:1], ("sp",)))):
            start = time.perf_counter()
            traced = _step("xla").trace(*_specs(mesh, 1, length, jnp.bfloat16))
            compiled = traced.lower(lowering_platforms=("cuda",)).compile()
            argument, temp = _memory(compiled)
            sent = sum(hlo.collective_bytes(compiled).values())
            shard_mib = 2 * length * KV_HEADS * HEAD_DIM * 2 / mesh.size / _MIB
            print(f"{length:>9} cache tokens, {name}: per device {argument:.1f} MiB arguments "
                  f"(cache {shard_mib:.1f} MiB) + {temp:.1f} MiB temp; {sent:.0f} bytes sent "
                  f"per token; compiled in {time.perf_counter() - start:.1f} s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4096, 16384, 65536, 262144, 1048576],
                        help="comma-separated cache lengths")
    parser.add_argument("--max-run", type=int, default=262144,
                        help="run (not only compile) up to this cache length")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps")
    parser.add_argument("--kernel", default="xla", help="local kernel")
    parser.add_argument("--target", default="cpu", choices=("cpu", "h100:8"))
    args = parser.parse_args(argv)
    if args.target == "h100:8":
        run_h100(args.lengths)
    else:
        run_cpu(args.lengths, args.max_run, args.steps, args.kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
