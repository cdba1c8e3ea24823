"""Local attention kernels (``xla``, ``pallas``) against :mod:`jax_seqpar.core.reference`,
and the contract every kernel shares (:mod:`jax_seqpar.kernels.contract`).

Every case checks ``out``, ``lse`` and the gradients of a random-weighted sum of
both (so the ``lse`` cotangent path is exercised) w.r.t. q, k and v. Tiles are 16
tokens, so a few dozen tokens already give several tiles and a ragged tail. The
Pallas kernel runs in interpret mode here (CPU); its Triton lowering is checked
separately, without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_seqpar import kernels
from jax_seqpar.core import masks, reference
from jax_seqpar.core.masks import MaskSpec, Tokens

KERNELS = ["xla", "pallas"]
BLOCK = 16


class Case(NamedTuple):
    """One attention problem; its tokens are a function of it (:func:`_tokens`)."""

    batch: int = 2
    q_len: int = 32
    kv_len: Optional[int] = None  # None: self-attention (kv_len = q_len)
    heads: int = 2
    kv_heads: int = 2
    d_qk: int = 16
    d_v: int = 16
    causal: bool = False
    window: Optional[tuple[int, int]] = None
    segments: bool = False  # documents ending at different tokens in each row
    q_start: Optional[int] = None  # first query position; None: the last q_len keys
    hole: bool = False  # keys 16..31 are a document that no query belongs to

    @property
    def keys(self):
        return self.kv_len or self.q_len


CASES = [
    pytest.param(Case(), id="mha"),
    pytest.param(Case(heads=4, kv_heads=2, causal=True), id="gqa_causal"),
    pytest.param(Case(heads=4, kv_heads=1, window=(7, 3)), id="mqa_window"),
    pytest.param(Case(q_len=48, causal=True, window=(12, 0)), id="causal_window"),
    pytest.param(Case(q_len=48, causal=True, segments=True), id="segments_causal"),
    pytest.param(Case(d_qk=24, d_v=8), id="dv_ne_dqk"),
    pytest.param(Case(q_len=37, heads=4, kv_heads=2, causal=True, segments=True), id="ragged"),
    pytest.param(Case(q_len=24, kv_len=40, causal=True), id="cross_positions"),
]
BF16_CASES = [p for p in CASES if p.id in ("gqa_causal", "segments_causal", "ragged")]


def _tokens(case: Case):
    """``(q_tokens, kv_tokens)`` of a case."""
    kv_positions = jnp.broadcast_to(jnp.arange(case.keys, dtype=jnp.int32),
                                    (case.batch, case.keys))
    start = case.keys - case.q_len if case.q_start is None else case.q_start
    q_positions = jnp.broadcast_to(jnp.arange(start, start + case.q_len, dtype=jnp.int32),
                                   (case.batch, case.q_len))
    if case.hole:
        kv_segments = ((kv_positions >= 16) & (kv_positions < 32)).astype(jnp.int32)
        return Tokens(q_positions, jnp.zeros_like(q_positions)), Tokens(kv_positions, kv_segments)
    if not case.segments:
        return Tokens(q_positions), Tokens(kv_positions)
    ends = jnp.array([[case.keys // 3], [case.keys // 2]])[: case.batch]
    kv_segments = (kv_positions >= ends).astype(jnp.int32) + (kv_positions >= case.keys - 5)
    return Tokens(q_positions, kv_segments[:, start:start + case.q_len]), Tokens(
        kv_positions, kv_segments)


def _inputs(case: Case, dtype):
    """``(q, k, v)`` in ``dtype`` and float32 weights for ``out`` and ``lse``."""
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (case.batch, case.q_len, case.heads, case.d_qk), dtype)
    k = jax.random.normal(keys[1], (case.batch, case.keys, case.kv_heads, case.d_qk), dtype)
    v = jax.random.normal(keys[2], (case.batch, case.keys, case.kv_heads, case.d_v), dtype)
    out_weights = jax.random.normal(keys[3], (case.batch, case.q_len, case.heads, case.d_v))
    lse_weights = jax.random.normal(keys[4], (case.batch, case.q_len, case.heads))
    return (q, k, v), (out_weights, lse_weights)


def _value_and_grads(attend, inputs, weights):
    """``(out, lse, (dq, dk, dv))`` of ``sum(out * w_out) + sum(lse * w_lse)``."""
    out_weights, lse_weights = weights

    def loss(q, k, v):
        out, lse = attend(q, k, v)
        value = jnp.sum(out.astype(jnp.float32) * out_weights) + jnp.sum(lse * lse_weights)
        return value, (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*inputs)
    return out, lse, grads


@functools.cache
def _expected(case: Case, dtype):
    """Reference results on the case's inputs (bf16 inputs upcast), shared by kernels."""
    spec = MaskSpec.make(case.causal, case.window)
    q_tokens, kv_tokens = _tokens(case)

    def attend(q, k, v):
        return reference.attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), causal=spec.causal,
            window=spec.window, scale=case.d_qk**-0.5,
            positions=q_tokens.positions, segment_ids=q_tokens.segment_ids,
            kv_positions=kv_tokens.positions, kv_segment_ids=kv_tokens.segment_ids,
            return_lse=True)

    return _value_and_grads(attend, *_inputs(case, dtype))


