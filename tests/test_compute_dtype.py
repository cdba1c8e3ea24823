"""``compute_dtype=``: FP8 (scaled per block, q and k rotated) and bfloat16 products in every
strategy and entry point, measured against a float64 oracle on FlashAttention-3's benchmark
distribution; the scaling's own numbers; what is refused.

The issue's shape (S=1024, H=8: its bound, the P=8 / P=1 ratio) is the matrix tier; the
default tier runs the same checks at S=256."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_seqpar
from jax_seqpar.api import inference
from jax_seqpar.core import quant
from jax_seqpar.flax import SelfAttention
from test_compile_once import compiles_per_call

#: The issue's bound on the forward's RMSE against float64 (e4m3, bf16 inputs).
FP8_RMSE = 1.3e-2
#: The default tier's bound at S=256, H=8 (fewer keys per query: larger outputs, larger
#: errors; measured 1.33e-2 with every strategy).
FP8_RMSE_SHORT = 1.45e-2
#: Relative RMSE of the gradients against float64 (RMSE / the oracle's RMS), measured by
#: experiments/fp8_error.py at S=1024 with margin: FP8 backward, bf16 backward.
FP8_GRAD = {"fp8": 0.12, "bf16": 0.08}
STRATEGIES = ("local", "ring", "ulysses", "allgather", "hybrid")


def fa3_inputs(shape, seed=0):
    """q, k, v (bfloat16) and a float32 cotangent: N(0, 1) with 0.1 % of entries 10x."""
    rng = np.random.default_rng(seed)

    def draw():
        x = rng.standard_normal(shape)
        x[rng.random(shape) < 0.001] *= 10
        return x

    q, k, v, g = (draw() for _ in range(4))
    return (*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), jnp.asarray(g, jnp.float32))


def oracle(q, k, v, g):
    """float64 causal attention of ``q, k, v`` and the gradients of ``sum(out * g)``."""
    scale = q.shape[-1] ** -0.5
    seq = q.shape[1]
    with jax.enable_x64(True):
        def attention(q, k, v):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
            s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -jnp.inf)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        cotangent = jnp.asarray(np.asarray(g, np.float64))
        out = attention(*args)
        grads = jax.grad(lambda *a: jnp.sum(attention(*a) * cotangent), argnums=(0, 1, 2))(*args)
        return np.asarray(out), [np.asarray(x) for x in grads]


def call(strategy, compute_dtype, mesh):
    keywords = dict(causal=True, compute_dtype=compute_dtype)
    if strategy != "local":
        keywords.update(mesh=mesh, strategy=strategy)
        if strategy == "hybrid":
            keywords["ulysses_size"] = 4
    return functools.partial(jax_seqpar.sequence_parallel_attention, **keywords)


def errors(fn, q, k, v, g, want, want_grads):
    """The output's RMSE, the gradients' relative RMSEs, and the dtypes returned."""
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * g)

    out, grads = jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))(q, k, v)
    rmse = float(np.sqrt(np.mean((np.asarray(out, np.float64) - want) ** 2)))
    relative = [float(np.sqrt(np.mean((np.asarray(x, np.float64) - w) ** 2) / np.mean(w ** 2)))
                for x, w in zip(grads, want_grads)]
    return rmse, relative, [x.dtype for x in (out, *grads)]


@pytest.fixture(scope="module")
def problem():
    q, k, v, g = fa3_inputs((1, 256, 8, 64))
    return (q, k, v, g), oracle(q, k, v, g)


@pytest.fixture
def mesh():
    mesh = jax.make_mesh((8,), ("sp",))
    with jax.set_mesh(mesh):
        yield mesh


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp8_forward_and_gradients_within_the_bounds_against_float64(strategy, problem, mesh):
    (q, k, v, g), (want, want_grads) = problem
    bf16, _, _ = errors(call(strategy, None, mesh), q, k, v, g, want, want_grads)
    fp8, grads, dtypes = errors(call(strategy, jnp.float8_e4m3fn, mesh), q, k, v, g, want,
                                want_grads)
    assert fp8 <= FP8_RMSE_SHORT, (strategy, fp8)
    assert fp8 > 5 * bf16, f"FP8 error {fp8} is bf16's {bf16}: compute_dtype was not applied"
    assert max(grads) <= FP8_GRAD["fp8"], (strategy, grads)
    assert dtypes == [jnp.bfloat16] * 4
    bf16_backward = jax_seqpar.Compute(jnp.float8_e4m3fn, backward_dtype=jnp.bfloat16)
    rmse, grads_bf16, _ = errors(call(strategy, bf16_backward, mesh), q, k, v, g, want,
                                 want_grads)
    assert rmse == pytest.approx(fp8, rel=1e-6)  # the same forward
    assert max(grads_bf16) <= FP8_GRAD["bf16"], (strategy, grads_bf16)
    assert max(grads_bf16) < max(grads)


@pytest.fixture(scope="module")
def issue_shape():
    """The issue's problem (S=1024) and the one-device FP8 forward's RMSE, computed once."""
    q, k, v, g = fa3_inputs((1, 1024, 8, 64))
    want, _ = oracle(q, k, v, g)
    return (q, k, v), want, forward_rmse(call("local", jnp.float8_e4m3fn, None), q, k, v, want)


def forward_rmse(fn, q, k, v, want):
    out = jax.jit(fn)(q, k, v)
    return float(np.sqrt(np.mean((np.asarray(out, np.float64) - want) ** 2)))


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_fp8_error_is_flat_in_the_device_count_at_the_issues_shape(strategy, issue_shape, mesh):
    """The forward at the issue's shape: within its bound, P=8 within 1.05x of P=1 (the
    gradients' error at this shape: experiments/fp8_error.py; their bounds: the test
    above, at S=256)."""
    (q, k, v), want, one = issue_shape
    eight = forward_rmse(call(strategy, jnp.float8_e4m3fn, mesh), q, k, v, want)
    assert max(one, eight) <= FP8_RMSE, (one, eight)
    assert eight <= 1.05 * one, (one, eight)


def test_the_hadamard_rotation_lowers_the_error(problem, mesh):
    (q, k, v, g), (want, want_grads) = problem
    rotated, _, _ = errors(call("ring", jnp.float8_e4m3fn, mesh), q, k, v, g, want, want_grads)
    plain = jax_seqpar.Compute(jnp.float8_e4m3fn, hadamard=False)
    unrotated, _, _ = errors(call("ring", plain, mesh), q, k, v, g, want, want_grads)
    assert rotated < unrotated, (rotated, unrotated)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_bfloat16_compute_keeps_the_inputs_dtype_at_bfloat16s_error(dtype, mesh):
    q, k, v, _ = (x.astype(dtype) for x in fa3_inputs((1, 64, 4, 16)))
    ours = call("ring", jnp.bfloat16, mesh)(q, k, v)
    full = call("ring", None, mesh)(q, k, v)
    assert ours.dtype == dtype
    error = np.abs(np.asarray(ours, np.float32) - np.asarray(full, np.float32)).max()
    assert 1e-4 < error < 2e-2, error  # bf16 operands (P too), float32 sums


def test_per_shard_ring_takes_compute_dtype(mesh):
    q, k, v, _ = fa3_inputs((1, 128, 4, 64))
    spec = P(None, "sp")
    per_shard = jax.shard_map(functools.partial(
        jax_seqpar.ring_attention, seq_axes="sp", causal=True, compute_dtype=jnp.float8_e4m3fn),
        mesh=mesh, in_specs=spec, out_specs=spec)
    sharded = [jax.reshard(x, spec) for x in (q, k, v)]
    ours = jax.jit(per_shard)(*sharded)
    exact = call("ring", None, mesh)(q, k, v)
    rmse = np.sqrt(np.mean((np.asarray(ours, np.float32) - np.asarray(exact, np.float32)) ** 2))
    assert 1e-3 < rmse < 2e-2, rmse  # against the exact call's bf16 output (rounded too)


def test_a_hidden_non_finite_value_changes_nothing_in_fp8(mesh):
    q, k, v, _ = fa3_inputs((1, 64, 2, 16))
    fn = call("ring", jnp.float8_e4m3fn, mesh)
    clean = np.asarray(fn(q, k, v), np.float32)
    poisoned = np.asarray(fn(q, k, v.at[0, -1, 0, 0].set(jnp.inf)), np.float32)
    np.testing.assert_array_equal(poisoned[:, :-1], clean[:, :-1])  # causal: unseen
    assert np.isnan(poisoned[:, -1, 0]).any()


def test_compiles_once(mesh):
    q, k, v, _ = fa3_inputs((1, 64, 4, 16))
    fn = call("ring", jnp.float8_e4m3fn, mesh)
    counts = compiles_per_call(lambda: fn(q, k, v))
    assert counts[1:] == [0, 0], counts


def test_flax_layer_and_decode_take_compute_dtype(mesh):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 32, 32)), jnp.float32)

    def layer(compute_dtype):
        return SelfAttention(32, 4, head_dim=16, causal=True, mesh=mesh, strategy="ring",
                             compute_dtype=compute_dtype, rngs=nnx.Rngs(0))

    exact, fp8 = layer(None)(x), layer(jnp.float8_e4m3fn)(x)
    error = np.abs(np.asarray(fp8) - np.asarray(exact)).max()
    assert 1e-4 < error < 0.1 * np.abs(np.asarray(exact)).max(), error

    q, k, v, _ = (x.astype(jnp.float32) for x in fa3_inputs((2, 24, 4, 16)))
    results = []
    for compute_dtype in (None, jnp.float8_e4m3fn):
        cache = inference.KVCache.create(mesh, batch=2, capacity=32, num_kv_heads=4,
                                         head_dim=16, dtype=jnp.float32)
        _, cache = inference.prefill(q[:, :16], k[:, :16], v[:, :16], cache, causal=True,
                                     compute_dtype=compute_dtype)
        out, _ = inference.decode(q[:, 16:], k[:, 16:], v[:, 16:], cache,
                                  compute_dtype=compute_dtype)
        results.append(np.asarray(out))
    error = np.abs(results[1] - results[0]).max()
    assert 1e-4 < error < 0.25, error


def test_quantize_scales_each_token_and_head_to_the_formats_range():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 10, 3, 8)), jnp.float32)
    x = x.at[0, 0, 0, 0].set(jnp.nan).at[1, 9, 2].set(0.0)
    values, scales = quant.quantize(x, "float8_e4m3fn")
    assert values.dtype == jnp.float8_e4m3fn and scales.shape == (2, 10, 3)
    back = np.asarray(values, np.float32) * np.asarray(scales)[..., None]
    finite = np.isfinite(np.asarray(x))
    np.testing.assert_allclose(back[finite], np.asarray(x)[finite], rtol=0.07, atol=1e-6)
    assert np.isnan(back[0, 0, 0, 0]) and np.isfinite(back[0, 0, 0, 1:]).all()  # kept to itself
    amax = np.nanmax(np.abs(np.asarray(values, np.float32)), axis=-1)
    amax[1, 9, 2] = 448.0  # the all-zero token: scale 1, values 0
    np.testing.assert_array_equal(amax, 448.0)
    assert float(scales[1, 9, 2]) == 1.0
    same, none = quant.quantize(x, "bfloat16")
    assert same.dtype == jnp.bfloat16 and none is None


def test_rotation_is_orthogonal_and_keeps_the_scores():
    for head_dim in (64, 576, 6):
        r = quant.rotation(head_dim)
        np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    q, k = np.random.default_rng(2).standard_normal((2, 5, 64)).astype(np.float32)
    r = quant.rotation(64)
    np.testing.assert_allclose((q @ r) @ (k @ r).T, q @ k.T, atol=1e-4)


def test_compute_record_defaults_and_refusals():
    assert jax_seqpar.Compute(jnp.float8_e4m3fn).hadamard is True
    assert jax_seqpar.Compute("bfloat16").hadamard is False
    assert quant.compute(None, jnp.bfloat16) is None
    assert quant.compute(jnp.bfloat16, jnp.bfloat16) is None  # the inputs' own: as today
    with pytest.raises(ValueError, match="hadamard=True.*dtype=bfloat16"):
        jax_seqpar.Compute(jnp.bfloat16, hadamard=True)
    with pytest.raises(ValueError, match="compute_dtype=.*int8.*float8_e4m3fn"):
        quant.compute(jnp.int8, jnp.float32)


@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_a_backward_the_pallas_kernels_lack_is_refused_naming_the_alternatives(kernel, mesh):
    """The Pallas kernels compute an FP8 forward with an FP8 (same format) or bf16
    backward (``test_fp8_kernels.py``); another backward only the XLA kernel computes."""
    q, k, v, _ = fa3_inputs((1, 64, 4, 16))
    other = jax_seqpar.Compute(jnp.float8_e4m3fn, backward_dtype=jnp.float8_e5m2)
    with pytest.raises(ValueError, match=f"kernel='{kernel}'.*kernel='xla'"):
        jax_seqpar.sequence_parallel_attention(q, k, v, mesh=mesh, causal=True, kernel=kernel,
                                               compute_dtype=other)


def test_dot_product_attention_takes_it_and_jax_nn_does_not():
    q, k, v, _ = fa3_inputs((1, 32, 4, 16))
    out = jax_seqpar.dot_product_attention(q, k, v, is_causal=True,
                                           compute_dtype=jnp.float8_e4m3fn)
    exact = jax_seqpar.dot_product_attention(q, k, v, is_causal=True)
    error = np.abs(np.asarray(out, np.float32) - np.asarray(exact, np.float32)).max()
    assert out.dtype == jnp.bfloat16 and 1e-3 < error < 0.5
    with pytest.raises(ValueError, match="compute_dtype="):
        jax_seqpar.dot_product_attention(q, k, v, implementation="xla",
                                         compute_dtype=jnp.float8_e4m3fn)


@pytest.mark.parametrize("call", ["global", "dot_product", "prefill"])
def test_fp8_inputs_without_scales_are_refused_naming_compute_dtype(call, mesh):
    """FP8 q, k, v carry no scales: refused at every entry point, naming the fix, never
    rounded unscaled."""
    q = jnp.ones((1, 16, 2, 8), jnp.float8_e4m3fn)
    calls = {
        "global": lambda: jax_seqpar.sequence_parallel_attention(q, q, q, mesh=mesh, causal=True),
        "dot_product": lambda: jax_seqpar.dot_product_attention(q, q, q, is_causal=True),
        "prefill": lambda: jax_seqpar.prefill(
            q, q, q, jax_seqpar.KVCache.create(mesh, batch=1, capacity=32, num_kv_heads=2,
                                       head_dim=8, dtype=jnp.bfloat16)),
    }
    with pytest.raises(ValueError, match="float8_e4m3fn, an FP8 dtype with no scales.*"
                                         "compute_dtype=jnp.float8_e4m3fn"):
        calls[call]()


def _gemm_operand_dtypes(text):
    """The operand dtypes of every GEMM fusion of an XLA:GPU program's text."""
    return [tuple(re.findall(r": (\w+)\[", params)) for params in re.findall(
        r"^%\S*gemm_fusion\S* \(([^)]*)\) ->", text, re.M)]


