"""The compile gate: the library compiled, never run, by the real GPU and TPU compilers.

Every strategy, forward and forward + vjp with ``kernel="auto"``, is compiled on this
CPU-only host for 8 H100s (XLA:GPU, Triton and ptxas for sm_90a) and a TPU v5p 2x2x2
slice (XLA:TPU), through :mod:`jax_seqpar.tools.targets`; ring and Ulysses with
``kernel="pallas"`` for 8 H100s and 8 A100s at every head dim the Pallas kernel is
built for, in bf16, and in fp16 at the widest head dim of each tile size. A compile
error, a register spill (a compile error here:
``xla_gpu_fail_ptx_compilation_on_register_spilling``), shared memory over the limit
or a missing Triton kernel fails the gate; so does a strategy whose
transfers are not scheduled around its kernels as :data:`HIDING` says (every ring
step's K/V transfer around the step's kernel). Programs compile with the library's
target options for their strategy (:data:`jax_seqpar.tools.targets.COMPILE_OPTIONS`).
Compiling needs the ``[aot]`` extra (CI installs it); the tests that compile skip, saying
so, where its plugins are missing. They are the ``compile_gate`` tier (``pytest -m
compile_gate``); the checks here that compile nothing (target names, the kernel each
platform lowers to) are in the default tier.
"""

import argparse
import json
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar.tools import aot, bench, bench_report, bench_target, hlo, schedule, targets
from jax_seqpar.api import attention as api, program as api_program
from jax_seqpar import comm_bytes, kernels
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.core.quant import Compute
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.kernels import make_options
from jax_seqpar.planning import hardware, predict
from jax_seqpar.strategies import registry, traffic

GPU, TPU = "h100:8", "v5p:2x2x2"
SHAPE = LayerShape(batch=1, seq_len=4096, num_heads=16, num_kv_heads=4, head_dim=128,
               dtype="bfloat16", causal=True)
MESHES = {"ulysses": {"sp": 8}, "ring": {"sp": 8}, "allgather": {"sp": 8},
          "hybrid": {"dcn": 2, "ici": 4}}
TRITON_FORWARD = {"triton:seqpar_flash_forward"}
TRITON_ALL = TRITON_FORWARD | {"triton:seqpar_flash_dq", "triton:seqpar_flash_dkv"}


def _missing(platform: str):
    try:
        targets.require_plugin(platform)
    except ImportError as error:
        return str(error)
    return None


def _needs(target: str):
    reason = _missing(targets.target_platform(target))
    return pytest.mark.skipif(reason is not None, reason=f"{reason} (CI installs it)")


def _compiles_for(target: str):
    """A test that compiles for ``target``: marked ``compile_gate``, skipped without
    the target's plugin."""
    return lambda test: pytest.mark.compile_gate(_needs(target)(test))


def _on(target: str, *values, marks=()):
    return pytest.param(target, *values,
                        marks=[pytest.mark.compile_gate, _needs(target), *marks],
                        id="-".join([target, *map(str, values)]))


class Hiding(NamedTuple):
    """What a strategy's compiled programs hide behind its kernels, on every target.

    Attributes:
      kinds: collective kinds of the strategy's own transfers: at least one collective
        of each, asynchronous, encloses a kernel (a Triton / Mosaic call, or the XLA
        kernel's loop) in the forward and in the forward + vjp program.
      fwd, fwd_bwd: the least share of the bytes sent that is hidden
        (:func:`jax_seqpar.tools.schedule.bytes_hidden`) in each program, or None.
    """

    kinds: tuple
    fwd: Optional[float] = None
    fwd_bwd: Optional[float] = None


#: A strategy whose transfers are pipelined behind its kernels has a row. The ring
#: hides every hop but the backward's last (dK/dV home, after the last kernel). Ulysses
#: pipelines its exchange along the sequence (5 pieces at 512 tokens a device, the keys
#: first): all but the first query and K/V pieces and the last output / gradient pieces
#: hide, 1/16 of the bytes; the hybrid its inner one likewise, around its ring, whose
#: hops all hide (dK/dV's home behind the last step's query pieces). The
#: all-gather's pieces (4 at S/P = 512) hide all but the first piece's gather and the
#: backward's last dK/dV hop.
HIDING = {
    "ring": Hiding(("collective-permute",), fwd=1.0, fwd_bwd=0.9),
    "hybrid": Hiding(("collective-permute", "all-to-all"), fwd=0.9, fwd_bwd=0.9),
    "ulysses": Hiding(("all-to-all",), fwd=0.9, fwd_bwd=0.9),
    "allgather": Hiding(("all-gather",), fwd=0.7, fwd_bwd=0.7),
}

#: Where a pipeline hides less than its :data:`HIDING` row at :data:`SHAPE`, per (target,
#: strategy, mode): the hybrid's forward on TPU, 87.1 %: at 512 tokens a device XLA:TPU
#: starts one query piece's transfer (0.4 MiB) after the kernel it was meant to hide
#: behind (the piece is sliced from the copy of q its memory-space assignment brings in
#: after that kernel). It hides 95.0 % at 8192 tokens and more, and at 4096 with
#: ``xla_tpu_use_aggressive_scheduling`` (no longer a default target option: see
#: :data:`jax_seqpar.tools.targets.TPU_HEAD_GROUP_OPTIONS`).
LEAST_HIDDEN = {(TPU, "hybrid", "fwd"): 0.85}


#: The planner's hardware preset of each compile target.
PRESETS = {GPU: "h100", TPU: "tpu-v5p"}
_NEXT = [(i, (i + 1) % 8) for i in range(8)]
#: One collective of each kind the time model knows, over the 8 devices of "sp".
_COLLECTIVES = {
    "collective-permute": lambda x: jax.lax.ppermute(x, "sp", _NEXT),
    "all-to-all": lambda x: jax.lax.all_to_all(x, "sp", 0, 0, tiled=True),
    "all-gather": lambda x: jax.lax.all_gather(x, "sp", tiled=True)[:x.shape[0]] + 1,
    "reduce-scatter": lambda x: jax.lax.psum_scatter(x, "sp", tiled=True),
}


