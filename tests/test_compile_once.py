"""Every entry point compiles once: called again with inputs of the same shapes, dtypes and
shardings, it compiles nothing, eager or under ``jit``, in the README's context (an Explicit
mesh from ``jax.make_mesh`` inside ``jax.set_mesh``, unsharded inputs).

Compilations are counted with JAX's own monitoring event for a backend compile
(``jax._src.dispatch.BACKEND_COMPILE_EVENT``, recorded once per XLA compilation, eager op
or jitted program alike)."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import dispatch

import checks
import jax_seqpar
from jax_seqpar.api import inference

B, S, H, HKV, D, D_MODEL = 1, 16, 4, 2, 8, 32


@contextlib.contextmanager
def counting_compiles():
    """Yields a list whose length is the number of XLA compilations so far in the block."""
    compiled = []

    def listen(event, duration, **_):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiled.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def compiles_per_call(call, times: int = 3) -> list:
    """How many programs each of ``times`` calls of ``call()`` compiled."""
    counts = []
    with counting_compiles() as compiled:
        for _ in range(times):
            before = len(compiled)
            jax.block_until_ready(call())
            counts.append(len(compiled) - before)
    return counts


@pytest.fixture
def mesh():
    mesh = jax.make_mesh((8,), ("sp",))
    with jax.set_mesh(mesh):
        yield mesh


def _qkv(tokens=S):
    return checks.normals([(B, tokens, H, D), (B, tokens, HKV, D), (B, tokens, HKV, D)])


def _assert_compiles_once(call):
    counts = compiles_per_call(call)
    assert counts[1:] == [0, 0], f"compilations per call: {counts}"


def _global(mesh):
    return lambda q, k, v: jax_seqpar.sequence_parallel_attention(q, k, v, mesh=mesh,
                                                                  causal=True)


def _drop_in(mesh):
    return lambda q, k, v: jax_seqpar.dot_product_attention(q, k, v, is_causal=True,
                                                            mesh=mesh)


def _drop_in_local(mesh):
    del mesh
    return lambda q, k, v: jax_seqpar.dot_product_attention(q, k, v, is_causal=True)


def _attention_fn(mesh):
    from jax_seqpar.flax import make_attention_fn

    return make_attention_fn(mesh, causal=True)


@pytest.mark.parametrize("build", [_global, _drop_in, _drop_in_local, _attention_fn],
                         ids=["sequence_parallel_attention", "dot_product_attention",
                              "dot_product_attention-no-mesh", "make_attention_fn"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_attention_entry_points_compile_once(mesh, build, jitted):
    f = build(mesh)
    if jitted:
        f = jax.jit(f)
    q, k, v = _qkv()
    _assert_compiles_once(lambda: f(q, k, v))


def _cache(mesh, capacity=64, dtype=jnp.float32):
    return inference.KVCache.create(mesh, batch=B, capacity=capacity, num_kv_heads=HKV,
                                    head_dim=D, dtype=dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn], ids=["f32", "fp8-cache"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_prefill_and_decode_compile_once(mesh, jitted, dtype):
    prefill, decode = inference.prefill, inference.decode
    if jitted:
        prefill, decode = jax.jit(prefill), jax.jit(decode, donate_argnums=3)
    q, k, v = _qkv()
    _assert_compiles_once(lambda: prefill(q, k, v, _cache(mesh, dtype=dtype))[0])
    _, cache = prefill(q, k, v, _cache(mesh, dtype=dtype))
    state = [cache]
    q1, k1, v1 = (x[:, :1] for x in (q, k, v))

    def step():
        out, state[0] = decode(q1, k1, v1, state[0])
        return out

    _assert_compiles_once(step)


def _layer(mesh):
    from flax import nnx

    from jax_seqpar.flax import SelfAttention

    return SelfAttention(D_MODEL, H, num_kv_heads=HKV, mesh=mesh, causal=True,
                         rngs=nnx.Rngs(0))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "nnx-jit"])
def test_flax_layer_compiles_once_training_and_decoding(mesh, jitted):
    from flax import nnx

    layer = _layer(mesh)
    x = checks.normal((B, S, D_MODEL))
    call = (lambda f: nnx.jit(f)) if jitted else (lambda f: f)
    forward = call(lambda layer, x: layer(x))
    _assert_compiles_once(lambda: forward(layer, x))
    prefill = call(lambda layer, x: layer.prefill(x))

    def new_request():  # a fresh cache (init_cache: eager, compiled once), then prefill
        layer.init_cache(B, 64)
        return prefill(layer, x)

    _assert_compiles_once(new_request)
    decode = call(lambda layer, x: layer.decode(x))
    _assert_compiles_once(lambda: decode(layer, x[:, :1]))
    # Flax's convention: a prompt, then steps; the steps compile once.
    step = call(lambda layer, x: layer(x, decode=True))
    layer.init_cache(B, 64)
    step(layer, x)
    _assert_compiles_once(lambda: step(layer, x[:, :1]))


def test_flax_training_step_compiles_once(mesh):
    """An ``nnx.jit`` training step (the layer and its optimizer built under the mesh, as
    the Flax guide says), run again and again: its updated weights keep their types."""
    import optax
    from flax import nnx

    layer = _layer(mesh)
    optimizer = nnx.Optimizer(layer, optax.adam(1e-3), wrt=nnx.Param)
    x = checks.normal((B, S, D_MODEL))

    @nnx.jit
    def step(layer, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(layer)
        optimizer.update(layer, grads)
        return loss

    _assert_compiles_once(lambda: step(layer, optimizer, x))


def test_generate_compiles_its_loop_once(mesh):
    from flax import nnx

    from jax_seqpar.examples import ModelConfig, Parallelism, TransformerLM
    from jax_seqpar.examples._generate import generate

    config = ModelConfig(d_model=D_MODEL, num_layers=1, num_heads=H, num_kv_heads=HKV,
                         mlp_hidden=32)
    model = TransformerLM(config, Parallelism(mesh, "sp", "ring"), rngs=nnx.Rngs(0))
    prompts = np.arange(8, dtype=np.int32)[None]
    run = functools.partial(generate, model, prompts, np.array([8], np.int32), num_tokens=3)
    _assert_compiles_once(lambda: run().tokens)
    assert run().compile_seconds == 0.0
