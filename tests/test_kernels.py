"""Every local kernel (``xla``, ``pallas``, ``mosaic``) against :mod:`jax_seqpar.core.reference`
on one matrix of cases (``tests/kernel_cases.py``), and the contract every kernel shares
(:mod:`jax_seqpar.kernels.contract`).

Each case checks ``out``, ``lse`` and the gradients of a random-weighted sum of both (so
the ``lse`` cotangent path is exercised) w.r.t. q, k and v, on every kernel at its tile
(16 tokens; Mosaic: 128, the case scaled by 8). The Pallas and Mosaic kernels run in the
Pallas interpreter here (CPU); their Triton and Mosaic lowerings are checked in
``test_pallas.py`` / ``test_mosaic.py`` and compiled by the compile gate. The default tier
runs every case on the XLA kernel and a few on the interpreted kernels (:data:`DEFAULT`);
the rest of the interpreted matrix is the ``interpret`` tier.
"""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checks
import kernel_cases as kc
from jax_seqpar import kernels
from jax_seqpar.core import blocks, masks, reference
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.kernels.options import Options
from jax_seqpar.kernels import make_options
from kernel_cases import Case

CASES = [
    pytest.param(Case(), id="mha"),
    pytest.param(Case(heads=4, kv_heads=2, causal=True), id="gqa_causal"),
    pytest.param(Case(heads=4, kv_heads=1, window=(7, 3)), id="mqa_window"),
    pytest.param(Case(q_len=48, causal=True, window=(12, 0)), id="causal_window"),
    pytest.param(Case(q_len=48, causal=True, segments=True), id="segments_causal"),
    pytest.param(Case(heads=4, kv_heads=1, d_qk=24, d_v=8, causal=True), id="mqa_dv_ne_dqk"),
    pytest.param(Case(q_len=37, heads=4, kv_heads=2, causal=True, segments=True), id="ragged"),
    pytest.param(Case(q_len=24, kv_len=40, causal=True), id="cross_positions"),
    pytest.param(Case(q_len=24, kv_len=40), id="cross_full"),
    # Softcap 2.0 bends scores of size ~1-3: the forward and the (1 - tanh^2) backward.
    pytest.param(Case(heads=4, kv_heads=2, d_qk=32, d_v=32, causal=True, segments=True,
                      softcap=2.0), id="gqa_segments_softcap"),
]
BF16_CASES = [p for p in CASES if p.id in ("gqa_causal", "segments_causal", "ragged",
                                           "gqa_segments_softcap")]
#: What the default tier runs of the interpreted kernels (the XLA kernel runs every case):
#: each forward and backward on GQA, causal, documents and a ragged tail, and soft-capping.
DEFAULT = {"fp32": {"ragged", "gqa_segments_softcap"}, "bf16": {"ragged"}}


def _tier(table):
    def marks(kernel, case_id):
        return [] if kernel == "xla" or case_id in table else [pytest.mark.interpret]
    return marks


@pytest.mark.parametrize("kernel,case", kc.matrix(CASES, marks=_tier(DEFAULT["fp32"])))
def test_matches_reference_fp32(kernel, case, tolerances):
    kc.check(kernel, kc.for_kernel(case, kernel), jnp.float32, tolerances)


@pytest.mark.parametrize("kernel,case", kc.matrix(BF16_CASES, marks=_tier(DEFAULT["bf16"])))
def test_matches_reference_bf16(kernel, case, tolerances):
    kc.check(kernel, kc.for_kernel(case, kernel), jnp.bfloat16, tolerances)