@pytest.mark.parametrize("target, kind", [
    _on(target, kind) for target in (GPU, TPU) for kind in hardware.COLLECTIVES])
def test_time_model_overlaps_what_the_compiled_schedule_overlaps(target, kind):
    """Next to a kernel on independent data (q, k, v ``[1, 1024, 8 | 2, 128]`` bf16 per
    device, x ``[512, 1024]``), compiled with every strategy's target options, a
    collective of ``kind`` is scheduled around the kernel exactly where the planner's
    hardware preset says the target overlaps that kind
    (:attr:`jax_seqpar.planning.hardware.Hardware.overlaps`); XLA:TPU's all-to-all and
    all-gather are synchronous without those options."""
    mesh = targets.target_mesh(target)
    rows = NamedSharding(mesh, P("sp"))
    q, k = (jax.ShapeDtypeStruct((8, 1024, heads, 128), jnp.bfloat16, sharding=rows)
            for heads in (8, 2))
    x = jax.ShapeDtypeStruct((8 * 512, 1024), jnp.bfloat16, sharding=rows)

    def body(q, k, v, x):
        n = q.shape[1]
        tokens = Tokens(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (1, n)))
        out, _ = kernels.forward(make_options(q, MaskSpec.make(causal=True), scale=0.1),
                                 q, k, v, tokens, tokens)
        return out, _COLLECTIVES[kind](x)

    f = jax.shard_map(body, mesh=mesh, in_specs=P("sp"), out_specs=P("sp"))
    platform = targets.target_platform(target)
    program = aot.compile_for(f, (q, k, k, x), platform,
                              compiler_options=targets.compile_options(platform))
    rows = schedule.collective_schedule(program.compiled)
    overlaps = kind in hardware.get(PRESETS[target]).overlaps
    assert schedule.bytes_hidden(program.compiled)["fraction"] == (1.0 if overlaps else 0.0), (
        kind, [(r.kind, r.is_async, r.enclosed) for r in rows])
    if platform == "tpu" and kind in ("all-to-all", "all-gather"):
        # XLA:TPU runs these synchronously unless the target options ask.
        plain = schedule.collective_schedule(aot.compile_for(f, (q, k, k, x), platform).compiled)
        assert plain and not any(r.is_async for r in plain), (kind, plain)


@pytest.mark.parametrize("target, strategy", [
    _on(target, strategy) for target in (GPU, TPU) for strategy in MESHES])
def test_strategy_compiles(target, strategy):
    """Every strategy compiled for each target, forward and forward + vjp, spills being
    errors; each program compiled once (a compile is most of the gate's time) and
    checked by each of the checks below."""
    programs = bench_target.compile_strategy(
        target, bench.Case(strategy, MESHES[strategy], SHAPE, "auto"), fail_on_spills=True)
    for mode, program in programs.items():
        _kernels_are_called(target, mode, program.compiled)
        if target == TPU:
            _sends_comm_bytes(strategy, mode, program.compiled)
        _transfers_hide_behind_kernels(target, strategy, mode, program.compiled)
        _time_model_hides_no_more_than_the_program(target, strategy, mode, program.compiled)
        if strategy == "ring":
            _ring_transfer_overlaps_the_step_kernel(target, mode, program.compiled)


def _kernels_are_called(target, mode, compiled):
    """The program has memory and traffic; on GPU it calls every Triton kernel (the
    forward's one, the vjp's three), on TPU Mosaic kernels only."""
    assert bench_target.footprint_bytes(compiled) > 0, mode
    assert sum(hlo.collective_bytes(compiled).values()) > 0, mode
    calls = set(hlo.kernel_calls(compiled))
    if target == GPU:
        assert calls == (TRITON_FORWARD if mode == "fwd" else TRITON_ALL), mode
    else:  # kernel="auto" is the Mosaic kernel on TPU
        assert calls and all(c.startswith("mosaic:") for c in calls), (mode, calls)


def _sends_comm_bytes(strategy, mode, compiled):
    """The bytes the program sends are ``comm_bytes``' (bf16: the ring's and the
    all-gather's dK/dV accumulators in float32 but for the hop home, in bf16). Checked
    on TPU, where it was compiled; XLA:CPU sends bf16 as float32. The chunked hybrid's
    ring of two devices has no loop: XLA sends its keys' int32 positions once for both
    passes (the backward's hop of them is the forward's, merged)."""
    sizes = tuple(MESHES[strategy].values())
    expected = comm_bytes(strategy, axis_sizes=sizes if len(sizes) > 1 else sizes[0],
                          **SHAPE.replace(backward=mode == "fwd_bwd").comm_kwargs())
    if strategy == "hybrid" and mode == "fwd_bwd":
        expected -= SHAPE.batch * SHAPE.seq_len // sizes[0] * 4  # one hop of positions
    assert sum(hlo.collective_bytes(compiled).values()) == expected, (mode, expected)


def _transfers_hide_behind_kernels(target, strategy, mode, compiled):
    """Each of the strategy's own collective kinds has a transfer scheduled around a
    kernel, and the share of bytes hidden holds (:data:`HIDING`, :data:`LEAST_HIDDEN`)."""
    expected = HIDING[strategy]
    rows = schedule.collective_schedule(compiled)
    for kind in expected.kinds:
        assert any(r.kind == kind and r.is_async and r.encloses_kernel for r in rows), (
            mode, kind, [(r.kind, r.is_async, r.enclosed) for r in rows])
    least = LEAST_HIDDEN.get((target, strategy, mode), getattr(expected, mode))
    if least is not None:
        hidden = schedule.bytes_hidden(compiled)
        assert hidden["fraction"] >= least - 1e-9, (mode, hidden)


