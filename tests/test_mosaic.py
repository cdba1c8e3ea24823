"""The TPU (Mosaic) kernel in interpret mode against :mod:`jax_seqpar.core.reference`.

Kernel cases check ``out``, ``lse`` and the gradients of a random-weighted sum of
both (so the ``lse`` cotangent path runs) w.r.t. q, k and v. Tiles are 128 tokens
(the TPU lane width), so a few hundred tokens give several tiles, ``EMPTY`` tiles
and a ragged tail. Every strategy then runs end to end with ``kernel="mosaic"``.
The TPU compilation itself is checked in ``test_mosaic_compile.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_seqpar as sp
from jax_seqpar.core import masks, reference
from jax_seqpar.kernels.tpu import mosaic
from jax_seqpar.core.masks import MaskSpec, Tokens

BLOCK = 128
BLOCKS = mosaic.BlockSizes(BLOCK, BLOCK, BLOCK, BLOCK)


class Case(NamedTuple):
    """One attention problem; its tokens are a function of it (:func:`_tokens`)."""

    batch: int = 1
    q_len: int = 256
    kv_len: Optional[int] = None  # None: self-attention (kv_len = q_len)
    heads: int = 2
    kv_heads: int = 2
    d_qk: int = 32
    d_v: int = 32
    causal: bool = False
    window: Optional[tuple[int, int]] = None
    segments: bool = False  # documents ending at different tokens in each row
    q_start: Optional[int] = None  # first query position; None: the last q_len keys
    hole: bool = False  # keys 128..255 are a document no query belongs to
    softcap: Optional[float] = None

    @property
    def keys(self):
        return self.kv_len or self.q_len


CASES = [
    pytest.param(Case(q_len=200, kv_len=328), id="mha_cross_full"),
    pytest.param(Case(batch=2, heads=4, kv_heads=2, causal=True, segments=True),
                 id="gqa_causal_segments"),
    pytest.param(Case(q_len=384, heads=4, kv_heads=1, causal=True, window=(150, 0)),
                 id="mqa_causal_window"),
    pytest.param(Case(q_len=384, window=(100, 30)), id="window"),
    pytest.param(Case(heads=4, kv_heads=1, d_qk=48, d_v=32, causal=True, softcap=5.0),
                 id="mla_dv_ne_dqk_softcap"),
    pytest.param(Case(q_len=300, heads=4, kv_heads=2, causal=True, segments=True), id="ragged"),
    pytest.param(Case(q_len=200, kv_len=328, causal=True), id="cross_positions"),
]
BF16_CASES = [p for p in CASES if p.id in ("ragged",)]


def _tokens(case: Case):
    """``(q_tokens, kv_tokens)`` of a case."""
    kv_positions = jnp.broadcast_to(jnp.arange(case.keys, dtype=jnp.int32),
                                    (case.batch, case.keys))
    start = case.keys - case.q_len if case.q_start is None else case.q_start
    q_positions = jnp.broadcast_to(jnp.arange(start, start + case.q_len, dtype=jnp.int32),
                                   (case.batch, case.q_len))
    if case.hole:
        kv_segments = ((kv_positions >= BLOCK) & (kv_positions < 2 * BLOCK)).astype(jnp.int32)
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


def _softcapped_reference(q, k, v, *, causal, window, scale, positions, segment_ids,
                          kv_positions, kv_segment_ids, softcap):
    """Dense soft-capped attention (``s -> c * tanh(s / c)`` before the mask), on the
    reference's mask predicate; for the softcap case only."""
    batch, q_len, heads, _ = q.shape
    group = heads // k.shape[2]
    mask = masks.visible_tokens(MaskSpec.make(causal, window),
                                Tokens(positions, segment_ids),
                                Tokens(kv_positions, kv_segment_ids))
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v)
    return out, jnp.swapaxes(lse, 1, 2)


@functools.cache
def _expected(case: Case, dtype):
    """Reference results on the case's inputs (bf16 inputs upcast)."""
    q_tokens, kv_tokens = _tokens(case)
    kwargs = dict(causal=case.causal, window=case.window, scale=case.d_qk**-0.5,
                  positions=q_tokens.positions, segment_ids=q_tokens.segment_ids,
                  kv_positions=kv_tokens.positions, kv_segment_ids=kv_tokens.segment_ids)

    def attend(q, k, v):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        if case.softcap is not None:
            return _softcapped_reference(q, k, v, softcap=case.softcap, **kwargs)
        return reference.attention(q, k, v, return_lse=True, **kwargs)

    return _value_and_grads(attend, *_inputs(case, dtype))