def _run_kernel(kernel: str, case: Case, dtype, poison: Optional[slice] = None):
    """Kernel results on the case's inputs, keys/values in ``poison`` set to NaN."""
    module = kernels.get(kernel)
    block_sizes = module.BlockSizes(
        **{f.name: BLOCK for f in dataclasses.fields(module.BlockSizes)})
    spec = MaskSpec.make(case.causal, case.window)
    q_tokens, kv_tokens = _tokens(case)
    (q, k, v), weights = _inputs(case, dtype)
    if poison is not None:
        k, v = k.at[:, poison].set(jnp.nan), v.at[:, poison].set(jnp.nan)

    def attend(q, k, v):
        return module.attention(q, k, v, q_tokens, kv_tokens, spec=spec,
                                scale=case.d_qk**-0.5, block_sizes=block_sizes)

    return _value_and_grads(attend, (q, k, v), weights)


def _check(kernel: str, case: Case, dtype, tolerances, poison=None):
    """Shapes and dtypes first, then values against the reference."""
    results = _run_kernel(kernel, case, dtype, poison)
    out, lse, grads = results
    assert out.shape == (case.batch, case.q_len, case.heads, case.d_v)
    assert lse.shape == (case.batch, case.q_len, case.heads)
    assert out.dtype == lse.dtype == jnp.float32
    assert [g.shape for g in grads] == [x.shape for x in _inputs(case, dtype)[0]]
    assert [g.dtype for g in grads] == [dtype] * 3
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, wanted in zip(names, jax.tree.leaves(results),
                                 jax.tree.leaves(_expected(case, dtype))):
        kind = "grad" if name.startswith("d") else "out"
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(wanted, np.float32),
                                   err_msg=name, **tolerances(dtype, kind))
    return results


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_fp32(kernel, case, tolerances):
    _check(kernel, case, jnp.float32, tolerances)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", BF16_CASES)
def test_matches_reference_bf16(kernel, case, tolerances):
    _check(kernel, case, jnp.bfloat16, tolerances)