@pytest.mark.compile_gate
@pytest.mark.parametrize("backward", ["float8_e4m3fn", "bfloat16"])
def test_fp8_products_compile_to_fp8_gemms_on_h100(backward):
    """On 8 H100s (compile only) the XLA kernel's products (``kernel="xla"``) take their
    operands in the compute dtype: FP8 x FP8 GEMM fusions (float32 accumulation) in the
    forward and, with an FP8 backward, in the backward; bf16 x bf16 ones with a bf16
    backward. ``kernel="auto"`` runs the Triton FP8 kernels instead: no GEMM fusion of
    FP8 operands is left, and the FP8 forward and backward kernels are there."""
    from jax.sharding import NamedSharding
    from jax_seqpar.tools import targets

    try:
        targets.require_plugin("cuda")
    except ImportError as error:
        pytest.skip(f"{error} (CI installs it)")
    mesh = targets.target_mesh("h100:8", ("sp",))
    q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "sp")))
    compute = jax_seqpar.Compute(jnp.float8_e4m3fn, backward_dtype=backward)

    def compiled(kernel):
        def step(q, k, v):
            out, pull = jax.vjp(lambda q, k, v: jax_seqpar.sequence_parallel_attention(
                q, k, v, mesh=mesh, seq_axes="sp", strategy="ring", causal=True,
                compute_dtype=compute, kernel=kernel), q, k, v)
            return pull(jnp.ones_like(out))

        return jax.jit(step).trace(q, q, q).lower(lowering_platforms=("cuda",)).compile(
            compiler_options=targets.compile_options("cuda", "ring")).as_text()

    gemms = _gemm_operand_dtypes(compiled("xla"))
    fp8 = sum(d[:2] == ("f8e4m3fn", "f8e4m3fn") for d in gemms)
    bf16 = sum(d[:2] == ("bf16", "bf16") for d in gemms)
    assert fp8 >= (6 if backward == "float8_e4m3fn" else 2), gemms  # QK, PV; dV, dP, dK, dQ
    assert (bf16 >= 4) == (backward == "bfloat16"), gemms
    auto = compiled("auto")
    assert not any("f8e4m3fn" in d[0] for d in _gemm_operand_dtypes(auto))
    triton = re.findall(
        r'__gpu\$xla\.gpu\.triton", operand_layout_constraints=(.*?), api_version', auto)
    assert sum("f8e4m3fn[" in operands for operands in triton) >= 3, triton  # fwd, dq, dkv