def _ring_transfer_overlaps_the_step_kernel(target, mode, compiled):
    """In the forward loop and the backward loop, the K/V collective-permute of every
    step encloses the step's kernel: the transfer is scheduled to hide behind it. On GPU
    each step sends ONE collective-permute (K, V, positions and, backward, the dK/dV
    accumulator packed in one buffer): XLA:GPU keeps one in flight, so a second would
    wait for the first, exposed once the hops outlast the kernel."""
    steps = [r for r in schedule.collective_schedule(compiled)  # in the ring loops
             if r.kind == "collective-permute" and r.runs > 1]
    assert {r.computation for r in steps} == {
        r.computation for r in steps if r.encloses_kernel}, (mode, steps)
    loops = [r.computation for r in steps]
    assert len(set(loops)) == (1 if mode == "fwd" else 2), (mode, steps)
    if target == GPU:
        assert len(loops) == len(set(loops)), (mode, steps)


def _time_model_hides_no_more_than_the_program(target, strategy, mode, compiled):
    """The share of bytes the time model hides behind kernels (``predict``'s
    ``hidden_bytes``) is at most what the compiled program hides, and the ring's is what
    its program hides (within 5 points; 10 for the hybrid on TPU)."""
    inner = list(MESHES[strategy].values())[-1]
    candidate = predict.Candidate(strategy, *registry.get(strategy).factorization(8, inner))
    model = predict.predict(candidate, SHAPE.replace(backward=mode == "fwd_bwd"),
                            PRESETS[target])
    modelled = model["hidden_bytes"] / model["bytes"]
    hidden = schedule.bytes_hidden(compiled)["fraction"]
    # The hybrid on TPU at SHAPE: XLA:TPU starts a piece's transfer late (:data:`LEAST_HIDDEN`),
    # which the model does not know: 95.1 / 96.2 % modelled against 87.1 / 90.4 % compiled
    # (forward / forward + vjp); at 8192 tokens and more it hides what the model says.
    slack = 0.10 if (target, strategy) == (TPU, "hybrid") else 0.05
    assert modelled <= hidden + slack, (mode, modelled, hidden)
    if strategy == "ring":
        assert modelled >= hidden - 0.05, (mode, modelled, hidden)


def _training_step(target: str, strategy: str, *, backward: bool = True,
                   shape: LayerShape = SHAPE, **keywords):
    """``jax.grad`` of a scalar loss of the global call with ``positions=`` (tokens kept
    in their order: no relayout), at ``shape`` on the strategy's mesh
    (:data:`MESHES`), compiled with the strategy's target options: what a training step
    compiles (``backward=False``: the call alone)."""
    axes = MESHES[strategy]
    mesh = targets.target_mesh(target, tuple(axes), tuple(axes.values()))
    seq_axes = tuple(axes) if len(axes) > 1 else tuple(axes)[0]
    sharding = NamedSharding(mesh, P(None, seq_axes))
    args = [jax.ShapeDtypeStruct(size, shape.dtype, sharding=sharding)
            for size in shape.operand_shapes()[:3]]
    args.append(jax.ShapeDtypeStruct((shape.batch, shape.seq_len), jnp.int32,
                                     sharding=sharding))

    def attend(q, k, v, positions):
        return api.sequence_parallel_attention(q, k, v, mesh=mesh, seq_axes=seq_axes,
                                               strategy=strategy, causal=True,
                                               positions=positions, **keywords)

    def loss(q, k, v, positions):
        return jnp.mean(jnp.square(attend(q, k, v, positions).astype(jnp.float32)))

    platform = targets.target_platform(target)
    fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else attend
    return aot.compile_for(fn, args, platform,
                           compiler_options=targets.compile_options(platform, strategy))


def _pipelined_and_whole(target: str, strategy: str, backward: bool,
                         shape: LayerShape = SHAPE):
    """``(hidden share, temp bytes)`` of the strategy's training step (or forward) with
    its default pipeline and with ``overlap=False``."""
    results = []
    for overlap in ("auto", False):
        compiled = _training_step(target, strategy, backward=backward, shape=shape,
                                  **({} if overlap == "auto" else dict(overlap=overlap))).compiled
        results.append((schedule.bytes_hidden(compiled), hlo.memory_bytes(compiled)["temp"]))
    return results


#: The pipelines' temp memory over ``overlap=False``'s that the gate holds at
#: :data:`SHAPE`, per target and strategy (the goal, 1.10x, holds at 131072 tokens on both
#: targets: :func:`test_long_sequence_hides_ninety_percent`). GPU: Ulysses meets it
#: (measured 0.97x forward, 0.86x training step); the hybrid's training step does at
#: 16384 tokens (1.01x) but not at 4096 (1.16x: its pieces' float32 buffers weigh more
#: against a short sequence's). TPU, training step: 1.22x (Ulysses) and 2.32x (the
#: hybrid) at 4096, 1.29x and 1.36x at 16384; forward 1.12x and 1.21x at 4096: XLA:TPU
#: holds more for the pieces against a short sequence's whole buffers. The bounds keep it
#: from growing.
TEMP_RATIO = {(GPU, "ulysses"): 1.10, (TPU, "ulysses"): 1.3,
              (GPU, "hybrid"): 1.2, (TPU, "hybrid"): 2.4}


@pytest.mark.parametrize("target, strategy, backward", [
    _on(target, strategy, backward) for target in (GPU, TPU)
    for strategy in ("ulysses", "hybrid") for backward in (False, True)])
def test_pipeline_hides_ninety_percent(target, strategy, backward):
    """Ulysses' exchange, and the hybrid's inner one, pipelined along the sequence (the
    keys first, then the queries; 5 pieces at 512 tokens a device: 1/16 of the bytes
    exposed; the hybrid's ring hops behind its steps) in the forward and the training
    step: at least 90 % of the bytes are sent while a kernel runs (:data:`LEAST_HIDDEN`;
    with ``overlap=False``, Ulysses none: one exchange each way, nothing to hide behind);
    the same bytes in all; temp memory within :data:`TEMP_RATIO` of ``overlap=False``'s."""
    (pipelined, temp), (whole, whole_temp) = _pipelined_and_whole(target, strategy, backward)
    mode = "fwd_bwd" if backward else "fwd"
    assert pipelined["fraction"] >= LEAST_HIDDEN.get((target, strategy, mode), 0.90), pipelined
    if strategy == "ulysses":
        assert whole["fraction"] == 0.0, whole
    assert whole["fraction"] < 0.5, whole
    assert whole["total"] == pytest.approx(pipelined["total"], rel=0.01), (whole, pipelined)
    assert temp <= TEMP_RATIO[target, strategy] * whole_temp, (temp / 2**20, whole_temp / 2**20)


