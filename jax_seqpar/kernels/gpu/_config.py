"""Tiles, warps and pipeline stages of the Pallas kernels, per head dim, dtype and GPU.

The defaults compile without register spills and within shared memory on sm_80
(A100) and sm_90 (H100/H200) for head dims 64 ... 256, DeepSeek's 192/128 and MLA's
576/512, in bf16, fp16 and float32 (measured with ``experiments/gpu_resources.py``,
held by the compile gate, ``tests/test_compile_gate.py``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from jax_seqpar.kernels.gpu._core import HeadDim
from jax_seqpar.kernels.contract import BlockSizes


def _width(d_qk: int, d_v: int) -> int:
    """Padded columns a program holds: the wider of the two head dims."""
    return max(HeadDim.of(d_qk).padded, HeadDim.of(d_v).padded)


def default_block_sizes(d_qk: int, d_v: int, dtype: jax.typing.DTypeLike, *,
                        rich_mask: bool = False) -> BlockSizes:
    """The Pallas kernel's tiles for these head dims and dtype (what a size left ``None``
    becomes): they compile without spills and within shared memory on both sm_80 and
    sm_90 (measured with ``experiments/gpu_resources.py``): the per-thread
    accumulators shrink as the head dims grow, so the tiles do; float32 (TF32x3
    dots, three registers per operand value) takes smaller ones. ``rich_mask``: the
    mask tests more than positions and segment ids per element (chunks, bidirectional
    ids, a ``mask_fn``): the dk/dv kernel, at 255 registers with segment ids alone,
    then takes half the query rows per step (sm_90, head dim 128: 168 registers, no
    spill, where the full tile spills)."""
    fp8 = jnp.dtype(dtype).itemsize == 1
    block_q, block_k, block_q_bwd, block_k_bwd = (_fp8_tiles if fp8 else _default_tiles)(
        d_qk, d_v, dtype)
    if rich_mask:  # FP8 dots contract at least FP8_MIN_TILE rows
        block_q_bwd = max(FP8_MIN_TILE if fp8 else 16, block_q_bwd // 2)
    return BlockSizes(block_q, block_k, block_q_bwd, block_k_bwd)


#: The least tile an FP8 kernel contracts over (sm_90a's FP8 MMA takes K = 32).
FP8_MIN_TILE = 32


def _fp8_tiles(d_qk: int, d_v: int, dtype) -> tuple[int, int, int, int]:
    """``(block_q, block_k, block_q_bwd, block_k_bwd)`` of the FP8 kernels (``_fp8``):
    no register spill on sm_90a (H100/H200) at head dims 64, 128 and 256, forward and
    backward (FP8 or bf16), measured by ptxas through the compile gate
    (``tests/test_compile_gate.py::test_pallas_fp8_compiles_without_spills``). The
    16-bit tiles spill there: rounding P and dS per tile holds more registers, and
    sm_90a's FP8 MMA wants the contracted tiles whole."""
    del dtype
    width = _width(d_qk, d_v)
    if width <= 64:
        return 128, 32, 32, 32
    if width <= 128:
        return 64, 64, 32, 64
    if width <= 256:
        return 64, 32, 32, 32
    return 32, 32, 32, 32  # MLA absorbed (576/512): not measured


def _default_tiles(d_qk: int, d_v: int, dtype) -> tuple[int, int, int, int]:
    """``(block_q, block_k, block_q_bwd, block_k_bwd)`` before ``rich_mask``."""
    width = _width(d_qk, d_v)
    if jnp.dtype(dtype) == jnp.float32:
        if width <= 64:
            return 64, 32, 32, 32
        return (32, 16, 16, 16) if width <= 128 else (16, 16, 16, 16)
    if width <= 128:
        return 128, 64, 64, 64
    if width <= 256:
        return 64, 32, 32, 32
    return 32, 16, 16, 16  # MLA absorbed (576/512)


#: Widest head dim the float32 (TF32x3) kernels compile for without spilling.
MAX_F32_WIDTH = 128

#: Head dims (q/k and v alike) the FP8 kernels compile for on sm_90a with no spill, in
#: both backward dtypes (the compile gate). Others do not: 80, 96 or 192 (padded FP8
#: loads do not lower in Triton), 16 (the FP8 backward spills), 32 (the bf16 one does).
FP8_HEAD_DIMS = (64, 128, 256)


def compiles_clean(d_qk: int, d_v: int, dtype: jax.typing.DTypeLike) -> bool:
    """Whether the default tiles compile without register spills on sm_80 and sm_90,
    ``dtype`` the products' dtype: every bf16 / fp16 head dim; float32 up to
    ``MAX_F32_WIDTH`` (wider float32 heads spill in the backward); FP8 at the head dims
    of ``FP8_HEAD_DIMS`` (q/k and v the same), on a GPU with FP8 matrix units (compute
    capability 8.9 or later; unknown, as when compiling for a GPU from a CPU host,
    counts as one). ``kernel="auto"`` runs the XLA kernel otherwise."""
    if jnp.dtype(dtype).itemsize == 1:
        capability = gpu_capability()
        return (d_qk == d_v and d_qk in FP8_HEAD_DIMS
                and (capability is None or capability >= (8, 9)))
    return jnp.dtype(dtype) != jnp.float32 or _width(d_qk, d_v) <= MAX_F32_WIDTH


def gpu_capability() -> Optional[tuple[int, int]]:
    """``(major, minor)`` compute capability of the local GPU ((9, 0): H100/H200), or None
    when there is none (e.g. compiling for a GPU from a CPU host)."""
    if jax.default_backend() != "gpu":
        return None
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if not capability:
        return None
    major, _, minor = str(capability).partition(".")
    return int(major), int(minor or 0)


def gpu_generation() -> Optional[int]:
    """Compute-capability major of the local GPU (9: H100/H200, 8: A100), or None when
    there is none (e.g. compiling for a GPU from a CPU host): defaults then take the
    values that compile on both."""
    capability = gpu_capability()
    return None if capability is None else capability[0]


def launch(kind: str, rows: int, d_qk: int, d_v: int, dtype, *,
           segments: bool = False) -> plgpu.CompilerParams:
    """Warps and software-pipeline stages of one kernel (``kind``: fwd, dq, dkv) whose
    programs own ``rows`` tokens (measured with ``experiments/gpu_resources.py``:
    no spills on sm_80 or sm_90 at the default tiles). ``segments``: the call masks by
    per-token ids, segment or bidirectional (the dk/dv kernel then holds each query
    tile's ids too)."""
    width = _width(d_qk, d_v)
    fp8 = jnp.dtype(dtype).itemsize == 1
    if jnp.dtype(dtype) == jnp.float32:  # TF32x3 operands: three registers per value
        return plgpu.CompilerParams(num_warps=4 if width <= 128 else 8,
                                    num_stages=1 if kind == "dkv" or width > 128 else 2)
    size = rows * width
    if kind == "dq":
        # FP8 (one-byte operands, _fp8's kernels): sm_90a's dq at width 256 spills on 4.
        warps = 4 if size <= 64 * 128 and not (fp8 and width > 128) else 8
    else:  # fwd and dkv hold two [rows, width] float32 accumulators' worth
        warps = 4 if size <= 32 * 64 else 8
    if kind != "dkv":
        stages = 3 if width <= 128 else 2
    elif segments:  # sm_90's dk/dv with segment ids at width 128 spills with two stages
        stages = 1
    else:  # sm_80's dk/dv at width 256 spills with two stages, sm_90's does not
        stages = 2 if width <= 128 or gpu_generation() == 9 else 1
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)
