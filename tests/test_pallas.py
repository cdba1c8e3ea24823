"""What only the Pallas (Triton) kernel has: every head dim it is built for, decode rows,
its tile bounds, its validation and its Triton lowering.

Head-dim and decode cases are cases of the kernel matrix (``tests/kernel_cases.py``):
``out``, ``lse`` and the gradients of a random-weighted sum of both against
:mod:`jax_seqpar.core.reference`, with 16-token tiles, in the Pallas interpreter. Each
head-dim case also carries a different mask / GQA combination, so the suite stays small.
The kernel on the common matrix is in ``test_kernels.py``; its compilation for H100 and
A100 in the compile gate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases as kc
from jax_seqpar.core import blocks
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.kernels.options import Options
from jax_seqpar.kernels.gpu import _core as _pallas_core, _decode as _pallas_decode, pallas
from jax_seqpar.kernels.tiling import Tiling
from kernel_cases import Case


def _head_dims(d_qk, d_v, heads=2, kv_heads=1, q_len=24, kv_len=24, **mask):
    return Case(batch=1, q_len=q_len, kv_len=kv_len, heads=heads, kv_heads=kv_heads,
                d_qk=d_qk, d_v=d_v, **mask)


HEAD_DIM_CASES = [
    pytest.param(_head_dims(64, 64, heads=4, window=(5, 3)), id="64-mqa-window"),
    pytest.param(_head_dims(80, 80, heads=4, kv_heads=2, causal=True, segments=True),
                 id="80-gqa-causal-segments", marks=pytest.mark.interpret),
    pytest.param(_head_dims(96, 96, q_len=20, kv_len=40, causal=True), id="96-cross",
                 marks=pytest.mark.interpret),
    pytest.param(_head_dims(128, 128, causal=True, window=(9, 0)), id="128-causal-window",
                 marks=pytest.mark.interpret),
    pytest.param(_head_dims(192, 192, kv_heads=2, segments=True), id="192-segments",
                 marks=pytest.mark.interpret),
    pytest.param(_head_dims(256, 256, causal=True), id="256-causal",
                 marks=pytest.mark.interpret),
    pytest.param(_head_dims(192, 128, heads=4, causal=True), id="192_128-deepseek",
                 marks=pytest.mark.interpret),
    pytest.param(_head_dims(576, 512, heads=4, causal=True), id="576_512-mla"),
]


@pytest.mark.parametrize("case", HEAD_DIM_CASES)
def test_head_dims(case, tolerances):
    kc.check("pallas", case, jnp.float32, tolerances)


def test_decode_rows_fold_the_group(tolerances):
    """Two new tokens of an 8-head MQA group share one K/V pass (fold), exact."""
    assert _pallas_decode.folds_group(2, 8, 1)
    kc.check("pallas", _head_dims(64, 64, heads=8, q_len=2, kv_len=40, causal=True),
             jnp.float32, tolerances)


def test_decode_splits_the_cache(monkeypatch, tolerances):
    """A decode step with few programs splits the cache into runs (split-K, the last
    run padded) and merges them exactly; a long call that fills the GPU does not."""
    assert _pallas_decode.kv_splits(8, 1, 65536, 64) == 16  # 8 programs -> 128
    assert _pallas_decode.kv_splits(8, 1, 2048, 64) == 8  # runs keep 256 keys
    assert _pallas_decode.kv_splits(8, 2, 65536, 64) == 1  # two query tiles: prefill
    assert _pallas_decode.kv_splits(256, 1, 65536, 64) == 1  # the GPU is full
    monkeypatch.setattr(_pallas_decode, "MIN_SPLIT_KEYS", 16)
    assert _pallas_decode.kv_splits(1, 1, 45, 16) == 2
    # MQA group folded, then 2 runs of 23 keys
    kc.check("pallas", _head_dims(64, 64, heads=4, q_len=1, kv_len=45, causal=True,
                                  segments=True), jnp.float32, tolerances)


def test_head_dim_chunks():
    """Wide head dims become few power-of-two column parts; narrow ones one masked part."""
    assert _pallas_core.HeadDim.of(576).widths == (256, 256, 64)
    assert _pallas_core.HeadDim.of(512).widths == (256, 256)
    assert _pallas_core.HeadDim.of(80).widths == (128,)
    assert _pallas_core.HeadDim.of(264).widths == (256, 16)


def test_row_bounds():
    """(first, full_first, full_end, end) per row, FULL run inside, empty rows zero."""
    e, p, f = 0, 1, 2
    classes = jnp.array([[f, f, p, e], [p, f, f, p], [e, p, e, p], [e, e, e, e]], jnp.int8)
    np.testing.assert_array_equal(_pallas_core.row_bounds(classes),
                                  [[0, 0, 2, 3], [0, 1, 3, 4], [1, 4, 4, 4], [0, 0, 0, 0]])


@pytest.mark.parametrize("by_key", [False, True])
def test_tile_bounds_in_chunks(by_key, monkeypatch):
    """Bounds built a few rows at a time (remainder included) match the whole table's,
    per batch row (the second row holds other documents)."""
    monkeypatch.setattr(_pallas_core, "BOUNDS_CHUNK", 3)
    positions = jnp.broadcast_to(jnp.arange(112, dtype=jnp.int32), (2, 112))
    tokens = Tokens(positions, jnp.stack([positions[0] // 40, positions[1] // 24]))
    spec = MaskSpec.make(causal=True, window=(30, 0))
    t = Tiling(2, 1, 1, 112, 112, 16, 16)  # 7 x 7 tiles: runs of 3, 3, 1
    summary = blocks.summarize(tokens, 16, per_row=True)
    classes = blocks.classify(spec, summary, summary)  # [2, 7, 7]
    expected = jnp.stack([_pallas_core.row_bounds(c.T if by_key else c) for c in classes])
    np.testing.assert_array_equal(
        _pallas_core.tile_bounds(spec, t, tokens, tokens, by_key=by_key), expected)


def test_validation():
    with pytest.raises(ValueError, match="block_q=0"):
        pallas.BlockSizes(block_q=0)
    q = jnp.zeros((1, 32, 3, 16))
    k = jnp.zeros((1, 32, 2, 16))
    tokens = Tokens(jnp.zeros((1, 32), jnp.int32))
    plain = Options(MaskSpec(), 1.0, pallas)
    with pytest.raises(ValueError, match="heads=3 must be a multiple of kv_heads=2"):
        pallas.forward(q, k, k, tokens, tokens, plain)
    with pytest.raises(ValueError, match="power of two >= 16"):
        pallas.forward(q, q, q, tokens, tokens,
                       dataclasses.replace(plain, block_sizes=pallas.BlockSizes(block_q=24)),
                       interpret=False)
    with pytest.raises(ValueError, match="share one of"):
        pallas.forward(q, q.astype(jnp.bfloat16), q, tokens, tokens, plain)
    with pytest.raises(ValueError, match="softcap must be a positive float"):
        pallas.forward(q, q, q, tokens, tokens, dataclasses.replace(plain, softcap=-1.0))


@pytest.mark.parametrize("interpret", [None, False])
def test_lowering_follows_the_platform(interpret):
    """Forward and both backward kernels lower to Triton (GPU) IR without a GPU: with
    ``interpret=None`` when lowered for CUDA (the interpreter when lowered for CPU,
    whatever the default backend, here CPU), and with ``interpret=False`` always.
    Ragged length, GQA and odd head dims; compiling them is the compile gate's."""
    q = jax.ShapeDtypeStruct((1, 200, 6, 40), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 200, 2, 40), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 200, 2, 24), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 200), jnp.int32)

    def grads(q, k, v, positions, segment_ids):
        tokens = Tokens(positions, segment_ids)

        def loss(q, k, v):
            out, lse = pallas.attention(
                q, k, v, tokens, tokens,
                Options(MaskSpec.make(causal=True, window=(64, 0)), 0.1, pallas),
                interpret=interpret)
            return out.sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def module(platform):
        return jax.export.export(
            jax.jit(grads), platforms=[platform],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(q, k, v, ids, ids).mlir_module()

    cuda = module("cuda")
    for name in ("seqpar_flash_forward", "seqpar_flash_dq", "seqpar_flash_dkv"):
        assert f'name = "{name}"' in cuda
    assert "__gpu$xla.gpu.triton" in cuda
    if interpret is None:
        assert "__gpu$xla.gpu.triton" not in module("cpu")