#: 16384 tokens a device: the ring's hops (K/V 16 MiB each, the dK/dV accumulator 32 MiB
#: each) outlast the fusions around the kernel, so a second collective in a step would run
#: exposed on GPU (XLA:GPU keeps one in flight; each hop is one packed buffer).
LONG = SHAPE.replace(seq_len=131072)
#: Ulysses on v5p holds at half that (8192 tokens a device: 94.3 % hidden, temp 1.08x),
#: in half the compile time; the hybrid needs 131072 (at 65536: 87.1 % hidden forward,
#: temp 1.19x in the training step).
LONG_SEQ = {(TPU, "ulysses"): 65536}


@pytest.mark.parametrize("target, strategy, backward", [
    *(_on(GPU, strategy, backward) for strategy in ("ring", "allgather", "hybrid")
      for backward in (False, True)),
    _on(TPU, "ulysses", True), _on(TPU, "hybrid", False), _on(TPU, "hybrid", True)])
def test_long_sequence_hides_ninety_percent(target, strategy, backward):
    """At 131072 tokens on h100:8 the ring, the all-gather and the hybrid send at least
    90 % of their bytes while a kernel runs, forward and training step (before each hop
    was one buffer and the all-gather's merge came after its barrier: the ring 49.9 % /
    39.6 %, the all-gather 0 % / 31.8 %, the hybrid 89.1 % / 76.2 %), the ring's steps
    one collective-permute each; the hybrid's temp within 1.10x of ``overlap=False``'s.
    On v5p:2x2x2, Ulysses' training step (at :data:`LONG_SEQ`) and the hybrid's forward
    and training step, temp within 1.10x too (with ``xla_tpu_use_aggressive_scheduling``, no longer a default
    target option, the training steps' were 1.52x and 1.50x; Ulysses' forward, 0.63x,
    is left out: its compile alone takes minutes); the hybrid's training step hid 88.4 %
    before its dK/dV were summed ahead of the first dq piece (XLA:TPU ran that piece's
    kernel before their trip home)."""
    if strategy in ("ring", "allgather"):
        compiled = _training_step(target, strategy, backward=backward, shape=LONG).compiled
        assert schedule.bytes_hidden(compiled)["fraction"] >= 0.90
        if strategy == "ring":
            _ring_transfer_overlaps_the_step_kernel(target, "fwd_bwd" if backward else "fwd",
                                                    compiled)
        return
    shape = LONG.replace(seq_len=LONG_SEQ.get((target, strategy), LONG.seq_len))
    (pipelined, temp), (_, whole_temp) = _pipelined_and_whole(target, strategy, backward,
                                                              shape)
    assert pipelined["fraction"] >= 0.90, pipelined
    assert temp <= 1.10 * whole_temp, (temp / 2**20, whole_temp / 2**20)


# (head dim of q/k, of v): every head dim the Pallas kernel is built for, DeepSeek's
# 192/128 and MLA absorbed (576/512, one K/V head).
HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128),
             (576, 512))
#: The head dims also compiled in float16: the widest of each tile size of
#: jax_seqpar.kernels.gpu._config (head dims up to 128, up to 256, MLA). float16 and
#: bfloat16 take the same tiles, warps and stages and the same kernel code (two-byte
#: operands, float32 accumulators), so their registers and shared memory are the same;
#: float16 at each tile size's widest head dim holds its lowering on both GPUs without
#: compiling every head dim twice.
FLOAT16_HEAD_DIMS = ((128, 128), (256, 256), (576, 512))


def _global_program(target: str, d_qk: int, d_v: int, seq: int = 1024):
    """The ring through the global API with ``kernel="pallas"``, forward and vjp, in
    bfloat16 (and float16 at :data:`FLOAT16_HEAD_DIMS`): one program, ``(fn, operands)``.
    The ring's steps run every kernel at its default tiles (``S/P`` = 128 tokens a
    device: no tile is clipped; the tiles depend on the head dims and dtype only), so
    Ulysses, the same kernels on the same tiles, would add compile time, not coverage
    (its programs compile in ``test_strategy_compiles``)."""
    mesh = targets.target_mesh(target)
    sharding = NamedSharding(mesh, P(None, "sp"))
    heads, kv_heads = (16, 1) if d_qk > 256 else (16, 2)
    dtypes = (jnp.bfloat16, jnp.float16) if (d_qk, d_v) in FLOAT16_HEAD_DIMS else (
        jnp.bfloat16,)
    operands = [jax.ShapeDtypeStruct((1, seq, h, d), dtype, sharding=sharding)
                for dtype in dtypes
                for h, d in ((heads, d_qk), (kv_heads, d_qk), (kv_heads, d_v), (heads, d_v))]

    def attend(q, k, v):
        return api.sequence_parallel_attention(q, k, v, mesh=mesh, strategy="ring",
                                               causal=True, kernel="pallas")

    def run(*operands):
        results = []
        for q, k, v, dout in zip(*[iter(operands)] * 4):  # per dtype
            out, vjp = jax.vjp(attend, q, k, v)
            results.append((out, vjp(dout)))
        return results

    return run, operands


@pytest.mark.parametrize("target, d_qk, d_v", [
    _on(target, d_qk, d_v) for target in (GPU, "a100:8") for d_qk, d_v in HEAD_DIMS])