@pytest.mark.parametrize("kernel", kc.KERNELS)
def test_query_that_sees_no_key(kernel, tolerances):
    """Queries before every key (causal) get zeros, EMPTY_LSE and zero, finite grads."""
    case = kc.for_kernel(Case(batch=1, q_len=16, kv_len=32, causal=True, q_start=-8), kernel)
    blind = -case.q_start  # the first queries, at positions -8..-1 (scaled)
    out, lse, grads = kc.check(kernel, case, jnp.float32, tolerances)
    assert np.all(np.asarray(out[:, :blind]) == 0)
    assert np.all(np.asarray(lse[:, :blind]) == masks.EMPTY_LSE)
    assert np.all(np.asarray(grads[0][:, :blind]) == 0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


SKIP_CASES = [
    # Key tiles 1 and 2 come after every query (causal): outside the loop bounds.
    pytest.param(Case(batch=1, q_len=16, kv_len=48, causal=True, q_start=0), id="causal_tail"),
    # Key tile 1 is a document no query is in, between two visible tiles: inside the
    # loop bounds, skipped by its class.
    pytest.param(Case(batch=1, q_len=32, kv_len=48, hole=True), id="segment_hole"),
]
#: Whether a kernel skips an EMPTY tile between visible ones. The Pallas kernel skips
#: EMPTY tiles through per-row loop bounds (no branch per tile, so its loads pipeline):
#: an EMPTY tile between visible ones is computed fully masked, exact for finite keys
#: and values, so it gets no NaN there.
SKIPS_INTERIOR_TILES = {"xla": True, "pallas": False, "mosaic": True}


@pytest.mark.parametrize("kernel,case", kc.matrix(
    SKIP_CASES, marks=lambda kernel, _: [pytest.mark.interpret] if kernel == "mosaic" else []))
def test_empty_tiles_are_skipped(kernel, case, tolerances, monkeypatch):
    """NaN keys and values in EMPTY tiles leave every result exact, so those tiles are
    never computed (a masked computation would still give ``0 * NaN = NaN`` with the
    kernels' isolation of non-finite numbers, ``contract.isolated`` and
    ``isolated_grads``, turned off here), and no gradient flows into them."""
    from jax_seqpar.kernels import contract
    monkeypatch.setattr(contract, "isolated", lambda *args: args)
    monkeypatch.setattr(contract, "isolated_grads", lambda *args: args)
    case = kc.for_kernel(case, kernel)
    tile = case.tile
    poison = slice(tile, 3 * tile) if case.causal else slice(tile, 2 * tile)
    classes = np.asarray(jax.jit(lambda q_tokens, kv_tokens: blocks.classify(
        MaskSpec.make(case.causal, case.window), blocks.summarize(q_tokens, tile),
        blocks.summarize(kv_tokens, tile)))(*kc.tokens(case)))
    assert (classes[:, poison.start // tile:poison.stop // tile] == blocks.EMPTY).all()
    poisoned = case.causal or SKIPS_INTERIOR_TILES[kernel]
    results = kc.check(kernel, case, jnp.float32, tolerances, poison if poisoned else None)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(results))
    _, _, (_, dk, dv) = results
    assert np.all(np.asarray(dk[:, poison]) == 0) and np.all(np.asarray(dv[:, poison]) == 0)


@pytest.mark.parametrize("kernel", kc.KERNELS)
def test_backward_accumulates(kernel):
    """``backward(..., accumulate=g)`` returns the gradients plus ``g`` (ragged tiles too)."""
    module = kc.Lowered
    case = kc.for_kernel(Case(q_len=37, heads=4, kv_heads=2, causal=True, segments=True),
                         kernel)
    q_tokens, kv_tokens = kc.tokens(case)
    (q, k, v), (dout, _) = kc.inputs(case, jnp.float32)
    options = kc.options(kernel, case)

    @jax.jit
    def plain_and_summed(q, k, v, totals):
        out, lse = module.forward(q, k, v, q_tokens, kv_tokens, options)
        delta = jnp.sum(dout * out, axis=-1)
        args = (q, k, v, q_tokens, kv_tokens, lse, delta, dout, options)
        return module.backward(*args), module.backward(*args, accumulate=totals)

    totals = tuple(checks.normals((q.shape, k.shape, v.shape), seed=2))
    plain, summed = plain_and_summed(q, k, v, totals)
    for got, grad, total in zip(summed, plain, totals):
        np.testing.assert_allclose(got, grad + total, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", kc.KERNELS)
def test_forward_accumulates(kernel):
    """``forward(..., accumulate=(out, lse))`` continues a result over earlier keys: keys
    split in two runs give the result over all of them, rows that see no key in one of
    the runs included (documents and the causal mask leave some empty in each)."""
    module = kc.Lowered
    case = kc.for_kernel(Case(q_len=37, kv_len=48, heads=4, kv_heads=2, causal=True,
                              segments=True), kernel)
    q_tokens, kv_tokens = kc.tokens(case)
    (q, k, v), _ = kc.inputs(case, jnp.float32)
    options = kc.options(kernel, case)
    full = module.forward(q, k, v, q_tokens, kv_tokens, options)
    part = lambda x, s: jax.tree.map(lambda a: a[:, s], x)  # noqa: E731
    split = 24 * case.tile // kc.BASE_TILE  # after 1.5 tiles
    first, rest = slice(0, split), slice(split, None)
    earlier = module.forward(q, part(k, first), part(v, first), q_tokens,
                             part(kv_tokens, first), options)
    assert bool(jnp.any(earlier[1] == masks.EMPTY_LSE))  # some rows saw no key yet
    both = jax.jit(lambda acc: module.forward(
        q, part(k, rest), part(v, rest), q_tokens, part(kv_tokens, rest), options,
        accumulate=acc))(earlier)
    for got, want in zip(both, full):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="accumulate must be"):
        module.forward(q, k, v, q_tokens, kv_tokens, options, accumulate=(earlier[0],))


#: Non-finite numbers in one document's tokens (added, so their gradients are the
#: kernel's): its values, or its keys.
NON_FINITE = {"values": dict(v=np.nan), "keys": dict(k=np.inf)}


@pytest.mark.parametrize("bad", list(NON_FINITE))
@pytest.mark.parametrize("kernel", kc.KERNELS)
def test_non_finite_numbers_stay_in_their_document(kernel, bad, tolerances):
    """One document's values (or keys) non-finite: the other documents' out, lse and
    gradients equal the reference's with those values at zero, through the kernel's
    ``attention`` and its ``forward`` / ``backward`` (a ring's calls); the document's
    rows and gradients are NaN. A tile's products multiply the zero probabilities of
    invisible pairs by every key (``0 * NaN``): NaN values reached the other documents'
    outputs and gradients, inf keys their gradients."""
    case = kc.for_kernel(Case(q_len=48, heads=4, kv_heads=2, causal=True, segments=True),
                         kernel)
    q_tokens, kv_tokens = kc.tokens(case)  # documents 0, 1, 2 in each row
    rows = np.asarray(q_tokens.segment_ids) == 1
    (q, k, v), weights = kc.inputs(case, jnp.float32)
    options = kc.options(kernel, case)
    doc = jnp.asarray(rows)[:, :, None, None]

    def poisoned(q, k, v):
        return [x + jnp.where(doc, NON_FINITE[bad].get(name, 0.0), 0.0)
                for name, x in zip("qkv", (q, k, v))]

    def attention(q, k, v):
        return kc.Lowered.attention(*poisoned(q, k, v), q_tokens, kv_tokens, options)

    def forward_backward(q, k, v):
        q, k, v = poisoned(q, k, v)
        out, lse = kc.Lowered.forward(q, k, v, q_tokens, kv_tokens, options)
        delta = jnp.sum(out * weights[0], axis=-1) - weights[1]
        return out, lse, kc.Lowered.backward(q, k, v, q_tokens, kv_tokens, lse, delta,
                                             weights[0], options)

    def clean(q, k, v):
        return reference.attention(
            q, k, jnp.where(doc, 0.0, v), causal=True, scale=case.d_qk**-0.5,
            segment_ids=q_tokens.segment_ids, return_lse=True)

    expected = kc.value_and_grads(clean, (q, k, v), weights)
    for results in (kc.value_and_grads(attention, (q, k, v), weights),
                    jax.jit(forward_backward)(q, k, v)):
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), jax.tree.leaves(results),
                                   jax.tree.leaves(expected)):
            got, want = np.asarray(got), np.asarray(want)
            np.testing.assert_allclose(got[~rows], want[~rows], err_msg=name,
                                       **tolerances(jnp.float32, "out" if len(name) == 3 else "grad"))
            if name != "lse":
                assert np.isnan(got[rows]).all(), name


