"""Flax integration: the attention_fn adapter inside Flax's own layers, and SelfAttention."""

import contextlib
import functools

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import checks
import jax_seqpar
from jax_seqpar.core import reference
from jax_seqpar.flax import SelfAttention, apply_rope, make_attention_fn
from test_compile_once import counting_compiles

BATCH, SEQ, HEADS, FEATURES = 2, 64, 8, 32


def _sp_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("sp",))


def _hybrid_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("dcn", "ici"))


def _x(seed=0, features=FEATURES):
    return checks.normal((BATCH, SEQ, features), seed=seed)


def _segments():
    """Three packed documents per row, with boundaries that differ between rows."""
    cuts = np.array([[10, 40], [27, 33]])
    ids = (np.arange(SEQ)[None, :, None] >= cuts[:, None, :]).sum(-1)
    return jnp.asarray(ids, jnp.int32)


def _loss(y):
    """A loss whose gradient reaches every output element with a different weight."""
    weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * weights)


def _assert_trees_close(actual, expected, **tol):
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves) > 0
    for a, e in zip(actual_leaves, expected_leaves):
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_allclose(a, e, **tol)


def _nnx_out_and_grads(layer, x, **call_kwargs):
    """``(layer(x), d loss / d params)``, compiled once."""

    graphdef, params = nnx.split(layer)

    @jax.jit
    def run(params, x, call_kwargs):
        apply = lambda params: nnx.merge(graphdef, params)(x, **call_kwargs)
        out, vjp = jax.vjp(apply, params)
        return out, vjp(jax.grad(_loss)(out))[0]

    return run(params, x, call_kwargs)


def _nnx_mha(attention_fn=None, **kwargs):
    extra = {} if attention_fn is None else {"attention_fn": attention_fn}
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, qkv_features=64,
                                  decode=False, rngs=nnx.Rngs(0), **extra, **kwargs)


ADAPTER_CASES = [
    pytest.param(None, "auto", id="unsharded"),  # strategy= needs a mesh
    pytest.param("sp", "ulysses", id="ulysses"),
    pytest.param("sp", "ring", id="ring"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mesh_axis,strategy", ADAPTER_CASES)
def test_nnx_multi_head_attention(mesh_axis, strategy, causal, tolerances):
    mesh = None if mesh_axis is None else _sp_mesh()
    ours = _nnx_mha(make_attention_fn(mesh, strategy=strategy, causal=causal))
    theirs = _nnx_mha()
    x = _x()
    mask = nnx.make_causal_mask(x[..., 0]) if causal else None
    out, grads = _nnx_out_and_grads(ours, x)
    expected_out, expected_grads = _nnx_out_and_grads(theirs, x, mask=mask)
    assert out.shape == expected_out.shape == x.shape
    np.testing.assert_allclose(out, expected_out, **tolerances(x.dtype))
    _assert_trees_close(grads, expected_grads, **tolerances(x.dtype, "grad"))


def test_nnx_is_causal_turns_causal_on(tolerances):
    ours = _nnx_mha(make_attention_fn(_sp_mesh(), strategy="ring", causal=False))
    x = _x()
    expected = _nnx_mha()(x, mask=nnx.make_causal_mask(x[..., 0]))
    out = nnx.jit(lambda layer, x: layer(x, is_causal=True))(ours, x)
    np.testing.assert_allclose(out, expected, **tolerances(x.dtype))


def test_nnx_explicit_mesh(tolerances):
    mesh = jax.make_mesh((8,), ("sp",))
    x = _x()
    expected = _nnx_mha()(x, mask=nnx.make_causal_mask(x[..., 0]))
    with jax.set_mesh(mesh):
        ours = _nnx_mha(make_attention_fn(mesh, strategy="ring", causal=True))
        out = nnx.jit(lambda layer, x: layer(x))(ours, x)
    np.testing.assert_allclose(out, expected, **tolerances(x.dtype))


@pytest.mark.parametrize("strategy,causal", [
    pytest.param("ulysses", False, id="ulysses-full"),
    pytest.param("ring", True, id="ring-causal"),
])
def test_linen_multi_head_dot_product_attention(strategy, causal, tolerances):
    fn = make_attention_fn(_sp_mesh(), strategy=strategy, causal=causal)
    ours = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=64, attention_fn=fn)
    theirs = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=64)
    x = _x()
    params = theirs.init(jax.random.key(1), x)
    mask = linen.make_causal_mask(x[..., 0]) if causal else None

    def out_and_grads(layer, mask):
        @jax.jit
        def run(params, x, mask):
            out, vjp = jax.vjp(lambda params: layer.apply(params, x, mask=mask), params)
            return out, vjp(jax.grad(_loss)(out))[0]

        return run(params, x, mask)

    out, grads = out_and_grads(ours, None)
    expected_out, expected_grads = out_and_grads(theirs, mask)
    np.testing.assert_allclose(out, expected_out, **tolerances(x.dtype))
    _assert_trees_close(grads, expected_grads, **tolerances(x.dtype, "grad"))