def test_pallas_through_the_global_api(target, d_qk, d_v):
    """The ring with ``kernel="pallas"`` on 8 GPUs, forward + backward, bf16 (and fp16,
    :data:`FLOAT16_HEAD_DIMS`), causal: every Triton kernel is in the program, none spills
    (a compile error here) and each fits its shared memory."""
    program = aot.compile_for(*_global_program(target, d_qk, d_v), "cuda",
                              fail_on_spills=True)
    calls = hlo.kernel_calls(program.compiled)
    assert set(calls) == TRITON_ALL
    # Each kernel at more than one call site, in each dtype.
    dtypes = 2 if (d_qk, d_v) in FLOAT16_HEAD_DIMS else 1
    assert min(calls.values()) >= 2 * dtypes


@pytest.mark.parametrize("target, head_dim", [
    _on(target, d) for target in ("h100:1", "a100:1") for d in (64, 128)])
def test_pallas_float32_compiles_without_spills(target, head_dim):
    """The kernel alone in float32 (TF32x3 dots; bf16 and fp16 at every head dim are
    above), up to head dim 128 (wider float32 still spills in the backward): forward
    and both backward kernels at the default tiles compile, ptxas counts no spill."""
    sharding = NamedSharding(targets.target_mesh(target), P())
    q, k, v = (jax.ShapeDtypeStruct((1, 512, heads, head_dim), jnp.float32, sharding=sharding)
               for heads in (8, 2, 2))

    def grads(q, k, v):
        tokens = Tokens(jnp.arange(512, dtype=jnp.int32)[None])

        def loss(q, k, v):
            out, lse = kernels.attention(
                make_options(q, MaskSpec.make(causal=True), kernel="pallas"),
                q, k, v, tokens, tokens)
            return out.sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    program = aot.compile_for(grads, (q, k, v), "cuda", fail_on_spills=True,
                              kernel_resources=True)
    assert {f"triton:{name}" for name in program.kernels} == TRITON_ALL
    for name, resources in program.kernels.items():
        assert resources.spill_stores == resources.spill_loads == 0, (name, resources)


TRITON_FP8 = {f"{name}_fp8" for name in TRITON_ALL}


@pytest.mark.parametrize("target, head_dim, backward", [
    _on("h100:1", d, backward) for d in (64, 128, 256)
    for backward in ("float8_e4m3fn", "bfloat16")])
def test_pallas_fp8_compiles_without_spills(target, head_dim, backward):
    """``compute_dtype=float8_e4m3fn`` with ``kernel="pallas"`` on H100 (sm_90a): the FP8
    forward and the backward (FP8, or bf16 products of the widened operands) at the FP8
    default tiles (``_config._fp8_tiles``), GQA, causal: every FP8 Triton kernel compiles
    and ptxas counts no spill (and the spill check is on: a spill is a compile error)."""
    sharding = NamedSharding(targets.target_mesh(target), P())
    q, k, v = (jax.ShapeDtypeStruct((1, 512, heads, head_dim), jnp.bfloat16,
                                    sharding=sharding) for heads in (8, 2, 2))
    compute = Compute(jnp.float8_e4m3fn, backward_dtype=backward, hadamard=False)

    def grads(q, k, v):
        tokens = Tokens(jnp.arange(512, dtype=jnp.int32)[None])

        def loss(q, k, v):
            out, lse = kernels.attention(
                make_options(q, MaskSpec.make(causal=True), kernel="pallas",
                             compute_dtype=compute), q, k, v, tokens, tokens)
            return out.sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    program = aot.compile_for(grads, (q, k, v), "cuda", fail_on_spills=True,
                              kernel_resources=True)
    assert {f"triton:{name}" for name in program.kernels} == TRITON_FP8
    for name, resources in program.kernels.items():
        assert resources.spill_stores == resources.spill_loads == 0, (name, resources)


@pytest.mark.parametrize("target, q_len, kv_len, head_dim", [
    _on("h100:1", 1, 4096, 128), _on("h100:1", 4, 2048, 64), _on("h100:1", 1, 1024, 256)])
def test_fp8_decode_runs_the_triton_kernel_without_spills(target, q_len, kv_len, head_dim):
    """FP8 decode-shaped calls (a few queries against a long cache, GQA 8/2: the group
    folded into rows, the cache split-K) under ``kernel="auto"`` on H100 run the FP8
    Triton forward, which compiles with no spill (measured 168, 96, 128 registers)."""
    sharding = NamedSharding(targets.target_mesh(target), P())
    q = jax.ShapeDtypeStruct((2, q_len, 8, head_dim), jnp.bfloat16, sharding=sharding)
    k = jax.ShapeDtypeStruct((2, kv_len, 2, head_dim), jnp.bfloat16, sharding=sharding)

    def attend(q, k, v):
        q_tokens = Tokens(jnp.full((2, q_len), kv_len - 1, jnp.int32))
        kv_tokens = Tokens(jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (2, kv_len)))
        options = make_options(q, MaskSpec.make(causal=True),
                               compute_dtype=Compute(jnp.float8_e4m3fn, hadamard=False))
        return kernels.forward(options, q, k, v, q_tokens, kv_tokens)

    program = aot.compile_for(attend, (q, k, k), "cuda", fail_on_spills=True,
                              kernel_resources=True)
    assert set(program.kernels) == {"seqpar_flash_forward_fp8"}, program.kernels
    for name, resources in program.kernels.items():
        assert resources.spill_stores == resources.spill_loads == 0, (name, resources)


@pytest.mark.parametrize("target, head_dim", [_on("h100:1", 16), _on("h100:1", 96)])
def test_fp8_auto_runs_the_xla_kernel_where_triton_does_not_serve(target, head_dim):
    """FP8 training under ``kernel="auto"`` on H100 at a head dim outside
    ``FP8_HEAD_DIMS`` (16: Triton's FP8 backward spills; 96: its padded FP8 loads do not
    lower) compiles, with the XLA kernel: no Triton kernel, no spill."""
    sharding = NamedSharding(targets.target_mesh(target), P())
    q, k = (jax.ShapeDtypeStruct((1, 512, heads, head_dim), jnp.bfloat16, sharding=sharding)
            for heads in (8, 2))

    def grads(q, k, v):
        tokens = Tokens(jnp.arange(512, dtype=jnp.int32)[None])

        def loss(q, k, v):
            out, lse = kernels.attention(
                make_options(q, MaskSpec.make(causal=True), compute_dtype=Compute(
                    jnp.float8_e4m3fn, hadamard=False)), q, k, v, tokens, tokens)
            return out.sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    program = aot.compile_for(grads, (q, k, k), "cuda", fail_on_spills=True,
                              kernel_resources=True)
    assert not program.kernels, program.kernels


