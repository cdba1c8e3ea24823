"""The Pallas kernel (interpret mode) on every head dim it supports, softcap and decode rows.

Each case checks ``out``, ``lse`` and the gradients of a random-weighted sum of both
w.r.t. q, k and v against :mod:`jax_seqpar.core.reference`, with 16-token tiles so a few
dozen tokens give several tiles and a ragged tail. Each head-dim case also carries a
different mask / GQA combination, so the suite stays small.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_seqpar.core import reference
from jax_seqpar.kernels.gpu import _core as _pallas_core, pallas
from jax_seqpar.core.masks import MaskSpec, Tokens

BLOCKS = pallas.BlockSizes(16, 16, 16, 16)


class Case(NamedTuple):
    d_qk: int
    d_v: int
    heads: int = 2
    kv_heads: int = 1
    q_len: int = 24
    kv_len: int = 24
    causal: bool = False
    window: Optional[tuple[int, int]] = None
    segments: bool = False  # a second document starts at key 10
    softcap: Optional[float] = None


HEAD_DIM_CASES = [
    pytest.param(Case(64, 64, heads=4, window=(5, 3)), id="64-mqa-window"),
    pytest.param(Case(80, 80, heads=4, kv_heads=2, causal=True, segments=True),
                 id="80-gqa-causal-segments"),
    pytest.param(Case(96, 96, q_len=20, kv_len=40, causal=True), id="96-cross"),
    pytest.param(Case(128, 128, causal=True, window=(9, 0)), id="128-causal-window"),
    pytest.param(Case(192, 192, kv_heads=2, segments=True), id="192-segments"),
    pytest.param(Case(256, 256, causal=True), id="256-causal"),
    pytest.param(Case(192, 128, heads=4, causal=True), id="192_128-deepseek"),
    pytest.param(Case(576, 512, heads=4, causal=True), id="576_512-mla"),
]


def _tokens(case: Case):
    kv_positions = jnp.arange(case.kv_len, dtype=jnp.int32)[None]
    q_positions = kv_positions[:, case.kv_len - case.q_len:]
    if not case.segments:
        return Tokens(q_positions), Tokens(kv_positions)
    kv_segments = (kv_positions >= 10).astype(jnp.int32)
    return (Tokens(q_positions, kv_segments[:, case.kv_len - case.q_len:]),
            Tokens(kv_positions, kv_segments))


def _inputs(case: Case, dtype):
    keys = jax.random.split(jax.random.key(case.d_qk + case.heads), 5)
    q = jax.random.normal(keys[0], (1, case.q_len, case.heads, case.d_qk), dtype)
    k = jax.random.normal(keys[1], (1, case.kv_len, case.kv_heads, case.d_qk), dtype)
    v = jax.random.normal(keys[2], (1, case.kv_len, case.kv_heads, case.d_v), dtype)
    weights = (jax.random.normal(keys[3], (1, case.q_len, case.heads, case.d_v)),
               jax.random.normal(keys[4], (1, case.q_len, case.heads)))
    return (q, k, v), weights


def _value_and_grads(attend, inputs, weights):
    def loss(q, k, v):
        out, lse = attend(q, k, v)
        value = jnp.sum(out.astype(jnp.float32) * weights[0]) + jnp.sum(lse * weights[1])
        return value, (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*inputs)
    return out, lse, grads


def _check(case: Case, dtype, tolerances):
    q_tokens, kv_tokens = _tokens(case)
    spec = MaskSpec.make(case.causal, case.window)
    scale = case.d_qk**-0.5
    inputs, weights = _inputs(case, dtype)

    def kernel(q, k, v):
        return pallas.attention(q, k, v, q_tokens, kv_tokens, spec=spec, scale=scale,
                                softcap=case.softcap, block_sizes=BLOCKS)

    def expected(q, k, v):
        return reference.attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), causal=case.causal,
            window=case.window, scale=scale, softcap=case.softcap,
            positions=q_tokens.positions, segment_ids=q_tokens.segment_ids,
            kv_positions=kv_tokens.positions, kv_segment_ids=kv_tokens.segment_ids,
            return_lse=True)

    got = _value_and_grads(kernel, inputs, weights)
    wanted = _value_and_grads(expected, inputs, weights)
    assert got[0].shape == (1, case.q_len, case.heads, case.d_v)
    assert [g.dtype for g in got[2]] == [dtype] * 3
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), jax.tree.leaves(got),
                          jax.tree.leaves(wanted)):
        kind = "grad" if name.startswith("d") else "out"
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   err_msg=name, **tolerances(dtype, kind))


@pytest.mark.parametrize("case", HEAD_DIM_CASES)
def test_head_dims(case, tolerances):
    _check(case, jnp.float32, tolerances)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softcap(dtype, tolerances):
    """Softcap 2.0 bends scores of size ~1-3: fwd and the (1 - tanh^2) backward."""
    _check(Case(32, 32, heads=4, kv_heads=2, causal=True, segments=True, softcap=2.0), dtype,
           tolerances)


def test_decode_rows_fold_the_group(tolerances):
    """Two new tokens of an 8-head MQA group share one K/V pass (fold), exact."""
    assert _pallas_core.folds_group(2, 8, 1)
    _check(Case(64, 64, heads=8, q_len=2, kv_len=40, causal=True), jnp.float32, tolerances)


def test_decode_splits_the_cache(monkeypatch, tolerances):
    """A decode step with few programs splits the cache into runs (split-K, the last
    run padded) and merges them exactly; a long call that fills the GPU does not."""
    assert _pallas_core.kv_splits(8, 1, 65536, 64) == 16  # 8 programs -> 128
    assert _pallas_core.kv_splits(8, 1, 2048, 64) == 8  # runs keep 256 keys
    assert _pallas_core.kv_splits(8, 2, 65536, 64) == 1  # two query tiles: prefill
    assert _pallas_core.kv_splits(256, 1, 65536, 64) == 1  # the GPU is full
    monkeypatch.setattr(_pallas_core, "MIN_SPLIT_KEYS", 16)
    assert _pallas_core.kv_splits(1, 1, 45, 16) == 2
    _check(Case(64, 64, heads=4, kv_heads=1, q_len=1, kv_len=45, causal=True, segments=True),
           jnp.float32, tolerances)  # MQA group folded, then 2 runs of 23 keys


def test_head_dim_chunks():
    """Wide head dims become few power-of-two chunks; narrow ones one masked chunk."""
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


def test_softcap_validation():
    q = jnp.zeros((1, 16, 1, 16))
    tokens = Tokens(jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ValueError, match="softcap must be a positive float"):
        pallas.forward(q, q, q, tokens, tokens, spec=MaskSpec(), scale=1.0, softcap=-1.0)


def test_lowering_follows_the_platform():
    """With ``interpret=None`` the kernel is Triton when lowered for CUDA and the
    interpreter when lowered for CPU, whatever the default backend (here CPU)."""
    q = jax.ShapeDtypeStruct((1, 32, 2, 80), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 32), jnp.int32)

    def grads(q, positions):
        tokens = Tokens(positions)

        def loss(q):
            out, lse = pallas.attention(q, q, q, tokens, tokens, scale=0.1,
                                        spec=MaskSpec.make(causal=True))
            return out.sum() + lse.sum()

        return jax.grad(loss)(q)

    def module(platform):
        return jax.export.export(
            jax.jit(grads), platforms=[platform],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(q, ids).mlir_module()

    cuda, cpu = module("cuda"), module("cpu")
    for name in ("seqpar_flash_forward", "seqpar_flash_dq", "seqpar_flash_dkv"):
        assert f'name = "{name}"' in cuda
    assert "__gpu$xla.gpu.triton" in cuda and "__gpu$xla.gpu.triton" not in cpu


@pytest.mark.parametrize("by_key", [False, True])
def test_tile_bounds_in_chunks(by_key, monkeypatch):
    """Bounds built a few rows at a time (remainder included) match the whole table's,
    per batch row (the second row holds other documents)."""
    from jax_seqpar.core import masks
    from jax_seqpar.kernels.tiling import Tiling

    monkeypatch.setattr(_pallas_core, "BOUNDS_CHUNK", 3)
    positions = jnp.broadcast_to(jnp.arange(112, dtype=jnp.int32), (2, 112))
    tokens = Tokens(positions, jnp.stack([positions[0] // 40, positions[1] // 24]))
    spec = MaskSpec.make(causal=True, window=(30, 0))
    t = Tiling(2, 1, 1, 112, 112, 16, 16)  # 7 x 7 tiles: chunks of 3, 3, 1
    summary = masks.summarize(tokens, 16, per_row=True)
    classes = masks.classify(spec, summary, summary)  # [2, 7, 7]
    expected = jnp.stack([_pallas_core.row_bounds(c.T if by_key else c) for c in classes])
    np.testing.assert_array_equal(
        _pallas_core.tile_bounds(spec, t, tokens, tokens, by_key=by_key), expected)
