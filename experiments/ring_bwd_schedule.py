"""Does the ring backward's dK/dV hop overlap the next step's kernel? Read the schedule.

Compiles the ring's forward + backward (``jax.value_and_grad`` of a sum, causal,
``[1, S, 8, 64]`` float32, XLA kernel) and prints, for every computation holding a
collective-permute, the scheduled order of the permutes' start/done and the kernel
loops (``while``), plus XLA's temp memory per device. A GPU program is scheduled
(text order = execution order) and has asynchronous ``collective-permute-start`` /
``-done`` pairs: a kernel ``while`` between a start and its done runs while that
hop is in flight. The CPU backend emits synchronous permutes (no pairs), so it only
gives the memory.

    python experiments/ring_bwd_schedule.py --seq 16384                    # CPU, 8 devices
    python experiments/ring_bwd_schedule.py --seq 4096 \\
        --gpu-target-config jax_seqpar/gpu_targets/h100_sxm.txtpb          # 8 x H100, deviceless

(the GPU form needs the CUDA plugin, e.g. the ``[aot]`` extra, and no GPU.)
"""

from __future__ import annotations

import argparse
import functools
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_seqpar as sp  # noqa: E402
from jax_seqpar.tools import hlo  # noqa: E402

_EVENT = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) (collective-permute-start|"
                    r"collective-permute-done|collective-permute|while)\(")


def schedule(text: str) -> list[str]:
    """Lines ``op name shape`` of the permutes and loops, per computation, in text order."""
    lines = []
    for computation in re.split(r"\n(?=\S)", text):
        if "collective-permute" not in computation:
            continue
        lines.append("== " + computation.split("\n", 1)[0][:60])
        for line in computation.split("\n")[1:]:
            match = _EVENT.match(line)
            if match:
                shape = re.sub(r"\{[^}]*\}", "", match.group(2))[:80]
                lines.append(f"   {match.group(3):26s} {match.group(1):28s} {shape}")
    return lines


def _mesh(gpu_target_config):
    if gpu_target_config is None:
        return Mesh(np.array(jax.devices()[:8]), ("sp",))
    from jax.experimental import topologies

    with open(gpu_target_config) as f:
        config = f.read()
    topology = topologies.get_topology_desc(platform="cuda", topology_name="gpu",
                                            target_config=config, topology="1x1x8")
    return topologies.make_mesh(topology, (8,), ("sp",))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--gpu-target-config", default=None,
                        help="a GpuTargetConfigProto text file: compile for 8 such GPUs")
    args = parser.parse_args(argv)
    mesh = _mesh(args.gpu_target_config)
    spec = P(None, "sp")
    attend = jax.shard_map(functools.partial(sp.ring_attention, seq_axes="sp", causal=True,
                                             kernel="xla"),
                           mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    x = jax.ShapeDtypeStruct((1, args.seq, 8, 64), jnp.float32,
                             sharding=NamedSharding(mesh, spec))
    loss = lambda q, k, v: jnp.sum(attend(q, k, v))  # noqa: E731
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    print("\n".join(schedule(compiled.as_text())))
    print(f"temp bytes per device: {hlo.memory_bytes(compiled)['temp']:,}")


if __name__ == "__main__":
    main()