def _run_kernel(case: Case, dtype, poison: Optional[slice] = None):
    """Kernel results on the case's inputs, keys/values in ``poison`` set to NaN."""
    spec = MaskSpec.make(case.causal, case.window)
    q_tokens, kv_tokens = _tokens(case)
    (q, k, v), weights = _inputs(case, dtype)
    if poison is not None:
        k, v = k.at[:, poison].set(jnp.nan), v.at[:, poison].set(jnp.nan)

    def attend(q, k, v):
        return mosaic.attention(q, k, v, q_tokens, kv_tokens, spec=spec, scale=case.d_qk**-0.5,
                                block_sizes=BLOCKS, softcap=case.softcap)

    return _value_and_grads(attend, (q, k, v), weights)


def _check(case: Case, dtype, tolerances, poison=None):
    """Shapes and dtypes first, then values against the reference."""
    results = _run_kernel(case, dtype, poison)
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


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_fp32(case, tolerances):
    _check(case, jnp.float32, tolerances)


@pytest.mark.parametrize("case", BF16_CASES)
def test_matches_reference_bf16(case, tolerances):
    _check(case, jnp.bfloat16, tolerances)


def test_query_that_sees_no_key(tolerances):
    """Queries at positions -8..-1 (causal, keys at 0..) get zeros, EMPTY_LSE, finite grads."""
    case = Case(q_len=16, kv_len=160, causal=True, q_start=-8)
    out, lse, grads = _check(case, jnp.float32, tolerances)
    assert np.all(np.asarray(out[:, :8]) == 0)
    assert np.all(np.asarray(lse[:, :8]) == masks.EMPTY_LSE)
    assert np.all(np.asarray(grads[0][:, :8]) == 0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


SKIP_CASES = [
    # Key tiles 1 and 2 come after every query (causal): past the last visible tile.
    pytest.param(Case(q_len=128, kv_len=384, causal=True, q_start=0), slice(128, 384),
                 id="causal_tail"),
    # Key tile 1 is a document no query is in, between two visible tiles.
    pytest.param(Case(q_len=256, kv_len=384, hole=True), slice(128, 256), id="segment_hole"),
]


@pytest.mark.parametrize("case,poison", SKIP_CASES)
def test_empty_tiles_are_skipped(case, poison, tolerances):
    """NaN keys and values in EMPTY tiles leave every result exact, so those tiles are
    never computed (a masked computation would still give ``0 * NaN = NaN``)."""
    q_tokens, kv_tokens = _tokens(case)
    classes = np.asarray(masks.classify(MaskSpec.make(case.causal, case.window),
                                        masks.summarize(q_tokens, BLOCK),
                                        masks.summarize(kv_tokens, BLOCK)))
    assert (classes[:, poison.start // BLOCK:poison.stop // BLOCK] == masks.EMPTY).all()
    _, _, grads = _check(case, jnp.float32, tolerances, poison)
    assert np.all(np.asarray(grads[1][:, poison]) == 0)  # nothing flows into them either


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_accumulate_in_the_kernel(dtype):
    """The forward continues ``accumulate=(out, lse)`` of earlier keys in the kernel (in
    place: a buffer still used after the call keeps its value) and matches the XLA
    kernel merging after; the backward adds ``accumulate``'s dq in the dq kernel."""
    from jax_seqpar.kernels import xla

    case = Case(batch=2, heads=4, kv_heads=2, causal=True, segments=True)
    q_tokens, kv_tokens = _tokens(case)
    (q, k, v), (dout, _) = _inputs(case, dtype)
    kwargs = dict(spec=MaskSpec.make(case.causal), scale=case.d_qk**-0.5)
    part = lambda x, s: jax.tree.map(lambda a: a[:, s], x)  # noqa: E731
    first, rest = slice(0, BLOCK), slice(BLOCK, None)
    earlier = xla.forward(q, part(k, first), part(v, first), q_tokens, part(kv_tokens, first),
                          **kwargs)
    assert bool(jnp.any(earlier[1] == masks.EMPTY_LSE))

    @jax.jit
    def continued(acc):
        result = mosaic.forward(q, part(k, rest), part(v, rest), q_tokens,
                                part(kv_tokens, rest), accumulate=acc, block_sizes=BLOCKS,
                                **kwargs)
        return result, acc

    (out, lse), kept = continued(earlier)
    want = xla.forward(q, part(k, rest), part(v, rest), q_tokens, part(kv_tokens, rest),
                       accumulate=earlier, **kwargs)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, want[0], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse, want[1], atol=tol, rtol=tol)
    for got, given in zip(kept, earlier):
        np.testing.assert_array_equal(got, given)
    full = xla.forward(q, k, v, q_tokens, kv_tokens, **kwargs)
    np.testing.assert_allclose(out, full[0], atol=tol, rtol=tol)

    delta = jnp.sum(dout * full[0], axis=-1)
    args = (q, k, v, q_tokens, kv_tokens, full[1], delta, dout.astype(dtype))
    plain = mosaic.backward(*args, block_sizes=BLOCKS, **kwargs)
    totals = tuple(jax.random.normal(jax.random.key(i), g.shape) for i, g in enumerate(plain))
    summed = mosaic.backward(*args, accumulate=totals, block_sizes=BLOCKS, **kwargs)
    for got, grad, total in zip(summed, plain, totals):
        np.testing.assert_allclose(got, grad + total, atol=1e-5, rtol=1e-5)


def test_plan_fetches_no_new_tile_on_empty_steps():
    """An EMPTY step re-requests the previous block (no copy); a row's first EMPTY
    steps request its first visible tile, which the pipeline then keeps."""
    from jax_seqpar.kernels.tpu import _common as _mosaic_common

    e, p, f = masks.EMPTY, masks.PARTIAL, masks.FULL
    classes = jnp.array([[e, e, p, f, e, p], [e, e, e, e, e, e], [f, e, e, p, e, e]], jnp.int32)
    plan = np.asarray(_mosaic_common.plan(classes))
    np.testing.assert_array_equal(plan & 3, classes)
    np.testing.assert_array_equal(plan >> 2, [[2, 2, 2, 3, 3, 5], [0] * 6, [0, 0, 0, 3, 3, 3]])


@pytest.mark.parametrize("bad,message", [
    (dict(block_sizes=dict(block_q=100)), "multiple of 128"),
    (dict(dtype=jnp.float16), "cast them first"),
    (dict(softcap=-1.0), "positive float"),
])
def test_bad_input_raises(bad, message):
    q = k = v = jnp.zeros((1, 16, 2, 32), bad.get("dtype", jnp.float32))
    tokens = Tokens(jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ValueError, match=message):
        block_sizes = mosaic.BlockSizes(**bad.get("block_sizes", {}))
        mosaic.forward(q, k, v, tokens, tokens, spec=MaskSpec(), scale=1.0,
                       block_sizes=block_sizes, softcap=bad.get("softcap"))


def test_lowering_for_tpu_emits_mosaic_and_cpu_interprets():
    """The kernel follows the platform the program is lowered for, not the host."""
    case = Case(causal=True)
    q_tokens, kv_tokens = _tokens(case)
    (q, k, v), _ = _inputs(case, jnp.bfloat16)

    def f(q, k, v):
        return mosaic.forward(q, k, v, q_tokens, kv_tokens, spec=MaskSpec.make(True), scale=0.1)

    traced = jax.jit(f).trace(q, k, v)
    assert "tpu_custom_call" in traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" not in traced.lower(lowering_platforms=("cpu",)).as_text()


STRATEGY_MESHES = {"ring": ("sp",), "ulysses": ("sp",), "allgather": ("sp",),
                   "hybrid": ("dcn", "ici")}


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "hybrid", "allgather"])
def test_strategies_end_to_end(strategy, make_qkv, tolerances):
    """Every strategy with kernel="mosaic": causal GQA with packed documents,
    outputs and gradients through the global API."""
    batch, seq = 1, 256
    axes = STRATEGY_MESHES[strategy]
    devices = np.array(jax.devices()).reshape((2, 4) if len(axes) == 2 else (8,))
    mesh = jax.sharding.Mesh(devices, axes)
    q, k, v = make_qkv(batch=batch, seq=seq, heads=8, kv_heads=2, head_dim=32, seed=2)
    segment_ids = jnp.sort(jax.random.randint(jax.random.key(3), (batch, seq), 0, 3),
                           axis=1).astype(jnp.int32)
    mask = dict(causal=True, segment_ids=segment_ids)
    ours = functools.partial(sp.sequence_parallel_attention, mesh=mesh,
                             seq_axes=axes if len(axes) == 2 else axes[0], strategy=strategy,
                             kernel="mosaic", block_sizes=BLOCKS, **mask)
    theirs = functools.partial(reference.attention, **mask)
    weights = jax.random.normal(jax.random.key(7), q.shape)

    def value_and_grads(attend, q, k, v):
        def loss(q, k, v):
            out = attend(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * weights), out

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    grads, out = jax.jit(functools.partial(value_and_grads, ours))(q, k, v)
    expected_grads, expected = value_and_grads(theirs, q, k, v)
    assert out.shape == expected.shape and out.dtype == q.dtype
    np.testing.assert_allclose(out, expected, **tolerances(q.dtype))
    for name, got, want in zip("qkv", grads, expected_grads):
        assert got.shape == want.shape and got.dtype == q.dtype, name
        np.testing.assert_allclose(got, want, **tolerances(q.dtype, "grad"), err_msg=f"d{name}")