def test_adapter_batch_dims_and_segment_ids(make_qkv, tolerances):
    """Any number of batch dims (none included); segment ids by direct call."""
    q, k, v = make_qkv(batch=6, seq=32, heads=4, kv_heads=2)
    segment_ids = jnp.asarray(np.arange(32)[None] // 10 + np.arange(6)[:, None], jnp.int32)
    expected = reference.attention(q, k, v, causal=True, segment_ids=segment_ids)
    fn = jax.jit(make_attention_fn(_sp_mesh(), strategy="ring", causal=True))
    out = fn(*(x.reshape(2, 3, *x.shape[1:]) for x in (q, k, v)),
             segment_ids=segment_ids.reshape(2, 3, 32))
    assert out.shape == (2, 3, 32, 4, 16)
    np.testing.assert_allclose(out.reshape(expected.shape), expected, **tolerances(q.dtype))
    unbatched = make_attention_fn(None, causal=True)(q[0], k[0], v[0])
    assert unbatched.shape == (32, 4, 16)
    np.testing.assert_allclose(unbatched, reference.attention(q, k, v, causal=True)[0],
                               **tolerances(q.dtype))


@pytest.mark.parametrize("call,match", [
    pytest.param(lambda fn, x: _nnx_mha(fn)(x, mask=nnx.make_causal_mask(x[..., 0])),
                 "mask", id="nnx-mask"),
    pytest.param(lambda fn, x: _nnx_mha(fn, dropout_rate=0.1)(x, deterministic=False),
                 "dropout_rate", id="nnx-dropout"),
    pytest.param(lambda fn, x: _nnx_mha(fn)(x, sow_weights=True), "module", id="nnx-sow"),
    pytest.param(lambda fn, x: linen.MultiHeadDotProductAttention(
        num_heads=HEADS, attention_fn=fn, dropout_rate=0.1, deterministic=False).init(
            {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x),
        "dropout_rate", id="linen-dropout"),
    pytest.param(lambda fn, x: linen.MultiHeadDotProductAttention(
        num_heads=HEADS, attention_fn=fn).init(jax.random.key(0), x,
                                               mask=jnp.ones((BATCH, 1, SEQ, SEQ), bool)),
        "mask", id="linen-mask"),
    pytest.param(lambda fn, x: fn(*(x.reshape(BATCH, SEQ, 4, 8),) * 3,
                                  bias=jnp.zeros((BATCH, 4, SEQ, SEQ))),
                 "bias", id="bias"),
])
def test_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call(make_attention_fn(None, causal=True), _x())


def test_dropout_is_accepted_when_deterministic(tolerances):
    x = _x()
    out = _nnx_mha(make_attention_fn(None), dropout_rate=0.1)(x, deterministic=True)
    np.testing.assert_allclose(out, _nnx_mha()(x), **tolerances(x.dtype))


def test_rope_depends_on_relative_position():
    q, k = checks.normal((2, 1, 1, 1, 16))
    score = lambda i, j: jnp.sum(apply_rope(q, jnp.array([i])) * apply_rope(k, jnp.array([j])))
    np.testing.assert_allclose(score(3, 1), score(10, 8), rtol=1e-5)
    assert not np.isclose(score(3, 1), score(3, 2))


def _self_attention(**kwargs):
    return SelfAttention(FEATURES, HEADS, num_kv_heads=2, head_dim=8, causal=True,
                         rngs=nnx.Rngs(0), **kwargs)


def test_self_attention_unsharded_matches_reference(tolerances):
    layer, x, segment_ids = _self_attention(), _x(), _segments()
    positions = jnp.arange(SEQ)
    q = apply_rope(layer.q_proj(x), positions)
    k = apply_rope(layer.k_proj(x), positions)
    expected = layer.o_proj(reference.attention(q, k, layer.v_proj(x), causal=True,
                                                segment_ids=segment_ids))
    out = layer(x, segment_ids=segment_ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_allclose(out, expected, **tolerances(x.dtype))


SELF_ATTENTION_CASES = [
    pytest.param("ulysses", "sp", id="ulysses"),
    pytest.param("ring", "sp", id="ring"),
    pytest.param("hybrid", ("dcn", "ici"), id="hybrid"),
    pytest.param("allgather", "sp", id="allgather"),
]


@pytest.mark.parametrize("strategy,seq_axes", checks.tiered(SELF_ATTENTION_CASES,
                                                             lambda i: i in (0, 2)))
def test_self_attention_sharded_matches_unsharded(strategy, seq_axes, tolerances):
    mesh = _hybrid_mesh() if strategy == "hybrid" else _sp_mesh()
    x, segment_ids = _x(), _segments()
    sharded = _self_attention(mesh=mesh, seq_axes=seq_axes, strategy=strategy)
    out, grads = _nnx_out_and_grads(sharded, x, segment_ids=segment_ids)
    expected_out, expected_grads = _nnx_out_and_grads(_self_attention(), x,
                                                      segment_ids=segment_ids)
    np.testing.assert_allclose(out, expected_out, **tolerances(x.dtype))
    _assert_trees_close(grads, expected_grads, **tolerances(x.dtype, "grad"))


def test_self_attention_window_sinks_softcap(tolerances):
    """Learnable sinks (their gradient too), a window and soft-capping; sharded, with the
    tokens laid out once (positions=), equals unsharded in natural order."""
    kwargs = dict(window=(5, 0), softcap=3.0, sinks=True)
    x, segment_ids = _x(), _segments()
    unsharded = _self_attention(**kwargs)
    unsharded.sinks[...] = jnp.linspace(-1.0, 2.0, HEADS)
    positions = jnp.arange(SEQ)
    q = apply_rope(unsharded.q_proj(x), positions)
    k = apply_rope(unsharded.k_proj(x), positions)
    expected = unsharded.o_proj(reference.attention(
        q, k, unsharded.v_proj(x), causal=True, segment_ids=segment_ids, window=(5, 0),
        softcap=3.0, sinks=unsharded.sinks[...]))
    np.testing.assert_allclose(unsharded(x, segment_ids=segment_ids), expected,
                               **tolerances(x.dtype))

    sharded = _self_attention(mesh=_sp_mesh(), strategy="ring", **kwargs)
    sharded.sinks[...] = unsharded.sinks[...]
    (x_laid, ids_laid), positions = jax_seqpar.permute_batch((x, segment_ids), "zigzag", 8)
    graphdef, params = nnx.split(sharded)

    def natural_out(params):
        out = nnx.merge(graphdef, params)(x_laid, segment_ids=ids_laid, positions=positions)
        return jax_seqpar.unpermute_batch(out, "zigzag", num_shards=8)

    out = jax.jit(natural_out)(params)
    grads = jax.jit(jax.grad(lambda params: _loss(natural_out(params))))(params)
    expected_out, expected_grads = _nnx_out_and_grads(unsharded, x, segment_ids=segment_ids)
    np.testing.assert_allclose(out, expected_out, **tolerances(x.dtype))
    assert float(jnp.abs(expected_grads["sinks"][...]).max()) > 0
    _assert_trees_close(grads, expected_grads, **tolerances(x.dtype, "grad"))


def test_self_attention_config_errors():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        SelfAttention(FEATURES, HEADS, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="even head_dim"):
        SelfAttention(FEATURES, HEADS, head_dim=5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_model=32"):
        _self_attention()(jnp.zeros((1, SEQ, 16)))


# --- today's models: no RoPE, QK-norm, a query scale; Flax's decode convention -------

MODEL_OPTIONS = dict(qk_norm=True, scale=0.3)


def _rms_norm(x, scale):
    """A hand-written RMSNorm over the last axis (epsilon 1e-6), learned ``scale``."""
    scale = scale.reshape((1,) * (x.ndim - 1) + scale.shape)  # [1, 1, 1, Dh]
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _rotate(x, positions, base):
    """Rotate-half RoPE written out: features ``i`` and ``i + D/2`` pair up."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * base ** (-jnp.arange(half) / half)[None]  # [S, D/2]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]  # [1, S, 1, D/2]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _layer_by_hand(params, x, *, rope_base, scale):
    """The causal layer in plain jnp from its parameters (``nnx.State``): projections,
    QK-norm, optional RoPE, softmax attention, the output projection."""
    w = lambda *path: functools.reduce(lambda node, key: node[key], path, params)[...]
    q = jnp.einsum("bsd,dhk->bshk", x, w("q_proj", "kernel"))  # [B, S, H, Dh]
    k = jnp.einsum("bsd,dhk->bshk", x, w("k_proj", "kernel"))  # [B, S, Hkv, Dh]
    v = jnp.einsum("bsd,dhk->bshk", x, w("v_proj", "kernel"))
    q, k = _rms_norm(q, w("q_norm", "scale")), _rms_norm(k, w("k_norm", "scale"))
    if rope_base is not None:
        positions = jnp.arange(x.shape[1], dtype=jnp.float32)
        q, k = _rotate(q, positions, rope_base), _rotate(k, positions, rope_base)
    out = reference.attention(q, k, v, causal=True, scale=scale)  # [B, S, H, Dh]
    return jnp.einsum("bshk,hkd->bsd", out, w("o_proj", "kernel"))


def _model_layer(mesh=None, **kwargs):
    """A ``SelfAttention`` with QK-norm and a query scale, its norms' scales not 1."""
    layer = _self_attention(mesh=mesh, **MODEL_OPTIONS, **kwargs)
    layer.q_norm.scale[...] = jnp.linspace(0.5, 1.5, 8)
    layer.k_norm.scale[...] = jnp.linspace(1.5, 0.5, 8)
    return layer


@pytest.mark.parametrize("strategy,rope_base", [
    pytest.param(None, None, id="unsharded-nope"),
    pytest.param("ring", None, id="ring-nope"),
    pytest.param("ulysses", 10000.0, id="ulysses-rope"),
])
def test_self_attention_qk_norm_scale_rope_match_layer_by_hand(strategy, rope_base,
                                                               tolerances):
    """``rope_base=None, qk_norm=True, scale=s`` (and QK-norm before RoPE) equals the
    layer written by hand, outputs and gradients, on an 8-device mesh and without."""
    x = _x()
    mesh = None if strategy is None else jax.make_mesh((8,), ("sp",))
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(jax.set_mesh(mesh))
        extra = {} if strategy is None else dict(strategy=strategy)
        layer = _model_layer(mesh, rope_base=rope_base, **extra)
        out, grads = _nnx_out_and_grads(layer, x)
        _, params = nnx.split(layer)
        by_hand = functools.partial(_layer_by_hand, x=x, rope_base=rope_base, scale=0.3)
        expected_out, vjp = jax.vjp(by_hand, params)
        expected_grads = vjp(jax.grad(_loss)(expected_out))[0]
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_allclose(out, expected_out, **tolerances(x.dtype))
    assert float(jnp.abs(expected_grads["q_norm"]["scale"][...]).max()) > 0
    _assert_trees_close(grads, expected_grads, **tolerances(x.dtype, "grad"))


def _decode_token_by_token(layer, x, prompt_len):
    """``layer(x, decode=True)`` under ``nnx.jit``: the prompt, then one token a call;
    the outputs joined ``[B, S, d_model]`` and the compilations of each call."""
    step = nnx.jit(lambda layer, x: layer(x, decode=True))
    outs, compiles = [], []
    with counting_compiles() as compiled:
        for start, stop in [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, SEQ)]:
            before = len(compiled)
            outs.append(jax.block_until_ready(step(layer, x[:, start:stop])))
            compiles.append(len(compiled) - before)
    return jnp.concatenate(outs, axis=1), compiles


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "ring"])
def test_decode_true_token_by_token_equals_the_full_forward(sharded, tolerances):
    """A default (float32) layer with the default cache: ``init_cache`` then ``layer(x,
    decode=True)``, a prompt and then one token a call, equals the causal forward; nothing
    compiles after the first appending step."""
    x = _x()
    mesh = jax.make_mesh((8,), ("sp",)) if sharded else None
    with contextlib.ExitStack() as stack:
        if sharded:
            stack.enter_context(jax.set_mesh(mesh))
        layer = _model_layer(mesh, rope_base=10000.0,
                             **(dict(strategy="ring") if sharded else {}))
        expected = layer(x)
        layer.init_cache(BATCH, SEQ)
        assert layer.cache.get_value().k.dtype == jnp.float32
        out, compiles = _decode_token_by_token(layer, x, prompt_len=SEQ - 6)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_allclose(out, expected, **tolerances(x.dtype))
    assert compiles[2:] == [0] * (len(compiles) - 2), compiles  # prefill, then one step
    np.testing.assert_array_equal(layer.cache.get_value().length, [SEQ, SEQ])


@pytest.mark.parametrize("dtype,cache_dtype", [
    pytest.param(jnp.bfloat16, None, id="bf16-layer"),
    pytest.param(jnp.float16, None, id="fp16-layer"),
    pytest.param(None, jnp.bfloat16, id="fp32-layer-bf16-cache"),
])
def test_decode_true_in_narrow_dtypes(dtype, cache_dtype, tolerances):
    """The cache follows the layer's dtype; a narrower cache asked for is attended in
    (q, k, v cast to it), the output in the layer's dtype."""
    x = _x().astype(dtype or jnp.float32)
    layer = _self_attention(**MODEL_OPTIONS, rope_base=None, dtype=dtype)
    expected = layer(x)
    layer.init_cache(BATCH, SEQ, dtype=cache_dtype)
    assert layer.cache.get_value().k.dtype == (cache_dtype or dtype)
    out, _ = _decode_token_by_token(layer, x, prompt_len=SEQ - 3)
    assert out.dtype == expected.dtype == x.dtype
    narrow = cache_dtype or dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               **tolerances(narrow))


def test_decode_true_errors():
    layer = _self_attention(**MODEL_OPTIONS)
    with pytest.raises(ValueError, match=r"no KV cache; call layer.init_cache"):
        layer(_x(), decode=True)
    layer.init_cache(BATCH, SEQ)
    with pytest.raises(ValueError, match="decode=True tracks the tokens' positions"):
        layer(_x(), decode=True, positions=jnp.arange(SEQ))
    with pytest.raises(ValueError, match="decode must be a bool"):
        layer(_x(), decode=1)
    layer(_x()[:, :SEQ - 1], decode=True)
    with pytest.raises(ValueError, match=r"capacity=64 .* length=63 and 2 new token"):
        layer(_x()[:, :2], decode=True)
    assert layer.prefilled
    layer.init_cache(BATCH, SEQ)  # a fresh cache: the next call prefills again
    assert not layer.prefilled
