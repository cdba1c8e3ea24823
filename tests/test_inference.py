"""jax_seqpar.api.inference against the reference: prefill into a sequence-sharded KV cache,
many decode steps (T=1 and T>1) over ragged rows, every placement, generation, traffic."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import checks
from jax_seqpar.tools import hlo
from jax_seqpar.api import inference
from jax_seqpar.core import reference
from jax_seqpar.strategies.decode import EMPTY_POSITION, decode_attention
from jax_seqpar import comm_bytes


def _mesh(kind):
    devices = np.array(jax.devices())
    if kind == "hybrid":
        return jax.make_mesh((2, 4), ("dcn", "ici")), ("dcn", "ici")
    if kind == "auto":
        return Mesh(devices, ("sp",)), "sp"  # AxisType.Auto
    return jax.make_mesh((8,), ("sp",)), "sp"  # AxisType.Explicit


def _stream(batch, tokens, heads, kv_heads, head_dim, v_head_dim, dtype, seed=0):
    """q, k, v of every position each row will ever hold: ``[B, tokens, ., .]``."""
    return tuple(checks.normals([(batch, tokens, heads, head_dim),
                                 (batch, tokens, kv_heads, head_dim),
                                 (batch, tokens, kv_heads, v_head_dim)], dtype, seed))


def _as_f32(*arrays):
    return [jnp.asarray(x, jnp.float32) for x in arrays]


def _expected_stream(q, k, v, **mask):
    """Reference output at every position of every row, ``float32[B, N, H, Dv]``.

    A decoded query at position ``p`` sees keys ``0 .. p`` (causal, within the
    window): exactly what causal attention over the whole stream gives at ``p``,
    so one reference call checks every step of every row.
    """
    return np.asarray(reference.attention(*_as_f32(q, k, v), causal=True, **mask))


# (mesh, strategy, heads, kv_heads, head_dim, v_head_dim, dtype, prompt lengths, extra)
CASES = [
    pytest.param("explicit", "ring", 4, 2, 16, 16, jnp.float32, [40, 5, 0], {},
                 id="ring-gqa-f32-empty-shards"),
    pytest.param("auto", "ulysses", 8, 1, 16, 16, jnp.bfloat16, [33, 1, 16], {},
                 id="ulysses-mqa-bf16-auto-mesh"),
    pytest.param("explicit", "allgather", 4, 1, 576, 512, jnp.bfloat16, [24, 7], {},
                 id="allgather-mla-bf16"),
    pytest.param("hybrid", "hybrid", 8, 2, 16, 16, jnp.float32, [40, 9], {},
                 id="hybrid-gqa-f32"),
    pytest.param("explicit", "auto", 4, 2, 16, 16, jnp.float32, [24, 13],
                 dict(window=(6, 0), capacity=40), id="auto-window"),
    pytest.param("auto", "ring", 4, 4, 16, 16, jnp.float32, [30, 3],
                 dict(causal=False), id="ring-mha-bidirectional-prompt"),
    pytest.param("explicit", "ulysses", 8, 2, 16, 16, jnp.float32, [21, 6],
                 dict(softcap=4.0, sinks=jnp.linspace(-1.0, 2.0, 8)),
                 id="ulysses-gqa-softcap-sinks"),
]


@pytest.mark.parametrize("mesh_kind, strategy, heads, kv_heads, head_dim, v_head_dim, dtype, "
                         "lengths, extra", checks.tiered(CASES, lambda i: i % 2 == 0))
def test_prefill_then_decode_matches_reference(mesh_kind, strategy, heads, kv_heads, head_dim,
                                               v_head_dim, dtype, lengths, extra, tolerances):
    mesh, seq_axes = _mesh(mesh_kind)
    window, causal = extra.get("window"), extra.get("causal", True)
    options = {name: extra[name] for name in ("softcap", "sinks") if name in extra}
    steps = (1, 3, 1, 1, 3, 1)  # 10 new tokens per row
    batch, prompt_len = len(lengths), max(max(lengths), 1)
    capacity = extra.get("capacity", 64)
    q, k, v = _stream(batch, prompt_len + sum(steps), heads, kv_heads, head_dim, v_head_dim,
                      dtype)
    cache = inference.KVCache.create(mesh, batch=batch, capacity=capacity,
                                     num_kv_heads=kv_heads, head_dim=head_dim,
                                     v_head_dim=v_head_dim, dtype=dtype, seq_axes=seq_axes)
    lengths = np.array(lengths, np.int32)
    prefill = jax.jit(functools.partial(inference.prefill, strategy=strategy, causal=causal,
                                        window=window, **options))
    out, cache = prefill(q[:, :prompt_len], k[:, :prompt_len], v[:, :prompt_len], cache,
                         seq_lengths=jnp.asarray(lengths))
    assert out.shape == (batch, prompt_len, heads, v_head_dim) and out.dtype == dtype
    np.testing.assert_array_equal(cache.length, lengths)
    stream = _expected_stream(q, k, v, window=window, **options)  # [B, N, H, Dv]
    for b, n in enumerate(lengths):
        expected = stream[b, :n]
        if not causal:  # the prompt attends to itself both ways
            expected = reference.attention(*_as_f32(q[b:b + 1, :n], k[b:b + 1, :n],
                                                    v[b:b + 1, :n]), window=window,
                                           **options)[0]
        np.testing.assert_allclose(np.asarray(out, np.float32)[b, :n], expected,
                                   **tolerances(dtype), err_msg=f"prefill row {b}")

    decode = jax.jit(functools.partial(inference.decode, window=window, **options))
    for step, new in enumerate(steps):
        positions = lengths[:, None] + np.arange(new)  # [B, T] each row's next positions
        take = lambda x: jnp.asarray(np.take_along_axis(
            np.asarray(x), positions[:, :, None, None], axis=1))
        out, cache = decode(take(q), take(k), take(v), cache)
        assert out.shape == (batch, new, heads, v_head_dim) and out.dtype == dtype
        expected = np.take_along_axis(stream, positions[:, :, None, None], axis=1)
        np.testing.assert_allclose(np.asarray(out, np.float32), expected, **tolerances(dtype),
                                   err_msg=f"decode step {step}")
        lengths = lengths + new
        np.testing.assert_array_equal(cache.length, lengths)
    # Round-robin: every row's tokens are spread evenly (+-1) over the 8 shards.
    held = np.asarray(cache.positions).reshape(batch, 8, -1)
    per_shard = (held != EMPTY_POSITION).sum(-1)
    assert (per_shard.max(-1) - per_shard.min(-1) <= 1).all(), per_shard


def _every_third_key_hidden(q, kv):
    return kv.positions % 3 != 1


@pytest.mark.parametrize("new_tokens, mask", [
    (2, {}), (2, dict(chunk_size=16)), (3, dict(mask_fn=_every_third_key_hidden))],
    ids=["causal", "chunked", "mask_fn"])
def test_decode_attention_is_exact_for_any_placement(new_tokens, mask, tolerances):
    """Slots shuffled across shards, empty slots marked -1 or EMPTY_POSITION; the
    per-shard decode takes chunks and a mask_fn on the slots' positions."""
    batch, capacity, heads, kv_heads, dim = 2, 64, 4, 2, 16
    _, k, v = _stream(batch, capacity, heads, kv_heads, dim, dim, jnp.float32, seed=4)
    q = checks.normal((batch, new_tokens, heads, dim), seed=5)
    kv_length = np.array([45, 6], np.int32)
    rng = np.random.default_rng(0)
    slots = np.stack([rng.permutation(capacity) for _ in range(batch)])  # slot -> position
    positions = np.where(slots < kv_length[:, None], slots, -1)
    positions[1, ::2] = np.where(positions[1, ::2] < 0, EMPTY_POSITION, positions[1, ::2])
    placed = lambda x: np.take_along_axis(np.asarray(x), slots[:, :, None, None], axis=1)
    mesh, axes = _mesh("auto")
    seq = P(None, axes)
    f = jax.shard_map(
        lambda q, k, v, n, pos: decode_attention(q, k, v, seq_axes=axes, seq_lengths=n,
                                                 kv_positions=pos, **mask),
        mesh=mesh, in_specs=(P(), seq, seq, P(), seq), out_specs=P())
    out = jax.jit(f)(q, placed(k), placed(v), jnp.asarray(kv_length), jnp.asarray(positions))
    for b, n in enumerate(kv_length):
        expected = reference.attention(
            q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=True,
            positions=n - new_tokens + jnp.arange(new_tokens, dtype=jnp.int32)[None],
            kv_positions=jnp.arange(n, dtype=jnp.int32)[None], **mask)
        np.testing.assert_allclose(out[b:b + 1], expected, **tolerances(jnp.float32))