@pytest.mark.parametrize("target, compute", [
    _on("h100:1", compute) for compute in ("bfloat16", "float8_e4m3fn")])
def test_pallas_max_logit_compiles_without_spills(target, compute):
    """``return_max_logit=True`` with ``kernel="pallas"`` on H100, head dim 128, GQA,
    causal, bf16 and FP8 (an FP8 backward): the forward with its extra output (the rows'
    running max logit in the loop carry) and the backward compile at the default tiles,
    ptxas counts no spill (a spill is a compile error here)."""
    sharding = NamedSharding(targets.target_mesh(target), P())
    q, k, v = (jax.ShapeDtypeStruct((1, 512, heads, 128), jnp.bfloat16, sharding=sharding)
               for heads in (8, 2, 2))
    fp8 = compute != "bfloat16"
    options = dict(kernel="pallas", return_max_logit=True,
                   compute_dtype=Compute(compute, hadamard=False) if fp8 else None)

    def grads(q, k, v):
        tokens = Tokens(jnp.arange(512, dtype=jnp.int32)[None])

        def loss(q, k, v):
            out, lse, high = kernels.attention(
                make_options(q, MaskSpec.make(causal=True), **options), q, k, v, tokens,
                tokens)
            return out.sum() + lse.sum() + high.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    program = aot.compile_for(grads, (q, k, v), "cuda", fail_on_spills=True,
                              kernel_resources=True)
    assert {f"triton:{name}" for name in program.kernels} == (TRITON_FP8 if fp8 else TRITON_ALL)
    for name, resources in program.kernels.items():
        print(name, resources)
        assert resources.spill_stores == resources.spill_loads == 0, (name, resources)


@_compiles_for(GPU)
def test_a_spill_is_a_compile_error():
    """The gate's spill check is live: a kernel that spills does not compile, and the
    resources read without the check show the spill."""
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32,
                             sharding=NamedSharding(targets.target_mesh("h100:1"), P()))

    def square(x_ref, o_ref):  # a 64 x 64 f32 product on one warp: > 255 registers
        o_ref[...] = jnp.dot(x_ref[...], x_ref[...].T, preferred_element_type=jnp.float32)

    def f(x):
        return pl.pallas_call(square, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=plgpu.CompilerParams(num_warps=1,
                                                                   num_stages=1))(x)

    program = aot.compile_for(f, (x,), "cuda", kernel_resources=True)
    assert program.kernels["square"].spill_stores > 0
    with pytest.raises(Exception, match="register spilling"):
        aot.compile_for(f, (x,), "cuda", fail_on_spills=True)


@_compiles_for(GPU)
def test_bench_target_cli(tmp_path, capsys):
    """``jax-seqpar bench --target``: compiled, not run; table and JSON."""
    json_path = tmp_path / "h100.json"
    args = bench_report.add_bench_arguments(argparse.ArgumentParser()).parse_args(
        ["--target", "h100:8", "--seq", "2048", "--heads", "8", "--kv-heads", "2",
         "--head-dim", "64", "--dtype", "bfloat16", "--strategies", "ring", "--no-progress",
         "--json", str(json_path)])
    assert bench_report.run_bench(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("compiled for h100:8, not run")
    row, = json.loads(json_path.read_text())["rows"]
    assert row["strategy"] == "ring" and row["fwd_bwd"]["model_bytes"] > 0
    assert row["fwd_bwd"]["hlo_bytes"]["collective-permute"] > 0
    assert set(row["fwd"]["kernels"]) == {"seqpar_flash_forward"}


def test_kernel_choice_follows_the_lowering_platform():
    """``auto`` and ``pallas`` are Triton when lowered for CUDA, whatever the host
    (no plugin is needed to lower). Exporting for CPU and CUDA at once is not
    possible: Pallas lowers a Triton call for every platform of the module."""
    q = k = v = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.bfloat16)

    def exported(kernel, platforms, q=q, k=k, v=v):
        def run(q, k, v):
            n = q.shape[1]
            tokens = Tokens(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (1, n)))
            return kernels.forward(make_options(
                q, MaskSpec.make(causal=True), scale=0.25, kernel=kernel), q, k, v, tokens, tokens)

        return jax.export.export(jax.jit(run), platforms=platforms, disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            q, k, v).mlir_module()

    triton = "__gpu$xla.gpu.triton"
    for kernel in ("auto", "pallas"):
        assert triton in exported(kernel, ["cuda"]), kernel
        assert triton not in exported(kernel, ["cpu"]), kernel
    assert triton not in exported("xla", ["cuda"])
    # float32 heads over 128 would spill in Triton's backward: "auto" runs the XLA kernel.
    wide, narrow = (jax.ShapeDtypeStruct((1, 64, 2, d), jnp.float32) for d in (256, 128))
    assert triton not in exported("auto", ["cuda"], wide, wide, wide)
    assert triton in exported("auto", ["cuda"], narrow, narrow, narrow)
    assert triton in exported("pallas", ["cuda"], wide, wide, wide)  # asked for by name
    # Mosaic takes float32 and bfloat16: "auto" lowers float16 for TPU to the XLA kernel.
    mosaic = "tpu_custom_call"
    half, brain = (jax.ShapeDtypeStruct((1, 256, 2, 128), d) for d in (jnp.float16, jnp.bfloat16))
    assert mosaic in exported("auto", ["tpu"], brain, brain, brain)
    assert mosaic not in exported("auto", ["tpu"], half, half, half)
    assert api_program.can_check_vma("auto") and api_program.can_check_vma("xla")
    assert not api_program.can_check_vma("pallas")  # its CPU branch is the Pallas interpreter