@pytest.mark.parametrize("kernel", KERNELS)
def test_query_that_sees_no_key(kernel, tolerances):
    """Queries at positions -8..-1 (causal, keys at 0..) get zeros, EMPTY_LSE, finite grads."""
    case = Case(batch=1, q_len=16, kv_len=32, causal=True, q_start=-8)
    out, lse, grads = _check(kernel, case, jnp.float32, tolerances)
    assert np.all(np.asarray(out[:, :8]) == 0)
    assert np.all(np.asarray(lse[:, :8]) == masks.EMPTY_LSE)
    assert np.all(np.asarray(grads[0][:, :8]) == 0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


SKIP_CASES = [
    # Key tiles 1 and 2 come after every query (causal): outside the loop bounds.
    pytest.param(Case(batch=1, q_len=16, kv_len=48, causal=True, q_start=0), id="causal_tail"),
    # Key tile 1 is a document no query is in, between two visible tiles: inside the
    # loop bounds, skipped by its class.
    pytest.param(Case(batch=1, q_len=32, kv_len=48, hole=True), id="segment_hole"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", SKIP_CASES)
def test_empty_tiles_are_skipped(kernel, case, tolerances):
    """NaN keys and values in EMPTY tiles leave every result exact, so those tiles are
    never computed (a masked computation would still give ``0 * NaN = NaN``).

    The Pallas kernel skips EMPTY tiles through per-row loop bounds (no branch per
    tile, so its loads pipeline): an EMPTY tile between visible ones is computed
    fully masked, exact for finite keys and values, so it gets no NaN there.
    """
    poison = slice(16, 48) if case.causal else slice(16, 32)
    interior = not case.causal
    q_tokens, kv_tokens = _tokens(case)
    classes = np.asarray(masks.classify(MaskSpec.make(case.causal, case.window),
                                        masks.summarize(q_tokens, BLOCK),
                                        masks.summarize(kv_tokens, BLOCK)))
    assert (classes[:, poison.start // BLOCK:poison.stop // BLOCK] == masks.EMPTY).all()
    results = _check(kernel, case, jnp.float32, tolerances,
                     None if interior and kernel == "pallas" else poison)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(results))


def test_pallas_lowers_to_triton():
    """Forward and both backward kernels lower to Triton (GPU) IR without a GPU.

    Compiling and running them on a GPU is left to ``experiments/kernel_bench.py``.
    """
    pallas = kernels.get("pallas")
    q = jax.ShapeDtypeStruct((1, 200, 6, 40), jnp.bfloat16)  # ragged, GQA, odd head dims
    k = jax.ShapeDtypeStruct((1, 200, 2, 40), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 200, 2, 24), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 200), jnp.int32)

    def grads(q, k, v, positions, segment_ids):
        tokens = Tokens(positions, segment_ids)

        def loss(q, k, v):
            out, lse = pallas.attention(q, k, v, tokens, tokens, scale=0.1, interpret=False,
                                        spec=MaskSpec.make(causal=True, window=(64, 0)))
            return out.sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    exported = jax.export.export(
        jax.jit(grads), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, k, v, ids, ids)
    module = exported.mlir_module()
    for name in ("seqpar_flash_forward", "seqpar_flash_dq", "seqpar_flash_dkv"):
        assert f'name = "{name}"' in module


def test_pallas_validation():
    pallas = kernels.get("pallas")
    with pytest.raises(ValueError, match="block_q=0"):
        pallas.BlockSizes(block_q=0)
    q = jnp.zeros((1, 32, 3, 16))
    k = jnp.zeros((1, 32, 2, 16))
    tokens = Tokens(jnp.zeros((1, 32), jnp.int32))
    with pytest.raises(ValueError, match="heads=3 must be a multiple of kv_heads=2"):
        pallas.forward(q, k, k, tokens, tokens, spec=MaskSpec(), scale=1.0)
    with pytest.raises(ValueError, match="power of two >= 16"):
        pallas.forward(q, q, q, tokens, tokens, spec=MaskSpec(), scale=1.0, interpret=False,
                       block_sizes=pallas.BlockSizes(block_q=24))
    with pytest.raises(ValueError, match="share one of"):
        pallas.forward(q, q.astype(jnp.bfloat16), q, tokens, tokens, spec=MaskSpec(), scale=1.0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_backward_accumulates(kernel):
    """``backward(..., accumulate=g)`` returns the gradients plus ``g`` (ragged tiles too)."""
    module = kernels.get(kernel)
    case = Case(q_len=37, heads=4, kv_heads=2, causal=True, segments=True)
    spec = MaskSpec.make(case.causal, case.window)
    q_tokens, kv_tokens = _tokens(case)
    (q, k, v), (dout, _) = _inputs(case, jnp.float32)
    block_sizes = module.BlockSizes(
        **{f.name: BLOCK for f in dataclasses.fields(module.BlockSizes)})
    kwargs = dict(spec=spec, scale=case.d_qk**-0.5, block_sizes=block_sizes)
    out, lse = module.forward(q, k, v, q_tokens, kv_tokens, **kwargs)
    delta = jnp.sum(dout * out, axis=-1)
    args = (q, k, v, q_tokens, kv_tokens, lse, delta, dout)
    plain = module.backward(*args, **kwargs)
    totals = tuple(jax.random.normal(jax.random.key(i), g.shape) for i, g in enumerate(plain))
    summed = module.backward(*args, accumulate=totals, **kwargs)
    for got, grad, total in zip(summed, plain, totals):
        np.testing.assert_allclose(got, grad + total, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_forward_accumulates(kernel):
    """``forward(..., accumulate=(out, lse))`` continues a result over earlier keys: keys
    split in two runs give the result over all of them, rows that see no key in one of
    the runs included (documents and the causal mask leave some empty in each)."""
    module = kernels.get(kernel)
    case = Case(q_len=37, kv_len=48, heads=4, kv_heads=2, causal=True, segments=True)
    q_tokens, kv_tokens = _tokens(case)
    (q, k, v), _ = _inputs(case, jnp.float32)
    block_sizes = module.BlockSizes(block_q=BLOCK, block_k=BLOCK)
    kwargs = dict(spec=MaskSpec.make(case.causal), scale=case.d_qk**-0.5,
                  block_sizes=block_sizes)
    full = module.forward(q, k, v, q_tokens, kv_tokens, **kwargs)
    part = lambda x, s: jax.tree.map(lambda a: a[:, s], x)  # noqa: E731
    first, rest = slice(0, 24), slice(24, None)
    earlier = module.forward(q, part(k, first), part(v, first), q_tokens,
                             part(kv_tokens, first), **kwargs)
    assert bool(jnp.any(earlier[1] == masks.EMPTY_LSE))  # some rows saw no key yet
    both = jax.jit(lambda acc: module.forward(
        q, part(k, rest), part(v, rest), q_tokens, part(kv_tokens, rest), accumulate=acc,
        **kwargs))(earlier)
    for got, want in zip(both, full):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="accumulate must be"):
        module.forward(q, k, v, q_tokens, kv_tokens, accumulate=(earlier[0],), **kwargs)


# The kernel contract (jax_seqpar.kernels.contract): one BlockSizes, one custom_vjp.

def test_one_block_sizes_class_for_every_kernel():
    from jax_seqpar.kernels import contract, xla
    from jax_seqpar.kernels.tpu import mosaic
    from jax_seqpar.kernels.gpu import pallas

    assert (xla.BlockSizes is pallas.BlockSizes is mosaic.BlockSizes is kernels.BlockSizes
            is contract.BlockSizes)
    for name in kernels.KERNELS:
        assert kernels.get(name).BlockSizes is kernels.BlockSizes


@pytest.mark.parametrize("sizes", [dict(block_q=0), dict(block_k=1.5), dict(block_q_bwd=True),
                                   dict(block_k_bwd="64")])
def test_block_sizes_must_be_positive_ints(sizes):
    name = next(iter(sizes))
    with pytest.raises(ValueError, match=f"{name}=.* must be a positive int"):
        kernels.BlockSizes(**sizes)


@pytest.mark.parametrize("kernel,defaults", [
    ("xla", (256, 256, 256, 256)),
    ("pallas", (64, 32, 32, 32)),  # float32 at head dims <= 64
    ("mosaic", (512, 512, 256, 512)),
])
def test_sizes_left_none_are_the_kernels_defaults(kernel, defaults, monkeypatch):
    """A partial BlockSizes is completed from the kernel's ``default_block_sizes``."""
    module = importlib.import_module(f"jax_seqpar.kernels.{kernel}")
    q = jnp.zeros((1, 32, 2, 16))
    tokens = Tokens(jnp.zeros((1, 32), jnp.int32))
    assert module.default_block_sizes(16, 16, jnp.float32) == kernels.BlockSizes(*defaults)
    seen = []
    monkeypatch.setattr(module, "_forward", lambda *args, block_sizes, **kw: seen.append(
        block_sizes))
    extra = dict(interpret=True) if kernel == "pallas" else {}
    for given in (None, kernels.BlockSizes(block_k=128)):
        module.forward(q, q, q, tokens, tokens, spec=MaskSpec(), scale=1.0, block_sizes=given,
                       **extra)
    assert seen == [kernels.BlockSizes(*defaults),
                    kernels.BlockSizes(defaults[0], 128, *defaults[2:])]
    assert kernels.BlockSizes(block_k=128).resolve(kernels.BlockSizes(1, 2, 3, 4)) == (
        kernels.BlockSizes(1, 128, 3, 4))


@pytest.mark.parametrize("sizes,check,message", [
    (dict(block_q=24), "check_gpu",
     "block_q=24 must be a power of two >= 16 for the Triton (GPU) lowering; use e.g. 32."),
    (dict(block_k_bwd=8), "check_gpu",
     "block_k_bwd=8 must be a power of two >= 16 for the Triton (GPU) lowering; use e.g. 16."),
    (dict(block_k=200), "check_tpu",
     "block_k=200 must be a positive multiple of 128 (the TPU lane width); use e.g. 256."),
    (dict(block_q_bwd=64), "check_tpu",
     "block_q_bwd=64 must be a positive multiple of 128 (the TPU lane width); use e.g. 128."),
])
def test_block_sizes_platform_checks(sizes, check, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(kernels.BlockSizes(**sizes), check)()
    every = kernels.BlockSizes(128, 256, None, 512)  # None: the kernel's default
    every.check_gpu()
    every.check_tpu()


@pytest.mark.parametrize("kernel,sizes,fragments", [
    ("auto", dict(block_q=8), ["pallas: block_q=8 must be a power of two >= 16",
                               "mosaic: block_q=8 must be a positive multiple of 128",
                               "multiples of 128 such as 128/256/512"]),
    ("auto", dict(block_k=64), ["mosaic: block_k=64 must be a positive multiple of 128"]),
    ("pallas", dict(block_q_bwd=24), ["pallas: block_q_bwd=24 must be a power of two >= 16"]),
])
@pytest.mark.parametrize("method", ["forward", "attention"])
def test_per_platform_tiles_every_kernel_takes(kernel, sizes, fragments, method):
    """Under ``auto`` / ``pallas`` tiles apply to whichever kernel runs: sizes that some
    platform's kernel cannot take are a ValueError in the call, naming the fix."""
    q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.bfloat16)
    tokens = Tokens(jnp.zeros((1, 32), jnp.int32))

    def call(sizes):
        fn = getattr(kernels.get(kernel), method)
        return jax.eval_shape(lambda q: fn(q, q, q, tokens, tokens, spec=MaskSpec(), scale=1.0,
                                           block_sizes=sizes), q)

    with pytest.raises(ValueError) as error:
        call(kernels.BlockSizes(**sizes))
    for fragment in [*fragments, "kernel='xla'"]:
        assert fragment in str(error.value)
    out, lse = call(kernels.BlockSizes(128, 256, 128, 512))  # every kernel takes these
    assert out.shape == (1, 32, 2, 16) and lse.dtype == jnp.float32


def test_options_reject_other_tile_objects():
    from jax_seqpar.strategies.inputs import Options

    q = jnp.zeros((1, 32, 2, 16))
    with pytest.raises(ValueError, match="is not a jax_seqpar.kernels.BlockSizes"):
        Options.make(q, causal=True, window=None, scale=None, kernel="auto",
                     block_sizes=(128, 128, 128, 128))


@pytest.mark.parametrize("kernel", ["xla", "pallas", "mosaic"])
def test_residual_out_is_kept_in_the_input_dtype(kernel):
    """The custom_vjp saves ``out`` in bf16 for bf16 inputs (``lse`` in float32)."""
    module = importlib.import_module(f"jax_seqpar.kernels.{kernel}")
    extra = dict(interpret=True) if kernel == "pallas" else {}
    batch, seq, heads, kv_heads, d_qk, d_v = 1, 32, 4, 2, 32, 16  # out's shape is its own
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, d_qk), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, d_qk), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, d_v), jnp.bfloat16)
    tokens = Tokens(jnp.arange(seq, dtype=jnp.int32)[None])
    (out, lse), vjp = jax.vjp(
        lambda q, k, v: module.attention(q, k, v, tokens, tokens, spec=MaskSpec.make(True),
                                         scale=0.25, **extra), q, k, v)
    assert out.dtype == lse.dtype == jnp.float32
    residuals = [x for x in jax.tree.leaves(vjp) if hasattr(x, "dtype")]
    saved_out = [x for x in residuals if x.shape == (batch, seq, heads, d_v)]
    assert saved_out and all(x.dtype == jnp.bfloat16 for x in saved_out), [
        (x.shape, x.dtype) for x in residuals]
    assert any(x.shape == (batch, seq, heads) and x.dtype == jnp.float32 for x in residuals)
    np.testing.assert_array_equal(np.asarray(saved_out[0], np.float32),
                                  np.asarray(out.astype(jnp.bfloat16), np.float32))
    grads = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