@pytest.mark.parametrize("new_tokens, heads, kv_heads, head_dim, v_head_dim, dtype", [
    pytest.param(1, 8, 2, 16, 8, jnp.float32, id="gqa-t1"),
    pytest.param(3, 4, 1, 576, 512, jnp.bfloat16, id="mla-t3"),
])
def test_comm_bytes_decode_matches_compiled_hlo(new_tokens, heads, kv_heads, head_dim,
                                                v_head_dim, dtype):
    mesh, axes = _mesh("explicit")
    batch = 2
    cache = inference.KVCache.create(mesh, batch=batch, capacity=256, num_kv_heads=kv_heads,
                                     head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype)
    q, k, v = _stream(batch, new_tokens, heads, kv_heads, head_dim, v_head_dim, dtype)
    measured = hlo.collective_bytes(jax.jit(inference.decode).lower(q, k, v, cache).compile())
    predicted = comm_bytes("decode", batch=batch, seq_len=new_tokens, num_heads=heads,
                           num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                           axis_sizes=8, dtype_bytes=dtype(0).itemsize)
    assert sum(measured.values()) == measured["all-reduce"] == predicted, measured
    # One pmax of the lse and the psums of the weights and outputs, all float32.
    assert predicted == 2 * 7 / 8 * 4 * batch * new_tokens * heads * (v_head_dim + 2)