# The kernel contract (jax_seqpar.kernels.contract): one BlockSizes, one custom_vjp.

def test_one_block_sizes_class_for_every_kernel():
    from jax_seqpar.kernels import contract, xla
    from jax_seqpar.kernels.tpu import mosaic
    from jax_seqpar.kernels.gpu import pallas

    assert (xla.BlockSizes is pallas.BlockSizes is mosaic.BlockSizes is kernels.BlockSizes
            is contract.BlockSizes)


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
    module = importlib.import_module({"xla": "jax_seqpar.kernels.xla",
                                      "pallas": "jax_seqpar.kernels.gpu.pallas",
                                      "mosaic": "jax_seqpar.kernels.tpu.mosaic"}[kernel])
    q = jnp.zeros((1, 32, 2, 16))
    tokens = Tokens(jnp.zeros((1, 32), jnp.int32))
    assert module.default_block_sizes(16, 16, jnp.float32) == kernels.BlockSizes(*defaults)
    seen = []
    monkeypatch.setattr(module, "_forward", lambda *args, **kw: seen.append(
        args[5].block_sizes))  # (q, k, v, q_tokens, kv_tokens, options, ...)
    extra = dict(interpret=True) if kernel == "pallas" else {}
    for given in (None, kernels.BlockSizes(block_k=128)):
        module.forward(q, q, q, tokens, tokens, Options(MaskSpec(), 1.0, module, given), **extra)
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
        fn = getattr(kc.Lowered, method)
        options = Options(MaskSpec(), 1.0, kernel, sizes)
        return jax.eval_shape(lambda q: fn(q, q, q, tokens, tokens, options), q)

    with pytest.raises(ValueError) as error:
        call(kernels.BlockSizes(**sizes))
    for fragment in [*fragments, "kernel='xla'"]:
        assert fragment in str(error.value)
    out, lse = call(kernels.BlockSizes(128, 256, 128, 512))  # every kernel takes these
    assert out.shape == (1, 32, 2, 16) and lse.dtype == jnp.float32


