"""``return_max_logit=True`` in the Pallas kernels (issue 42): the Triton kernel and the
Mosaic kernel, both in the Pallas interpreter (as every CPU test runs them), return each
query row's largest visible logit ``scale * q.k`` before the soft-cap, as
:func:`jax_seqpar.core.reference.max_logit` of that row alone gives it.

Every input puts the largest raw logit of each row's head 0 on a pair the mask hides
(:func:`_hidden_peak`), so a mask that were not applied, or a maximum taken after the
soft-cap or from the softmax's running max (capped, log2 units), would fail. The whole
strategies with ``kernel="xla"`` are ``test_max_logit.py``; the real compilers take the
kernels with the extra output in the compile gate (``test_compile_gate.py``,
``test_mosaic_compile.py``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checks
import jax_seqpar
import kernel_cases as kc
from jax_seqpar import kernels
from jax_seqpar.core import quant, reference
from jax_seqpar.kernels import make_options

#: Rows' max logits against the reference's: float32 products summed in another order
#: (Triton's float32 dots are TF32x3, 3e-7 relative); logits are O(1..10).
TOL = dict(rtol=1e-5, atol=1e-5)
FP8 = jax_seqpar.Compute(jnp.float8_e4m3fn, hadamard=False)  # as a kernel takes it

#: Mask families on 16-token tiles (the Mosaic kernel runs them at 128: x8, 256 tokens).
CASES = {
    "causal": kc.Case(batch=1, heads=4, kv_heads=2, causal=True),
    "window": kc.Case(batch=1, heads=4, kv_heads=2, causal=True, window=(9, 0)),
    "documents": kc.Case(batch=2, heads=2, kv_heads=1, segments=True),
    "softcap": kc.Case(batch=1, heads=4, kv_heads=2, causal=True, softcap=1.0),
}


def _hidden_peak(case: kc.Case, q, k):
    """``k`` with key ``S-1`` of head 0 far along query 0's direction: a pair every mask
    here hides (the key is after the query, or in another document)."""
    peak = 8.0 * q[:, 0, 0].astype(jnp.float32)
    return k.at[:, case.keys - 1, 0].set(peak.astype(k.dtype))


def _problem(kernel: str, name: str, dtype):
    case = kc.for_kernel(CASES[name], kernel)
    (q, k, v), _ = kc.inputs(case, dtype)
    return case, (q, _hidden_peak(case, q, k), v), kc.tokens(case)


def _options(kernel: str, case: kc.Case, compute=None, **keywords):
    q = jax.ShapeDtypeStruct((case.batch, case.q_len, case.heads, case.d_qk), jnp.float32)
    return make_options(q, case.spec, scale=case.d_qk**-0.5, kernel=kernel,
                        block_sizes=kc.block_sizes(kernel, case.tile), softcap=case.softcap,
                        compute_dtype=compute, **keywords)


def row_maxima(case: kc.Case, q, k, v, tokens):
    """The reference's max logit of every query row alone: ``float32[B, Sq, H]``
    (:func:`jax_seqpar.core.reference.max_logit` of one row, one batch row, at a time)."""
    q_tokens, kv_tokens = tokens
    fields = ("positions", "segment_ids", "bidirectional_ids")

    def one(q_row, q_fields, k, v, kv_fields):  # [H, D], {name: []}, [Sk, Hkv, D], ..
        return reference.max_logit(
            q_row[None, None].astype(jnp.float32), k[None].astype(jnp.float32),
            v[None].astype(jnp.float32), causal=case.causal, window=case.window,
            chunk_size=case.chunk_size, scale=case.d_qk**-0.5, softcap=case.softcap,
            **{name: x[None, None] for name, x in q_fields.items()},
            **{"kv_" + name: x[None] for name, x in kv_fields.items()})

    def present(t):
        return {name: getattr(t, name) for name in fields if getattr(t, name) is not None}

    per_query = jax.vmap(one, in_axes=(0, 0, None, None, None))
    return jax.jit(jax.vmap(per_query))(q, present(q_tokens), k, v, present(kv_tokens))


def _forward(kernel, options, q, k, v, tokens, accumulate=None):
    return jax.jit(lambda *a: kernels.forward(options, *a, *tokens, accumulate))(q, k, v)


def _assert_rows(got, want, **tolerance):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, **(tolerance or TOL))


PARAMS = [pytest.param(kernel, name, dtype, id=f"{kernel}-{name}-{jnp.dtype(dtype).name}")
          for kernel in ("pallas", "mosaic") for name in CASES
          for dtype in (jnp.float32, jnp.bfloat16)
          if dtype == jnp.float32 or name in ("causal", "documents")]


@pytest.mark.parametrize("kernel,name,dtype", PARAMS)
def test_kernel_returns_each_rows_max_logit(kernel, name, dtype):
    """The forward's third result is each row's reference max logit (and their maximum
    the reference's per head); out and lse are those of the call without the flag."""
    case, (q, k, v), tokens = _problem(kernel, name, dtype)
    options = _options(kernel, case, return_max_logit=True)
    assert options.kernel == kernel  # kept, not rerouted to the XLA kernel
    out, lse, high = _forward(kernel, options, q, k, v, tokens)
    want = row_maxima(case, q, k, v, tokens)
    _assert_rows(high, want)
    head_max = reference.max_logit(
        *(x.astype(jnp.float32) for x in (q, k, v)), causal=case.causal, window=case.window,
        softcap=case.softcap, positions=tokens[0].positions, segment_ids=tokens[0].segment_ids,
        kv_positions=tokens[1].positions, kv_segment_ids=tokens[1].segment_ids)
    np.testing.assert_allclose(np.asarray(high).max(axis=(0, 1)), head_max, **TOL)
    plain = _forward(kernel, _options(kernel, case), q, k, v, tokens)
    for got, without in zip((out, lse), plain):  # to an ulp: the compiler fuses otherwise
        np.testing.assert_allclose(got, without, rtol=1e-6, atol=1e-6)
    peak = float(jnp.einsum("bd,bd->b", q[:, 0, 0], k[:, -1, 0]).astype(jnp.float32).max())
    assert float(jnp.max(high[..., 0])) < 0.5 * peak * case.d_qk**-0.5  # the mask hid it
    if case.softcap is not None:
        assert float(jnp.max(high)) > case.softcap  # before the cap


@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_fp8_rows_max_logit_is_of_the_quantized_operands(kernel):
    """In FP8 the kernel's logits are those of the quantized q and k, their per-token
    scales applied: the reference on those operands dequantized gives them (to float32
    rounding of the scales' products)."""
    case, (q, k, v), tokens = _problem(kernel, "documents", jnp.float32)
    options = _options(kernel, case, FP8, return_max_logit=True)
    assert options.kernel == kernel
    high = _forward(kernel, options, q, k, v, tokens)[2]

    def dequantized(x):
        values, scales = quant.quantize(x, "float8_e4m3fn")
        return values.astype(jnp.float32) * scales[..., None]

    _assert_rows(high, row_maxima(case, dequantized(q), dequantized(k), v, tokens))
    exact = row_maxima(case, q, k, v, tokens)
    assert not np.allclose(np.asarray(high), np.asarray(exact), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", [False, True], ids=["fold", "split-k"])
def test_triton_decode_paths(split, monkeypatch):
    """Decode-sized calls: a GQA group's queries folded into one program's rows
    (unfolded after), and split-K over the cache (the runs' maxima merged by
    ``maximum``) return each row's max logit."""
    from jax_seqpar.kernels.gpu import _decode

    case = kc.Case(batch=1, q_len=2 - split, kv_len=45, heads=4, kv_heads=1, causal=True,
                   segments=split)
    if split:
        monkeypatch.setattr(_decode, "MIN_SPLIT_KEYS", 16)
        assert _decode.kv_splits(1, 1, 45, 16) == 2
    (q, k, v), _ = kc.inputs(case, jnp.float32)
    tokens = kc.tokens(case)
    high = _forward("pallas", _options("pallas", case, return_max_logit=True), q, k, v,
                    tokens)[2]
    _assert_rows(high, row_maxima(case, q, k, v, tokens))


@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_accumulate_merges_the_max_logits(kernel):
    """The forward over a second run of keys continued from the first's triple (Mosaic
    in the kernel, in place; Triton merging after) is the call over both; a running
    result without the max logit is refused (Mosaic: ValueError naming the fix)."""
    case, (q, k, v), tokens = _problem(kernel, "documents", jnp.float32)
    options = _options(kernel, case, return_max_logit=True)
    half = case.keys // 2
    runs = [jax.tree.map(lambda x, s=s: x[:, s], (k, v, tokens[1]))
            for s in (slice(0, half), slice(half, None))]
    first = _forward(kernel, options, q, *runs[0][:2], (tokens[0], runs[0][2]))
    got = _forward(kernel, options, q, *runs[1][:2], (tokens[0], runs[1][2]),
                   accumulate=first)
    whole = _forward(kernel, options, q, k, v, tokens)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(whole[2]))
    np.testing.assert_allclose(got[0], whole[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="accumulate"):
        _forward(kernel, options, q, *runs[1][:2], (tokens[0], runs[1][2]),
                 accumulate=first[:2])


@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_gradients_unchanged_with_the_flag(kernel, tolerances):
    """``attention`` with the flag differentiates exactly as without it (the max logit's
    cotangent ignored), and as the reference."""
    case, (q, k, v), tokens = _problem(kernel, "causal", jnp.float32)
    (_, weights) = kc.inputs(case, jnp.float32)

    def loss(options, q, k, v):
        out, lse, *high = kernels.attention(options, q, k, v, *tokens)
        return (jnp.sum(out * weights[0]) + jnp.sum(lse * weights[1])
                + sum(jnp.sum(x) for x in high))

    grads = [jax.jit(jax.grad(functools.partial(loss, _options(kernel, case, **flag)),
                              argnums=(0, 1, 2)))(q, k, v)
             for flag in ({"return_max_logit": True}, {})]
    for with_flag, without in zip(*grads):
        np.testing.assert_allclose(with_flag, without, rtol=1e-6, atol=1e-6)
    _, pull = jax.vjp(lambda q, k, v: reference.attention(
        q, k, v, causal=True, scale=case.d_qk**-0.5, return_lse=True), q, k, v)
    for got, want in zip(grads[0], pull(weights)):
        np.testing.assert_allclose(got, want, **tolerances(jnp.float32, "grad"))


@pytest.mark.parametrize("form", ["ring", "allgather-pieces", "ulysses-pieces",
                                  "hybrid-groups"])
@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_strategies_with_the_pallas_kernels(kernel, form):
    """The strategies on the 8 emulated devices with the kernel: the ring's steps merge
    their max logits (``accumulate`` triples: Triton after the kernel, Mosaic in it),
    the pipelines' pieces theirs; the reference's per head."""
    from test_max_logit import FORMS

    B, S, H, HKV, D = 1, 64, 8, 4, 16  # Ulysses: heads over 8 devices
    q, k, v = checks.normals([(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D)])
    k = k.at[:, S - 1, 0].set(8.0 * q[:, 0, 0])  # hidden by causality
    strategy, pipelining = FORMS[form]
    mesh, seq_axes = checks.strategy_mesh(strategy)
    out, high = jax_seqpar.sequence_parallel_attention(
        q, k, v, mesh=mesh, seq_axes=seq_axes, strategy=strategy, kernel=kernel, causal=True,
        return_max_logit=True, **pipelining)
    np.testing.assert_allclose(high, reference.max_logit(q, k, v, causal=True), **TOL)
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True), rtol=2e-5,
                               atol=2e-5)


def test_every_kernel_keeps_its_name():
    q = jnp.ones((1, 32, 2, 16), jnp.bfloat16)
    spec = kc.Case(causal=True).spec
    for kernel in ("auto", "xla", "pallas", "mosaic"):
        assert make_options(q, spec, kernel=kernel, return_max_logit=True).kernel == kernel