def _small_cache(**kwargs):
    mesh, axes = _mesh("explicit")
    args = dict(batch=2, capacity=64, num_kv_heads=2, head_dim=16)
    args.update(kwargs)
    return inference.KVCache.create(mesh, **args)


@pytest.mark.parametrize("call, message", [
    pytest.param(lambda: _small_cache(capacity=60), "capacity=60 is not divisible by the 8",
                 id="capacity"),
    pytest.param(lambda: _small_cache(seq_axes="tp"), "not an axis of the mesh", id="axis"),
    pytest.param(lambda: _small_cache(head_dim=0), "head_dim must be a positive int",
                 id="head-dim"),
    pytest.param(lambda: _small_cache(capacity=2**31), r"capacity must fit int32 .* "
                 "Got capacity=2147483648", id="capacity-int32"),  # was a host OOM
    pytest.param(lambda: inference.prefill(*_stream(2, 72, 4, 2, 16, 16, jnp.float32),
                                           _small_cache()),
                 "72 tokens but the cache holds only capacity=64", id="prompt-too-long"),
    pytest.param(lambda: inference.prefill(*_stream(2, 8, 4, 1, 16, 16, jnp.float32),
                                           _small_cache()),
                 r"must match the cache's \(batch, Hkv, Dqk, Dv\)=\(2, 2, 16, 16\)",
                 id="kv-heads"),
    pytest.param(lambda: inference.prefill(*_stream(2, 8, 4, 2, 16, 16, jnp.float32),
                                           _small_cache(), seq_lengths=jnp.ones(3, jnp.int32)),
                 r"seq_lengths must have shape \[batch\]=\(2,\)", id="lengths"),
    pytest.param(lambda: inference.decode(*_stream(2, 65, 4, 2, 16, 16, jnp.float32),
                                          _small_cache()),
                 "65 new tokens do not fit a cache of capacity=64", id="too-many-new"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("cache_dtype, q_dtype", [(jnp.bfloat16, jnp.float32),
                                                  (jnp.float32, jnp.float16)])
def test_a_dtype_other_than_the_caches_is_refused_by_name(step, cache_dtype, q_dtype):
    """Refused at the entry point, naming both dtypes and the argument to change, never
    a kernel (the CPU once reported the GPU kernel's dtypes, for arrays the user never
    made)."""
    cache = _small_cache(dtype=cache_dtype)
    q, k, v = _stream(2, 4, 4, 2, 16, 16, q_dtype)
    cached, asked = jnp.dtype(cache_dtype).name, jnp.dtype(q_dtype).name
    message = (rf"the cache stores {cached} keys and values but q is {asked}: create the "
               rf"cache with dtype={asked} \(KVCache.create\(\.\.\., dtype=\.\.\.\)")
    with pytest.raises(ValueError, match=message) as refused:
        getattr(inference, step)(q, k, v, cache)
    assert "kernel" not in str(refused.value) and "pallas" not in str(refused.value)


def test_the_default_cache_serves_float32_and_refuses_other_dtypes(tolerances):
    """``KVCache.create`` without ``dtype=`` stores float32 (a default float32 model
    decodes with it); a dtype no kernel takes is refused when the cache is made."""
    cache = _small_cache()
    assert cache.k.dtype == cache.v.dtype == jnp.float32
    q, k, v = _stream(2, 9, 4, 2, 16, 16, jnp.float32)
    _, cache = inference.prefill(q[:, :8], k[:, :8], v[:, :8], cache)
    out, cache = inference.decode(q[:, 8:], k[:, 8:], v[:, 8:], cache)
    np.testing.assert_allclose(out, _expected_stream(q, k, v)[:, 8:], **tolerances(jnp.float32))
    with pytest.raises(ValueError, match=r"dtype must be one of \['float32', 'bfloat16', "
                                         r"'float16', 'float8_e4m3fn', 'float8_e5m2'\] .* "
                                         r"Got dtype=int32"):
        _small_cache(dtype=jnp.int32)



# --- capacity is a contract: a step that would pass it is refused and writes nothing ----

def _snapshot(cache):
    return [np.asarray(x) for x in (cache.k, cache.v, cache.positions, cache.length)]


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_a_full_cache_refuses_the_step_that_would_overflow(how, tolerances):
    """Capacity 16, a 12-token prompt, then single-token steps: the steps to length 16
    match the reference, the 17th is refused with the capacity, the row's length and the
    tokens asked for, and the cache before it is untouched."""
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = _stream(1, 20, 4, 2, 16, 16, jnp.float32)
    stream = _expected_stream(q, k, v)
    decode = inference.decode if how == "eager" else jax.jit(inference.decode)
    error = ValueError if how == "eager" else (ValueError, jax.errors.JaxRuntimeError)
    with jax.set_mesh(mesh):
        cache = inference.KVCache.create(mesh, batch=1, capacity=16, num_kv_heads=2,
                                         head_dim=16, dtype=jnp.float32)
        _, cache = inference.prefill(q[:, :12], k[:, :12], v[:, :12], cache)
        for position in range(12, 16):
            new = slice(position, position + 1)
            out, cache = decode(q[:, new], k[:, new], v[:, new], cache)
            np.testing.assert_allclose(out[:, 0], stream[:, position], **tolerances(jnp.float32))
        before = _snapshot(cache)
        message = (r"capacity=16 tokens per row, row 0 holds length=16 and 1 new token\(s\) "
                   r"were asked for \(16 \+ 1 > 16\); nothing was written")
        with pytest.raises(error, match=message):
            out, _ = decode(q[:, 16:17], k[:, 16:17], v[:, 16:17], cache)
            np.asarray(out)  # under jit the step fails when it runs
        for kept, was in zip(_snapshot(cache), before):
            np.testing.assert_array_equal(kept, was)


def test_a_refused_step_writes_no_token_of_any_row():
    """Three new tokens for two rows, one of which has room for two: the whole step is
    refused under jit (no partial write), and the cache it was given is intact."""
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = _stream(2, 16, 4, 2, 16, 16, jnp.float32)
    cache = inference.KVCache.create(mesh, batch=2, capacity=16, num_kv_heads=2, head_dim=16,
                                     dtype=jnp.float32)
    _, cache = inference.prefill(q[:, :14], k[:, :14], v[:, :14], cache,
                                 seq_lengths=jnp.array([14, 3], jnp.int32))
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"row 0 holds length=14 and 3 new token"):
        inference.decode(q[:, :3], k[:, :3], v[:, :3], cache)
    out, refused = jax.jit(inference.decode)(q[:, :3], k[:, :3], v[:, :3], cache)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"capacity=16 .* row 0 holds "
                                                         r"length=14 and 3 new token"):
        np.asarray(refused.length)
    for kept, was in zip(_snapshot(cache), before):
        np.testing.assert_array_equal(kept, was)



def test_a_sliding_window_cache_is_exact_over_four_times_its_capacity(tolerances):
    """Opted in with ``window=``: a ring of 16 slots serves 64 decode steps of attention
    six keys back exactly (no refusal); a wider window than the cache keeps is refused."""
    mesh = jax.make_mesh((8,), ("sp",))
    prompt, steps, window = 8, 64, (6, 0)
    q, k, v = _stream(1, prompt + steps, 4, 2, 16, 16, jnp.float32)
    stream = _expected_stream(q, k, v, window=window)
    with jax.set_mesh(mesh):
        cache = inference.KVCache.create(mesh, batch=1, capacity=16, num_kv_heads=2,
                                         head_dim=16, dtype=jnp.float32, window=6)
        _, cache = inference.prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], cache,
                                     window=window)
        with pytest.raises(ValueError, match=r"window=\(left <= 6, 0\)"):
            inference.decode(q[:, :1], k[:, :1], v[:, :1], cache, window=(7, 0))
        with pytest.raises(ValueError, match="decode at most 10 tokens a step"):
            inference.decode(q[:, :11], k[:, :11], v[:, :11], cache, window=window)
        decode = jax.jit(functools.partial(inference.decode, window=window), donate_argnums=3)
        outs = []
        for position in range(prompt, prompt + steps):
            new = slice(position, position + 1)
            out, cache = decode(q[:, new], k[:, new], v[:, new], cache)
            outs.append(out[:, 0])
    np.testing.assert_allclose(np.stack(outs, axis=1), stream[:, prompt:],
                               **tolerances(jnp.float32))
    np.testing.assert_array_equal(cache.length, [prompt + steps])


