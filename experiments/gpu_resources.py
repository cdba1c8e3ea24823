"""Compile the Pallas kernels for H100 / A100 on a CPU host and tabulate their resources.

Makes the README's table of the Pallas kernels' compiled resources (registers, shared
memory, occupancy per head dim; ``docs/kernels.md``), with the command below plus
``--spills-as-errors``.

Deviceless ahead-of-time compilation: a compile-only GPU from a target description
(``jax.experimental.topologies``), XLA:GPU with Triton -> PTX -> ptxas, no GPU needed.
Per kernel (forward, dq, dk/dv) it reports registers per thread and spill bytes
(``ptxas -v`` on the PTX that XLA dumps), threads, grid and shared memory (XLA's
thunk sequence), the estimated occupancy (warps an SM holds / 64), or the compile error (shared memory over the limit, or a spill
when ``--spills-as-errors``).

Needs the CUDA plugin and the nvcc wheel (``pip install "jax[cuda12]==<jax version>"``)::

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. \\
      python experiments/gpu_resources.py --target h100 a100 --dtype bfloat16

The target descriptions below are the fields of XLA's ``GpuTargetConfigProto`` that
code generation reads (from the public spec sheets: SM count, shared memory per
block opt-in, registers per block, compute capability).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_seqpar.kernels import make_options  # noqa: E402
from jax_seqpar.kernels.gpu import pallas  # noqa: E402
from jax_seqpar.core.masks import MaskSpec, Tokens  # noqa: E402

_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {smem_core} threads_per_core_limit: 2048 core_count: {sms}
  fpus_per_core: {fpus} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: {l2}
  clock_rate_ghz: {clock} device_memory_size: {hbm}
  shared_memory_per_block_optin: {smem_block}
  cuda_compute_capability {{ major: {major} minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 patch: 0 }}
device_description_str: "{name}"
"""

#: Compile-only GPUs: H100 SXM (sm_90) and A100 SXM 80GB (sm_80).
TARGETS = {
    "h100": _TARGET.format(smem_core=233472, sms=132, fpus=128, bandwidth=3352320000000,
                           l2=52428800, clock=1.98, hbm=84942979072, smem_block=232448,
                           major=9, name="NVIDIA H100 80GB HBM3"),
    "a100": _TARGET.format(smem_core=167936, sms=108, fpus=64, bandwidth=2039040000000,
                           l2=41943040, clock=1.41, hbm=85100068864, smem_block=166912,
                           major=8, name="NVIDIA A100-SXM4-80GB"),
}
GPU_ARCH = {"h100": "sm_90a", "a100": "sm_80"}
SMEM_PER_SM = {"h100": 233472, "a100": 167936}
KERNEL_NAMES = ("seqpar_flash_forward", "seqpar_flash_dq", "seqpar_flash_dkv")
#: (Dqk, Dv) pairs the kernels must compile for: standard heads, DeepSeek's 192/128
#: and MLA absorbed 576/512.
HEAD_DIMS = [(64, 64), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256),
             (192, 128), (576, 512)]


def plugins_available() -> bool:
    """Whether the CUDA plugin (for compile-only GPUs) and ptxas are installed."""
    try:
        import jax_cuda12_plugin  # noqa: F401
    except ImportError:
        return False
    return _ptxas() is not None


def _ptxas():
    import nvidia  # the nvcc wheel
    for root in nvidia.__path__:
        path = os.path.join(root, "cuda_nvcc", "bin", "ptxas")
        if os.path.exists(path):
            return path
    return None


def device(target: str):
    """One compile-only GPU of ``target`` (``"h100"`` or ``"a100"``)."""
    from jax.experimental import topologies
    topology = topologies.get_topology_desc(
        platform="cuda", topology_name=target, target_config=TARGETS[target], topology="1x1x1")
    return topology.devices[0]


