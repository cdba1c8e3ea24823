"""Bytes sent and temp memory of the compile gate's strategy programs, as a table.

Each strategy of ``tests/test_compile_gate.py`` (``test_strategy_compiles``: B=1, S=4096,
16 heads, 4 K/V heads, D=128, bf16, causal, ``kernel="auto"``) compiled for h100:8 and
v5p:2x2x2, forward and forward + vjp: the bytes one device sends
(:func:`jax_seqpar.tools.hlo.collective_bytes`) and the temp memory
(``memory_analysis``). Needs the ``[aot]`` extra.

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/gate_numbers.py
"""

import sys

from jax_seqpar.core.shape import LayerShape
from jax_seqpar.tools import bench, bench_target, hlo

SHAPE = LayerShape(batch=1, seq_len=4096, num_heads=16, num_kv_heads=4, head_dim=128,
                   dtype="bfloat16", causal=True)
MESHES = {"ulysses": {"sp": 8}, "ring": {"sp": 8}, "allgather": {"sp": 8},
          "hybrid": {"dcn": 2, "ici": 4}}


def main(targets=("h100:8", "v5p:2x2x2")):
    print("| target | strategy | mode | bytes sent | temp MiB |")
    print("|---|---|---|---|---|")
    for target in targets:
        for strategy, mesh in MESHES.items():
            programs = bench_target.compile_strategy(
                target, bench.Case(strategy, mesh, SHAPE, "auto"), fail_on_spills=True)
            for mode, program in programs.items():
                sent = sum(hlo.collective_bytes(program.compiled).values())
                temp = hlo.memory_bytes(program.compiled)["temp"] / 2**20
                print(f"| {target} | {strategy} | {mode} | {sent:.0f} | {temp:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or ("h100:8", "v5p:2x2x2"))