# --- Flax: SelfAttention's decode mode and the example LM's generation ----------------

def _tiny_lm():
    from jax_seqpar.examples import ModelConfig, init_params

    config = ModelConfig(d_model=32, num_layers=2, num_heads=8, num_kv_heads=2, mlp_hidden=64)
    return config, init_params(config, 0)


def test_generation_from_the_sharded_cache_matches_unsharded_tokens():
    from flax import nnx

    from jax_seqpar.examples import Parallelism, TransformerLM
    from jax_seqpar.examples._generate import generate, generate_unsharded_reference

    config, params = _tiny_lm()
    prompts = np.random.default_rng(0).integers(0, 256, (3, 20)).astype(np.int32)
    lengths = np.array([20, 3, 9], np.int32)  # ragged; row 1 leaves shards 3..7 empty
    unsharded = TransformerLM(config, rngs=nnx.Rngs(0))
    nnx.update(unsharded, params)
    expected = generate_unsharded_reference(unsharded, prompts, lengths, num_tokens=12)
    mesh, _ = _mesh("explicit")
    model = TransformerLM(config, Parallelism(mesh, "sp", "ring"), rngs=nnx.Rngs(0))
    nnx.update(model, params)
    result = generate(model, prompts, lengths, num_tokens=12)
    assert result.tokens.shape == (3, 12) and result.tokens.dtype == np.int32
    np.testing.assert_array_equal(result.tokens, expected)
    cache = model.blocks[0].attention.cache.get_value()
    assert isinstance(cache, inference.KVCache)
    assert tuple(cache.k.sharding.spec)[:2] == (None, "sp")
    np.testing.assert_array_equal(cache.length, lengths + 11)  # the last token is not fed


