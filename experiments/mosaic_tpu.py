"""The Mosaic kernel compiled for TPU pods from a CPU-only host (compiled, not run).

Needs libtpu (``pip install "jax[tpu]==<installed jax>"``); no TPU. Three reports:

* ``strategies``: every strategy, forward+backward through the global API, with
  the XLA kernel and with ``kernel="mosaic"``: per-device memory, number of
  Mosaic kernels in the program, compile time;
* ``kernel``: the kernel alone (forward+backward) for several head dims;
* ``splash``: our kernel next to JAX's splash attention on the same shape:
  per-device memory, compiled program size and each kernel's scoped VMEM estimate.

Examples::

    python experiments/mosaic_tpu.py strategies --target v5p:2x2x2 --seq 32768
    python experiments/mosaic_tpu.py kernel --target v5e:2x4 --head-dims 128,256,576/512
    python experiments/mosaic_tpu.py splash --target v5p:2x2x2 --seq 8192

Paper: FlashAttention-2, arXiv:2307.08691.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'
MIB = 2**20


def tpu_mesh(name: str, shape=None, axis_names=("sp",)):
    """A compile-only ``Mesh`` of the TPU topology ``name`` (e.g. ``"v5p:2x2x2"``)."""
    from jax.experimental import topologies

    devices = np.array(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    return jax.sharding.Mesh(devices.reshape(shape or (devices.size,)), axis_names)


def head_dims(text: str):
    """``"128,576/512"`` -> ``[(128, 128), (576, 512)]`` (``Dqk/Dv``)."""
    pairs = []
    for item in text.split(","):
        d_qk, _, d_v = item.partition("/")
        pairs.append((int(d_qk), int(d_v or d_qk)))
    return pairs


def compile_report(fn, args):
    """Compile ``fn(*args)`` for TPU; memory per device, Mosaic calls, program size."""
    start = time.perf_counter()
    compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    return {
        "compile_s": seconds,
        "temp_mib": memory.temp_size_in_bytes / MIB,
        "argument_mib": memory.argument_size_in_bytes / MIB,
        "output_mib": memory.output_size_in_bytes / MIB,
        "code_kib": memory.generated_code_size_in_bytes / 1024,
        "mosaic_calls": text.count(MOSAIC_CALL),
        "text": text,
    }


def strategy_args(mesh, axes, *, batch, seq, heads, kv_heads, d_qk, d_v, dtype):
    spec = NamedSharding(mesh, P(None, axes))
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=spec) for shape in (
        (batch, seq, heads, d_qk), (batch, seq, kv_heads, d_qk), (batch, seq, kv_heads, d_v))]


def strategy_fn(mesh, axes, strategy, kernel, causal=True):
    """Forward+backward of ``sum(attention(q, k, v))`` through the global API."""
    import jax_seqpar as sp

    attend = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=axes,
                               strategy=strategy, kernel=kernel, causal=causal)
    return jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


def strategy_mesh(target, strategy):
    if strategy == "hybrid":
        return tpu_mesh(target, (2, -1), ("dcn", "ici")), ("dcn", "ici")
    return tpu_mesh(target), "sp"


def kernel_fn(module_name, *, causal=True, block_sizes=None):
    """Forward+backward of one kernel call on ``[B, S, H, D]`` inputs."""
    from jax_seqpar import kernels
    from jax_seqpar.core.masks import MaskSpec, Tokens
    from jax_seqpar.kernels import make_options

    module = kernels.get(module_name)

    def fn(q, k, v):
        tokens = Tokens(jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2]))

        def loss(q, k, v):
            out, lse = module.attention(q, k, v, tokens, tokens, make_options(
                q, MaskSpec.make(causal), kernel=module_name, block_sizes=block_sizes))
            return out.sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return fn


def splash_fn(heads, seq, causal=True, block=None):
    """Forward+backward of JAX's splash attention (MHA/GQA layout ``[H, S, D]`` per batch
    row); ``block``: one tile size for all its kernels (None: its defaults, 128)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as splash_mask)

    mask_type = splash_mask.CausalMask if causal else splash_mask.FullMask
    mask = splash_mask.MultiHeadMask([mask_type((seq, seq)) for _ in range(heads)])
    sizes = None if block is None else splash.BlockSizes(*([block] * 8))

    def fn(q, k, v):
        make = (splash.make_splash_mqa_single_device if k.shape[2] == 1
                else splash.make_splash_mha_single_device)
        kernel = make(mask, block_sizes=sizes)

        def loss(q, k, v):
            q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, H, S, D]
            scale = q.shape[-1] ** -0.5
            if k.shape[1] == 1:
                k, v = k[:, 0], v[:, 0]
            out = jax.vmap(kernel)(q * scale, k, v)
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return fn


def vmem_estimate(text: str):
    """Scoped VMEM each Mosaic call of a compiled program asks for, if the HLO says."""
    return [int(x) for x in re.findall(r'"vmem_limit_bytes":"?(\d+)', text)]


def _print_row(label, report):
    print(f"{label:<34} temp {report['temp_mib']:9.1f} MiB  args {report['argument_mib']:8.1f} MiB"
          f"  out {report['output_mib']:8.1f} MiB  code {report['code_kib']:7.0f} KiB"
          f"  mosaic x{report['mosaic_calls']}  {report['compile_s']:5.1f} s", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", choices=("strategies", "kernel", "splash"))
    parser.add_argument("--target", default="v5p:2x2x2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--strategies", default="ring,ulysses,allgather,hybrid")
    parser.add_argument("--kernels", default="xla,mosaic")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    # Compile-only: no backend but the host's; several such processes may load
    # libtpu at once on a shared host. (Set before JAX starts a backend.)
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    dtype = jnp.dtype(args.dtype)
    print(f"compiled for {args.target}, not run: B={args.batch} S={args.seq} H={args.heads} "
          f"Hkv={args.kv_heads} {args.dtype} causal, forward+backward; memory per device")
    for d_qk, d_v in head_dims(args.head_dims):
        shape = dict(batch=args.batch, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads,
                     d_qk=d_qk, d_v=d_v, dtype=dtype)
        if args.report == "strategies":
            for strategy in args.strategies.split(","):
                mesh, axes = strategy_mesh(args.target, strategy)
                inputs = strategy_args(mesh, axes, **shape)
                for kernel in args.kernels.split(","):
                    report = compile_report(strategy_fn(mesh, axes, strategy, kernel), inputs)
                    _print_row(f"{strategy} D={d_qk}/{d_v} kernel={kernel}", report)
            continue
        mesh = tpu_mesh(args.target)
        one_chip = NamedSharding(jax.sharding.Mesh(mesh.devices.flat[:1], ("x",)), P())
        inputs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_chip)
                  for x in strategy_args(mesh, "sp", **shape)]
        from jax_seqpar.kernels.tpu import mosaic

        candidates = {"mosaic": kernel_fn("mosaic")}
        if args.report == "splash":
            candidates["mosaic tiles 128"] = kernel_fn(
                "mosaic", block_sizes=mosaic.BlockSizes(128, 128, 128, 128))
            candidates["splash (default tiles 128)"] = splash_fn(args.heads, args.seq)
            candidates["splash tiles 512"] = splash_fn(args.heads, args.seq, block=512)
        for name, fn in candidates.items():
            report = compile_report(fn, inputs)
            _print_row(f"{name} D={d_qk}/{d_v}", report)
            limits = vmem_estimate(report["text"])
            if limits:
                print(f"  vmem_limit_bytes per Mosaic call: {limits}")


if __name__ == "__main__":
    main()