def test_options_reject_other_tile_objects():
    q = jnp.zeros((1, 32, 2, 16))
    with pytest.raises(ValueError, match="is not a jax_seqpar.kernels.BlockSizes"):
        make_options(q, masks.MaskSpec(causal=True), kernel="auto",
                     block_sizes=(128, 128, 128, 128))


@pytest.mark.parametrize("kernel", ["xla", "pallas", "mosaic"])
def test_residual_out_is_kept_in_the_input_dtype(kernel):
    """The custom_vjp saves ``out`` in bf16 for bf16 inputs (``lse`` in float32)."""
    module = importlib.import_module({"xla": "jax_seqpar.kernels.xla",
                                      "pallas": "jax_seqpar.kernels.gpu.pallas",
                                      "mosaic": "jax_seqpar.kernels.tpu.mosaic"}[kernel])
    extra = dict(interpret=True) if kernel == "pallas" else {}
    batch, seq, heads, kv_heads, d_qk, d_v = 1, 32, 4, 2, 32, 16  # out's shape is its own
    q, k, v = checks.normals([(batch, seq, heads, d_qk), (batch, seq, kv_heads, d_qk),
                              (batch, seq, kv_heads, d_v)], jnp.bfloat16)
    tokens = Tokens(jnp.arange(seq, dtype=jnp.int32)[None])
    # jitted (one program each way): the vjp function is a pytree of the residuals
    (out, lse), vjp = jax.jit(lambda q, k, v: jax.vjp(
        lambda q, k, v: module.attention(q, k, v, tokens, tokens,
                                         Options(MaskSpec.make(True), 0.25, module),
                                         **extra), q, k, v))(q, k, v)
    assert out.dtype == lse.dtype == jnp.float32
    residuals = [x for x in jax.tree.leaves(vjp) if hasattr(x, "dtype")]
    saved_out = [x for x in residuals if x.shape == (batch, seq, heads, d_v)]
    assert saved_out and all(x.dtype == jnp.bfloat16 for x in saved_out), [
        (x.shape, x.dtype) for x in residuals]
    assert any(x.shape == (batch, seq, heads) and x.dtype == jnp.float32 for x in residuals)
    np.testing.assert_array_equal(np.asarray(saved_out[0], np.float32),
                                  np.asarray(out.astype(jnp.bfloat16), np.float32))
    grads = jax.jit(lambda vjp, cotangents: vjp(cotangents))(
        vjp, (jnp.ones_like(out), jnp.zeros_like(lse)))
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