@pytest.mark.parametrize("transform", ["grad", "jit-grad", "vjp"])
def test_a_gradient_of_decode_is_refused_by_name(transform):
    """Decoding is inference: its backward is our ValueError (it was JAX's "Linearization
    failed" from inside the step)."""
    cache = _small_cache()
    q, k, v = _stream(2, 8, 4, 2, 16, 16, jnp.float32)
    _, cache = inference.prefill(q, k, v, cache)

    def loss(q):
        return inference.decode(q[:, :1], k[:, :1], v[:, :1], cache)[0].sum()

    with jax.set_mesh(cache.mesh), pytest.raises(
            ValueError, match="decode is inference against a KV cache and has no gradient"):
        if transform == "vjp":
            jax.vjp(loss, q)[1](jnp.float32(1.0))
        else:
            (jax.jit(jax.grad(loss)) if transform == "jit-grad" else jax.grad(loss))(q)


def test_a_cache_larger_than_a_devices_free_memory_is_refused():
    """Where a device reports its memory (GPU, TPU), a cache that does not fit is a
    ValueError naming the bytes, not an out-of-memory crash."""
    from jax_seqpar.api import kv_cache

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 1000, "bytes_in_use": 400}

        def __str__(self):
            return "gpu:0"

    class Mesh:
        devices = np.array([Device()])

    kv_cache._check_memory(Mesh(), 600)  # fits exactly
    with pytest.raises(ValueError, match="needs 601 bytes on each device but gpu:0 has 600"):
        kv_cache._check_memory(Mesh(), 601)