def test_target_names():
    assert targets.libtpu_init_args("ulysses") == "--xla_tpu_enable_async_all_to_all=true"
    assert targets.compile_options("tpu", "ring") == {} == targets.compile_options("cuda")
    assert [targets.target_platform(n) for n in ("h100:8", "a100:4", "v5e:2x4", "cpu:8")] == [
        "cuda", "cuda", "tpu", "cpu"]
    assert targets.parse("h200:16").topology == "1x2x8"
    assert targets.parse("v6e:2x4").num_devices == 8
    two_slices = targets.parse("v5p:2x2x2*2")  # two slices over DCN
    assert (two_slices.num_devices, two_slices.slices, two_slices.topology) == (
        16, 2, "v5p:2x2x2")
    assert targets.parse("h100:8").hbm_bytes == 84942979072
    for bad, message in (("b200:8", "unknown target 'b200:8'"), ("h100", "needs a GPU count"),
                         ("h100:12", "whole hosts of 8; use h100:8 or h100:16"),
                         ("v5p:2x2x2*0", "at least one slice")):
        with pytest.raises(ValueError, match=message):
            targets.parse(bad)


def test_missing_plugin_names_the_extra(monkeypatch):
    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"jax_seqpar\[aot\]"):
        targets.require_plugin("tpu")


@_compiles_for(GPU)
def test_target_mesh_shapes():
    mesh = targets.target_mesh("h100:16", ("dcn", "ici"))
    assert dict(mesh.shape) == {"dcn": 2, "ici": 8}
    assert {d.process_index for d in mesh.devices[0]} != {d.process_index for d in mesh.devices[1]}
    with pytest.raises(ValueError, match="8 devices in all"):
        targets.target_mesh("h100:8", ("dcn", "ici"), (2, 2))


def test_longest_fitting_bisects():
    """Doubling then bisection finds the longest multiple of the granule that fits."""
    calls = []

    def fits(length):
        calls.append(length)
        return length <= 100_000

    found = bench_target._longest_fitting(fits, 1024, 8192, 2**24)
    assert 100_000 * (1 - bench_target.MAX_SEQ_TOLERANCE) <= found <= 100_000
    assert found % 1024 == 0 and len(calls) < 12
    assert bench_target._longest_fitting(lambda n: False, 1024, 8192, 2**24) == 0
    assert bench_target._longest_fitting(lambda n: True, 1024, 8192, 2**16) == 2**16


def _compiles_every_strategy_with(target, keywords_of):
    """Ring, Ulysses, all-gather and a one-axis hybrid (``ulysses_size=2``), causal, with
    the mask keywords ``keywords_of(ids, positions)`` (two ``int32[B, S]`` arrays, B=2,
    S=2048), forward + vjp in one program, ``kernel="auto"``: every Triton kernel on GPU
    (a spill is a compile error), Mosaic kernels only on TPU. Ulysses and the hybrid
    pipeline their exchange in 2 pieces (2 K/V pieces, 2 query pieces: the piecewise paths
    with the masks, without the default's 16 K/V pieces' calls, which
    :func:`test_pipeline_hides_ninety_percent` compiles)."""
    mesh = targets.target_mesh(target)
    sharding = NamedSharding(mesh, P(None, "sp"))
    batch, seq = 2, 2048
    q, k, v = (jax.ShapeDtypeStruct((batch, seq, h, 128), jnp.bfloat16, sharding=sharding)
               for h in (8, 2, 2))
    ids, positions = (jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=sharding)
                      for _ in range(2))
    strategies = [dict(strategy="ring"), dict(strategy="ulysses", pieces=2),
                  dict(strategy="allgather"), dict(strategy="hybrid", ulysses_size=2, pieces=2)]

    def attend(q, k, v, ids, positions):
        return [api.sequence_parallel_attention(q, k, v, mesh=mesh, causal=True,
                                                **keywords_of(ids, positions), **s)
                for s in strategies]

    def run(q, k, v, ids, positions):
        outs, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, ids, positions), q, k, v)
        return outs, vjp([jnp.ones_like(o) for o in outs])

    platform = targets.target_platform(target)
    program = aot.compile_for(run, (q, k, v, ids, positions), platform,
                              fail_on_spills=platform == "cuda")
    calls = hlo.kernel_calls(program.compiled)
    if platform == "cuda":
        assert set(calls) == TRITON_ALL
    else:
        assert calls and all(c.startswith("mosaic:") for c in calls), calls


@pytest.mark.compile_gate
@pytest.mark.parametrize("target", [_on(GPU), _on(TPU)])
def test_packed_documents_compile(target):
    """Packed documents (segment ids, per-document positions: per-row tile plans and the
    ring's whole-step skip) through every strategy (:func:`_compiles_every_strategy_with`)."""
    _compiles_every_strategy_with(
        target, lambda ids, positions: dict(segment_ids=ids, positions=positions))


@pytest.mark.compile_gate
@pytest.mark.parametrize("target", [_on(GPU), _on(TPU)])
def test_new_masks_compile(target):
    """Chunks that are not a multiple of the tiles and bidirectional spans within
    documents, together (the kernels' heaviest mask: both tested per tile), through every
    strategy (:func:`_compiles_every_strategy_with`): no register spill on GPU, Mosaic on
    TPU. The tokens' ``positions`` are given (the order the documents are balanced in)."""
    _compiles_every_strategy_with(target, lambda ids, positions: dict(
        segment_ids=ids, bidirectional_ids=ids + 1, chunk_size=600, positions=positions))