@dataclasses.dataclass
class Resources:
    """Compiled resources of one kernel (``None`` where unknown)."""

    registers: int = None
    spill_stores: int = None
    spill_loads: int = None
    shared_memory: int = None
    threads: int = None
    grid: str = None

    def occupancy(self, target: str):
        """Estimated share of the SM's 64 warp slots the kernel's blocks can hold,
        limited by registers (allocated per warp in units of 256), shared memory
        (plus 1 KiB per block the driver reserves) and threads; None if unknown."""
        if None in (self.registers, self.shared_memory, self.threads):
            return None
        warps = self.threads // 32
        per_warp = -(-self.registers * 32 // 256) * 256
        smem_core = SMEM_PER_SM[target]
        blocks = min(32, 2048 // self.threads, 65536 // (per_warp * warps),
                     smem_core // (self.shared_memory + 1024))
        return blocks * warps / 64


def attention_grads(spec: MaskSpec, block_sizes, interpret=None):
    """``(q, k, v, positions) -> (dq, dk, dv)`` through the Pallas kernels (fwd + bwd)."""

    def grads(q, k, v, positions):
        tokens = Tokens(positions)
        options = make_options(q, spec, kernel="pallas", block_sizes=block_sizes)

        def loss(q, k, v):
            out, lse = pallas.attention(q, k, v, tokens, tokens, options, interpret=interpret)
            return out.sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return grads


def compile_kernels(target: str, d_qk: int, d_v: int, dtype, *, seq=1024, heads=8,
                    kv_heads=2, causal=True, block_sizes=None, spills_as_errors=False,
                    interpret=None, dump_dir=None):
    """Compile forward + backward for ``target``; ``(seconds, {kernel: Resources})``.

    Raises the compiler's error (shared memory, or spills with ``spills_as_errors``).
    """
    from jax.sharding import SingleDeviceSharding
    sharding = SingleDeviceSharding(device(target))
    q = jax.ShapeDtypeStruct((1, seq, heads, d_qk), dtype, sharding=sharding)
    k = jax.ShapeDtypeStruct((1, seq, kv_heads, d_qk), dtype, sharding=sharding)
    v = jax.ShapeDtypeStruct((1, seq, kv_heads, d_v), dtype, sharding=sharding)
    positions = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=sharding)
    fn = attention_grads(MaskSpec.make(causal=causal), block_sizes, interpret)
    dump_dir = dump_dir or tempfile.mkdtemp(prefix="seqpar_gpu_")
    from jax_seqpar.tools import aot
    options = {**aot.PRODUCTION_CODEGEN, "xla_dump_to": dump_dir,
               "xla_gpu_fail_ptx_compilation_on_register_spilling": bool(spills_as_errors)}
    start = time.perf_counter()
    lowered = jax.jit(fn).trace(q, k, v, positions).lower(lowering_platforms=("cuda",))
    lowered.compile(compiler_options=options)
    seconds = time.perf_counter() - start
    return seconds, read_resources(dump_dir, GPU_ARCH[target])


def read_resources(dump_dir: str, arch: str) -> dict:
    """Per-kernel :class:`Resources` from an XLA dump directory."""
    found = {}
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        with open(path) as f:
            text = f.read()
        names = [n for n in KERNEL_NAMES if f".entry {n}(" in text]
        if not names:
            continue
        log = subprocess.run([_ptxas(), "-v", "--gpu-name", arch, path, "-o", os.devnull],
                             capture_output=True, text=True).stderr
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        registers = re.search(r"Used (\d+) registers", log)
        found[names[0]] = Resources(
            registers=int(registers.group(1)) if registers else None,
            spill_stores=int(spills.group(1)) if spills else None,
            spill_loads=int(spills.group(2)) if spills else None)
    for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")):
        with open(path) as f:
            for line in f:
                match = re.search(r"(seqpar_flash_\w+) grid: \[([\d, ]+)\] threads: \[(\d+)"
                                  r".*shared_memory: (\d+) bytes", line)
                if match and match.group(1) in found:
                    res = found[match.group(1)]
                    res.grid = match.group(2).replace(" ", "")
                    res.threads, res.shared_memory = int(match.group(3)), int(match.group(4))
    return found


def _percent(share) -> str:
    return "?" if share is None else f"{share:.0%}"


def _override_launch(overrides):
    """Replace the kernels' warps / stages for the kinds named (``kind:warps:stages``)."""
    from jax.experimental.pallas import triton as plgpu
    from jax_seqpar.kernels.gpu import _config as _pallas_config

    table = {kind: (int(w), int(s)) for kind, w, s in (o.split(":") for o in overrides)}
    default = _pallas_config.launch

    def launch(kind, *args):
        if kind in table:
            return plgpu.CompilerParams(num_warps=table[kind][0], num_stages=table[kind][1])
        return default(kind, *args)

    _pallas_config.launch = launch


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", nargs="+", default=["h100", "a100"], choices=list(TARGETS))
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--dims", nargs="+", default=[f"{a}/{b}" for a, b in HEAD_DIMS],
                        help="Dqk/Dv pairs, e.g. 128/128 576/512")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--spills-as-errors", action="store_true")
    parser.add_argument("--blocks", help="block sizes bq,bk,bq_bwd,bk_bwd (default: the "
                        "kernel's defaults for the head dims)")
    parser.add_argument("--launch", nargs="*", default=[],
                        help="override warps/stages per kernel, e.g. fwd:8:3 dkv:8:2")
    parser.add_argument("--force-triton", action="store_true",
                        help="pass interpret=False (for kernels that pick the interpreter from "
                             "the default backend)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if not plugins_available():
        print("needs the CUDA plugin and ptxas: pip install 'jax[cuda12]'", file=sys.stderr)
        return 2
    _override_launch(args.launch)
    blocks = (None if args.blocks is None
              else pallas.BlockSizes(*(int(x) for x in args.blocks.split(","))))
    print(f"B=1 S={args.seq} H={args.heads} Hkv={args.kv_heads} causal, fwd+bwd, "
          f"spills as errors: {args.spills_as_errors}")
    print(f"{'target':6} {'dims':>7} {'dtype':>8} {'kernel':>7} {'regs':>5} {'spill st/ld':>12} "
          f"{'smem B':>7} {'thr':>4} {'occ':>4} {'grid':>10} {'compile s':>9}")
    failures = 0
    for target in args.target:
        for dtype in args.dtype:
            for dims in args.dims:
                d_qk, d_v = (int(x) for x in dims.split("/"))
                label = f"{target:6} {dims:>7} {dtype:>8}"
                try:
                    seconds, found = compile_kernels(
                        target, d_qk, d_v, jnp.dtype(dtype), seq=args.seq, heads=args.heads,
                        kv_heads=args.kv_heads, spills_as_errors=args.spills_as_errors,
                        block_sizes=blocks,
                        interpret=False if args.force_triton else None)
                except Exception as error:  # report and go on: this is a survey
                    failures += 1
                    message = str(error).strip().splitlines()
                    print(f"{label} FAILED {type(error).__name__}: "
                          f"{message[0][:160] if message else ''}")
                    continue
                for name in KERNEL_NAMES:
                    res = found.get(name, Resources())
                    short = name.replace("seqpar_flash_", "")
                    print(f"{label} {short:>7} {res.registers!s:>5} "
                          f"{f'{res.spill_stores}/{res.spill_loads}':>12} "
                          f"{res.shared_memory!s:>7} {res.threads!s:>4} "
                          f"{_percent(res.occupancy(target)):>4} {res.grid!s:>10} "
                          f"{seconds:9.1f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