def test_decode_mode_errors():
    from flax import nnx

    from jax_seqpar.flax import SelfAttention

    layer = SelfAttention(32, 4, causal=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"no KV cache; call layer.init_cache"):
        layer.decode(jnp.ones((1, 1, 32)))
    with pytest.raises(ValueError, match="decode mode needs a causal layer"):
        SelfAttention(32, 4, rngs=nnx.Rngs(0)).init_cache(1, 8)
    layer.init_cache(1, 8, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"prompt has 9 tokens .* capacity=8"):
        layer.prefill(jnp.ones((1, 9, 32)))
    layer.prefill(jnp.ones((1, 7, 32)))
    with pytest.raises(ValueError, match=r"capacity=8 .* length=7 and 2 new token"):
        layer.decode(jnp.ones((1, 2, 32)))
    assert int(layer.cache.get_value().length[0]) == 7  # the refused step wrote nothing
    layer.decode(jnp.ones((1, 1, 32)))
    with pytest.raises(ValueError, match=r"capacity=8 .* length=8 and 1 new token"):
        layer.decode(jnp.ones((1, 1, 32)))


def test_generate_refuses_more_tokens_than_the_cache_holds():
    from flax import nnx

    from jax_seqpar.examples import TransformerLM
    from jax_seqpar.examples._generate import generate

    config, _ = _tiny_lm()
    model = TransformerLM(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"capacity=16 cannot hold the longest prompt "
                                         r"\(length=10\) plus the 12 tokens"):
        generate(model, np.zeros((1, 10), np.int32), [10], num_tokens=12, capacity=16)
    assert model.blocks[0].attention.cache is None  # refused before any work


def test_cli_generate_trains_saves_then_loads(tmp_path, capsys):
    from jax_seqpar.tools.cli import main

    path = str(tmp_path / "demo-lm-params.npz")
    args = ["generate", "--prompt", "def ", "--tokens", "5", "--out", str(tmp_path)]
    assert main(args + ["--train-steps", "1"]) == 0
    first = capsys.readouterr().out
    assert "trained 1 steps" in first and f"parameters saved to {path}" in first
    assert main(args) == 0
    second = capsys.readouterr().out
    assert f"loaded parameters from {path}" in second and "tokens/s" in second
    # Same parameters, same greedy text.
    assert [l for l in first.splitlines() if l.startswith("def ")] == [
        l for l in second.splitlines() if l.startswith("def ")]