@pytest.mark.parametrize("target, strategy", [_on(GPU, "ring"), _on(TPU, "allgather")])
def test_documents_that_stay_home_compile(target, strategy):
    """``max_document_shards=2`` forward + vjp compiles and sends ``comm_bytes``: one
    shard's K/V each side. The ids' check (an all-gather and a host callback) cannot lower
    for a platform this process has no device of: a compile-only program holds neither
    (:func:`jax_seqpar.core.checks.refuse_unless`), so its bytes are ``comm_bytes`` less
    the check's gather."""
    mesh = targets.target_mesh(target)
    sharding = NamedSharding(mesh, P(None, "sp"))
    seq, heads, dim = 4096, 8, 64
    q = jax.ShapeDtypeStruct((1, seq, heads, dim), jnp.bfloat16, sharding=sharding)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=sharding)

    def run(q, k, v, ids, positions):
        def attend(q, k, v):
            return api.sequence_parallel_attention(
                q, k, v, mesh=mesh, strategy=strategy, causal=True, segment_ids=ids,
                positions=positions, max_document_shards=2)
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(jnp.ones_like(out))

    program = aot.compile_for(run, (q, q, q, ids, ids), targets.target_platform(target))
    expected = comm_bytes(strategy, batch=1, seq_len=seq, num_heads=heads, num_kv_heads=heads,
                          head_dim=dim, axis_sizes=8, backward=True, with_segment_ids=True,
                          causal=True, max_document_shards=2)
    check = traffic.document_check_bytes(MaskSpec.make(max_document_shards=2), batch=1,
                                         seq_len=seq, devices=8)
    assert check > 0
    assert sum(hlo.collective_bytes(program.compiled).values()) == expected - check


@_compiles_for("h100:8")
@_compiles_for("v5p:2x2x2")
@pytest.mark.parametrize("block", [0, 1], ids=["h100-ring", "v5p-ulysses-options"])
def test_the_guide_compiles_as_pasted(tmp_path, block):
    """docs/guide/compile.md's python blocks, each run as pasted in a fresh process: a
    ring compiled for 8 H100s, Ulysses for a v5p slice with its compile options; each
    prints the temp memory per device."""
    import os
    import re
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "docs", "guide", "compile.md")) as file:
        blocks = re.findall(r"```python\n(.*?)```", file.read(), re.S)
    assert len(blocks) == 2, len(blocks)  # every block of the page runs here
    block = blocks[block]
    env = {name: value for name, value in os.environ.items() if name != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("temp MiB per device:")[1].split()[0]) > 0


@pytest.mark.parametrize("target", [_on("h100:16"), _on("v5p:2x2x2*2")])
def test_the_hierarchy_sends_only_the_rings_hops_across_and_hides_them(target):
    """The hybrid on two hosts of 8 H100s and on two v5p slices of 8 (a ``("dcn", "ici")``
    mesh): Ulysses' all-to-alls stay inside a host / slice; across go only the ring's K/V
    hops (forward: one hop of the outer shard's K and V, after the inner all-to-all), and
    both kinds of link are at least 90 % hidden, forward and forward + backward
    (``experiments/hierarchy_links.py`` prints the table)."""
    seq, heads, head_dim = 8192, 16, 128
    mesh = targets.target_mesh(target, ("dcn", "ici"))
    platform = targets.target_platform(target)
    outer, inner = mesh.shape["dcn"], mesh.shape["ici"]
    sharded = NamedSharding(mesh, P(None, ("dcn", "ici")))
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16, sharding=sharded)
    positions = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=sharded)

    def forward(q, k, v, positions):
        return api.sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=("dcn", "ici"), strategy="hybrid", causal=True,
            positions=positions)

    def step(q, k, v, positions):
        out, pull = jax.vjp(lambda q, k, v: forward(q, k, v, positions), q, k, v)
        return pull(jnp.ones_like(out))

    hop = 2 * (seq // outer) * (heads // inner) * head_dim * 2  # K and V, bf16
    for fn in (forward, step):
        compiled = jax.jit(fn).trace(q, q, q, positions).lower(
            lowering_platforms=(platform,)).compile(
            compiler_options=targets.compile_options(platform, "hybrid"))
        links = schedule.bytes_by_link(compiled, inner)
        assert sum(link["total"] for link in links.values()) == pytest.approx(
            sum(hlo.collective_bytes(compiled).values()))
        if fn is forward:
            assert hop <= links["across"]["total"] <= 1.01 * hop, (links, hop)
        assert links["within"]["fraction"] >= 0.9 and links["across"]["fraction"] >= 0.9, links


@pytest.mark.parametrize("target", [_on(GPU), _on(TPU)])
def test_windowed_hybrid_hides_ninety_percent(target):
    """The hybrid with a causal window on the contiguous split (its ring a halo exchange)
    on a ``("dcn", "ici")`` mesh of 2 x 4, whose groups of 4 stand for hosts: the inner
    exchange runs in sequence pieces around the halo as around the ring, the halo in
    flight during the first step's last call and its float32 dK/dV back behind the own
    keys' backward. Forward and forward + backward, at least 90 % of the bytes hide on
    each kind of link, and across go only the halo's: the window's K/V (forward) and their
    float32 dK/dV back, not the ring's hops (``experiments/hierarchy_links.py`` prints the
    table on 16 devices)."""
    seq, heads, head_dim, window = 8192, 16, 128, 1024
    mesh = targets.target_mesh(target, ("dcn", "ici"), shape=(2, 4))
    platform = targets.target_platform(target)
    inner = mesh.shape["ici"]
    sharded = NamedSharding(mesh, P(None, ("dcn", "ici")))
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16, sharding=sharded)

    def forward(q, k, v):
        return api.sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=("dcn", "ici"), strategy="hybrid", causal=True,
            window=(window, 0))

    def step(q, k, v):
        out, pull = jax.vjp(forward, q, k, v)
        return pull(jnp.ones_like(out))

    halo = window * (heads // inner) * 2 * head_dim  # K and V elements of the window
    for fn, across in ((forward, halo * 2), (step, halo * (2 + 4))):  # bf16; dK/dV float32
        compiled = jax.jit(fn).trace(q, q, q).lower(lowering_platforms=(platform,)).compile(
            compiler_options=targets.compile_options(platform, "hybrid"))
        links = schedule.bytes_by_link(compiled, inner)
        assert links["across"]["total"] == across, (links, across)
        assert links["within"]["fraction"] >= 0.9 and links["across"]["fraction"] >= 0.9, links
