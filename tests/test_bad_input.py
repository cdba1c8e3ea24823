"""Bad input is refused and good input is honoured, at every public entry point.

Each row of the table of inputs that once gave a wrong answer without a word: token
metadata that is not an int32 array (floats truncated, wide ints wrapping around), the
padding id (documented: padding, its rows zero), positions and windows at the int32 limits,
non-numbers and non-bools where numbers and bools go, scalar sinks, empty batches and
sequences, arguments that need a mesh given without one; ``jax.nn``'s sequence lengths
each meaning what they mean there; x64 mode. Refusals raise before any program
compiles; answers are compared with the reference (outputs and gradients).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import checks
from jax_seqpar import (dot_product_attention, permute_batch, ring_attention,
                        sequence_parallel_attention)
from jax_seqpar.core import reference
from jax_seqpar.core.masks import PAD_SEGMENT

B, S, H, D = 2, 64, 8, 16
INT32_MAX = 2**31 - 1


@functools.cache
def _mesh():
    return jax.make_mesh((8,), ("sp",))


def _qkv(batch=B, seq=S, seed=0):
    return tuple(checks.normals([(batch, seq, H, D)] * 3, seed=seed))


#: Every way the global entry point runs: each strategy on the mesh, and without one.
CALLS = {
    "ring": dict(strategy="ring"),
    "ulysses": dict(strategy="ulysses"),
    "hybrid": dict(strategy="hybrid", ulysses_size=2),
    "allgather": dict(strategy="allgather"),
    "local": None,
}


def _global(call: str, q, k, v, **kwargs):
    options = CALLS[call]
    if options is None:
        return sequence_parallel_attention(q, k, v, mesh=None, **kwargs)
    return sequence_parallel_attention(q, k, v, mesh=_mesh(), **options, **kwargs)


def _per_shard(q, k, v, **kwargs):
    """``ring_attention`` inside ``shard_map``: the per-shard entry point's checks."""
    mesh, _ = checks.strategy_mesh("ring")  # Auto axes: shard_map places the inputs
    seq = P(None, "sp")
    ids = {name: kwargs.pop(name) for name in ("segment_ids", "positions") if name in kwargs}
    fn = jax.shard_map(
        lambda q, k, v, ids: ring_attention(q, k, v, seq_axes="sp", **ids, **kwargs),
        mesh=mesh, in_specs=(seq, seq, seq, {name: seq for name in ids}), out_specs=seq)
    return fn(q, k, v, ids)


# ---- token metadata: integer arrays of the documented shape whose values fit int32 ----

def _float_positions():
    return jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32) * 0.5, (B, S))


def _float_segments():
    return jnp.asarray(np.where(np.arange(S) < S // 2, 0.3, 0.7)[None].repeat(B, 0),
                       jnp.float32)


def _wide_segments():  # int64 on the host, x64 off: two documents 2**31 apart
    return np.where(np.arange(S) < S // 2, 0, 2**31)[None].repeat(B, 0).astype(np.int64)


def _uint32_segments():
    return jnp.asarray(_wide_segments().astype(np.uint32))


def _padding_segments():
    return jnp.asarray(np.where(np.arange(S) < S // 2, PAD_SEGMENT, 1)[None].repeat(B, 0),
                       jnp.int32)


BAD_IDS = [
    pytest.param("positions", _float_positions, "float32", id="float-positions"),
    pytest.param("segment_ids", _float_segments, "float32", id="float-segment-ids"),
    pytest.param("kv_segment_ids", _float_segments, "float32", id="float-kv-segment-ids"),
    pytest.param("segment_ids", _wide_segments, "2147483648", id="int64-past-int32"),
    pytest.param("segment_ids", _uint32_segments, "2147483648", id="uint32-past-int32"),
    pytest.param("positions", lambda: np.full((B, S), 2**40), "1099511627776",
                 id="int64-positions-past-int32"),
    pytest.param("segment_ids", lambda: jnp.zeros((B, S), bool), "bool", id="bool-ids"),
    pytest.param("positions", lambda: jnp.zeros((B, S + 1), jnp.int32), "(2, 65)",
                 id="positions-shape"),
]


def _ids_kwargs(name, ids):
    kwargs = {name: ids}
    if name == "kv_segment_ids":
        kwargs["segment_ids"] = jnp.zeros((B, S), jnp.int32)
    return kwargs


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("name, make, shown", BAD_IDS)
def test_bad_ids_are_refused(call, name, make, shown):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=name) as error:
        _global(call, q, k, v, causal=True, **_ids_kwargs(name, make()))
    assert shown in str(error.value)


@pytest.mark.parametrize("name, make, shown", [p for p in BAD_IDS if "segment" in p.id
                                               and "kv" not in p.id][:2])
def test_bad_ids_are_refused_by_the_flax_layer(name, make, shown):
    from flax import nnx

    from jax_seqpar.flax import SelfAttention

    layer = SelfAttention(32, 4, mesh=_mesh(), strategy="ring", causal=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=name):
        layer(jnp.zeros((B, S, 32)), **{name: make()})


@pytest.mark.parametrize("call", ["ring", "local"])
def test_the_padding_id_marks_padding(call, tolerances):
    """``PAD_SEGMENT`` is the documented padding marker (``permute_batch``'s padding
    slots carry it): its tokens' rows are zero and nothing sees them; the real tokens
    attend exactly as without them."""
    q, k, v = _qkv()
    ids = _padding_segments()  # the first half padding, the second one document
    out = _global(call, q, k, v, causal=True, segment_ids=ids)
    np.testing.assert_array_equal(np.asarray(out[:, :S // 2]), 0)
    real = slice(S // 2, S)
    expected = reference.attention(q[:, real], k[:, real], v[:, real], causal=True)
    np.testing.assert_allclose(np.asarray(out[:, real]), np.asarray(expected),
                               **tolerances(q.dtype))


def test_float_ids_are_refused_per_shard_and_under_jit():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="positions.*float32"):
        _per_shard(q, k, v, causal=True, positions=_float_positions())
    with pytest.raises(ValueError, match="segment_ids.*float32"):
        jax.jit(lambda ids: _global("ring", q, k, v, segment_ids=ids))(_float_segments())


def test_wide_ids_under_jit_are_refused_by_dtype():
    """A traced uint32 array's values cannot be read: its dtype is refused."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="segment_ids has dtype uint32"):
        jax.jit(lambda ids: _global("ring", q, k, v, segment_ids=ids))(_uint32_segments())


def test_lengths_must_be_integers():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="query_seq_lengths.*float32"):
        dot_product_attention(q, k, v, query_seq_lengths=jnp.array([30.0, 20.0]))
    with pytest.raises(ValueError, match="key_value_seq_lengths holds 4294967296"):
        dot_product_attention(q, k, v, key_value_seq_lengths=np.array([2**32, 1]),
                              mesh=_mesh())


# ---- positions and windows at the int32 limits: no overflow ----

def _check(call, tolerances, args, expected_kwargs, **kwargs):
    """``call``'s output and gradients on ``args`` equal the reference with
    ``expected_kwargs`` (the same mask, expressed without the extreme values)."""
    checks.assert_matches(lambda q, k, v: _global(call, q, k, v, **kwargs),
                          lambda q, k, v: reference.attention(q, k, v, **expected_kwargs),
                          args, tolerances)


def _calls_and(values, ids, default):
    """``(call, value)`` params, every call with every value; the default tier runs the
    ``(call, value id)`` pairs in ``default``, the matrix tier the rest."""
    params = [pytest.param(call, value, id=f"{call}-{name}")
              for call in CALLS for value, name in zip(values, ids)]
    return checks.tiered(params, lambda i: params[i].id in default)


@pytest.mark.parametrize("call, base", _calls_and(
    [INT32_MAX - S + 1, -(2**31)], ["top", "bottom"], {"ring-top", "local-bottom"}))
def test_positions_at_the_int32_limits_with_a_window(call, base, tolerances):
    """Only differences of positions matter: a window near either int32 limit equals the
    same window at positions 0 .. S-1."""
    args = _qkv(seed=1)
    positions = jnp.broadcast_to(base + jnp.arange(S, dtype=jnp.int32), (B, S))
    _check(call, tolerances, args, dict(window=(5, 3)), positions=positions, window=(5, 3))


@pytest.mark.parametrize("call, window", _calls_and(
    [INT32_MAX, (2**31, 0), 2**64], ["int32-max", "2**31", "2**64"],
    {"ring-int32-max", "local-2**31", "local-2**64"}))
def test_windows_past_the_sequence_are_unbounded(call, window, tolerances):
    _check(call, tolerances, _qkv(seed=2), dict(causal=True), causal=True, window=window)


# ---- scalars that shape the program: checked by type and range ----

BAD_OPTIONS = [
    pytest.param(dict(window=(-0.5, 3)), "window sides must", id="window-float"),
    pytest.param(dict(window=(2.0, 3)), "window sides must", id="window-whole-float"),
    pytest.param(dict(window=(-1, 3)), "window sides must", id="window-negative"),
    pytest.param(dict(window=(True, 3)), "window sides must", id="window-bool"),
    pytest.param(dict(softcap=True), "softcap must be", id="softcap-bool"),
    pytest.param(dict(softcap=float("nan")), "softcap must be", id="softcap-nan"),
    pytest.param(dict(softcap=0.0), "softcap must be", id="softcap-zero"),
    pytest.param(dict(softcap="50"), "softcap must be", id="softcap-str"),
    pytest.param(dict(causal="no"), "causal must be a bool", id="causal-str"),
    pytest.param(dict(causal=1), "causal must be a bool", id="causal-int"),
    pytest.param(dict(scale=np.array([0.3])), "scale must be", id="scale-array"),
    pytest.param(dict(scale=True), "scale must be", id="scale-bool"),
    pytest.param(dict(scale=float("inf")), "scale must be", id="scale-inf"),
    pytest.param(dict(sinks=jnp.float32(0.5)), "sinks must be a float array", id="sinks-scalar"),
    pytest.param(dict(sinks=jnp.zeros((H,), jnp.int32)), "sinks must be a float array",
                 id="sinks-int"),
    pytest.param(dict(return_lse="yes"), "return_lse must be a bool", id="return-lse-str"),
]


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kwargs, name", BAD_OPTIONS)
def test_bad_options_are_refused(call, kwargs, name):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=name):
        _global(call, q, k, v, **kwargs)


@pytest.mark.parametrize("kwargs, name", [p for p in BAD_OPTIONS if "return" not in p.id])
def test_bad_options_are_refused_per_shard(kwargs, name):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=name):
        _per_shard(q, k, v, **kwargs)


def test_bad_options_are_refused_by_the_drop_in_and_the_flax_layers():
    from flax import nnx

    from jax_seqpar.flax import SelfAttention, make_attention_fn

    q, k, v = _qkv()
    for mesh in (None, _mesh()):
        with pytest.raises(ValueError, match="is_causal"):
            dot_product_attention(q, k, v, is_causal="no", mesh=mesh)
        with pytest.raises(ValueError, match="window"):
            dot_product_attention(q, k, v, local_window_size=(-0.5, 3), mesh=mesh)
        with pytest.raises(ValueError, match="scale"):
            dot_product_attention(q, k, v, scale=np.array([0.3]), mesh=mesh)
    with pytest.raises(ValueError, match="causal"):
        make_attention_fn(_mesh(), causal="no")
    with pytest.raises(ValueError, match="is_causal"):
        make_attention_fn(_mesh())(q, k, v, is_causal="no")
    with pytest.raises(ValueError, match="softcap"):
        SelfAttention(32, 4, mesh=_mesh(), softcap=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="window"):
        SelfAttention(32, 4, mesh=_mesh(), window=(-0.5, 3), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("call", checks.tiered(list(CALLS), lambda i: i == 4))
def test_softcap_inf_is_no_cap(call, tolerances):
    """``c * tanh(s / c) -> s`` as ``c`` grows: ``softcap=inf`` is attention without a cap
    (computed as written it would be ``inf * 0``: every output NaN)."""
    _check(call, tolerances, _qkv(seed=3), dict(causal=True), causal=True,
           softcap=float("inf"))


# ---- empty batches and sequences: empty results, as jax.nn gives ----

@pytest.mark.parametrize("call, shape", _calls_and(
    [(0, S), (B, 0)], ["batch-0", "seq-0"], {"ring-batch-0", "local-batch-0", "ulysses-seq-0",
                                             "local-seq-0"}))
def test_empty_batch_or_sequence_gives_an_empty_result(call, shape):
    batch, seq = shape
    q, k, v = _qkv(batch, seq)
    out, lse = _global(call, q, k, v, causal=True, return_lse=True)
    assert out.shape == (batch, seq, H, D) and out.dtype == q.dtype
    assert lse.shape == (batch, seq, H) and lse.dtype == jnp.float32
    grads = jax.grad(lambda q: _global(call, q, k, v, causal=True).sum())(q)
    assert grads.shape == q.shape


def test_empty_sequence_through_the_drop_in():
    q, k, v = _qkv(B, 0)
    expected = jax.nn.dot_product_attention(q, k, v)
    for mesh in (None, _mesh()):
        out = dot_product_attention(q, k, v, mesh=mesh)
        assert out.shape == expected.shape and out.dtype == expected.dtype


# ---- arguments that need a mesh: refused without one, never dropped ----

@pytest.mark.parametrize("kwargs", [dict(strategy="ring"), dict(seq_axes="dp"),
                                    dict(layout="zigzag"), dict(batch_axes="dp"),
                                    dict(ulysses_size=2)], ids=lambda kw: next(iter(kw)))
def test_mesh_arguments_without_a_mesh_are_refused(kwargs):
    q, k, v = _qkv()
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name}=.*needs a mesh"):
        sequence_parallel_attention(q, k, v, mesh=None, **kwargs)
    if name in ("strategy", "seq_axes", "layout"):
        with pytest.raises(ValueError, match=f"{name}=.*needs a mesh"):
            dot_product_attention(q, k, v, **kwargs)


# ---- permute_batch ----

def test_permute_batch_axis_out_of_range():
    tokens = jnp.zeros((B, S), jnp.int32)
    with pytest.raises(ValueError, match="axis=2"):
        permute_batch({"tokens": tokens}, "zigzag", 8, axis=2)
    with pytest.raises(ValueError, match="axis=True"):
        permute_batch({"tokens": tokens}, "zigzag", 8, axis=True)


# ---- jax.nn's sequence lengths: each means what it means there ----

_LENGTHS = [
    pytest.param(dict(query_seq_lengths=[30, 64]), S, id="q-lengths"),
    pytest.param(dict(key_value_seq_lengths=[30, 50]), S, id="kv-lengths"),
    pytest.param(dict(query_seq_lengths=[30, 7], key_value_seq_lengths=[50, 20]), S,
                 id="both"),
    pytest.param(dict(query_seq_lengths=[20, 32]), 32, id="q-lengths-T<S"),
    pytest.param(dict(key_value_seq_lengths=[40, 9]), 32, id="kv-lengths-T<S"),
    pytest.param(dict(query_seq_lengths=[20, 5], key_value_seq_lengths=[40, 64]), 32,
                 id="both-T<S"),
]


#: ``(lengths, q_len, causal, mesh)``: every case, T != S only without a mesh (a mesh
#: splits one sequence). The default tier runs each length alone and both, locally and
#: (query lengths) on the mesh.
LENGTHS = [pytest.param(*case.values, causal, mesh, id=f"{case.id}-{kind}-{place}")
           for case in _LENGTHS for causal, kind in ((False, "full"), (True, "causal"))
           for mesh, place in ((False, "local"), (True, "mesh"))
           if not (mesh and case.values[1] != S)]
LENGTHS = checks.tiered(LENGTHS, lambda i: LENGTHS[i].id in {
    "q-lengths-causal-local", "q-lengths-full-mesh", "kv-lengths-T<S-causal-local",
    "both-T<S-full-local"})


@pytest.mark.parametrize("lengths, q_len, causal, mesh", LENGTHS)
def test_seq_lengths_match_jax_nn(lengths, q_len, causal, mesh, tolerances):
    """Outputs and gradients equal ``jax.nn.dot_product_attention``'s: keys past
    ``key_value_seq_lengths`` are masked, rows past ``query_seq_lengths`` are zero."""
    q = checks.normal((B, q_len, H, D), seed=4)
    k, v = checks.normals([(B, S, H, D)] * 2, seed=5)
    lengths = {name: jnp.asarray(x, jnp.int32) for name, x in lengths.items()}
    ours = functools.partial(dot_product_attention, is_causal=causal,
                             mesh=_mesh() if mesh else None, **lengths)
    expected = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                 implementation="xla", **lengths)
    out, _ = checks.assert_matches(ours, expected, (q, k, v), tolerances)
    if "query_seq_lengths" in lengths:
        rows = np.arange(q_len)[None] >= np.asarray(lengths["query_seq_lengths"])[:, None]
        assert not np.asarray(out)[rows].any()


# ---- x64 mode ----

@pytest.mark.parametrize("strategy", checks.tiered(["ring", "ulysses", "allgather", "hybrid"],
                                                   lambda i: i == 0))
def test_x64_mode(strategy, tolerances):
    """With ``jax_enable_x64`` the kernels' index arithmetic stays int32: ``kernel="auto"``
    traces the TPU branch too (:func:`jax.lax.platform_dependent`), which once mixed
    int32 grid indices with int64 Python ints."""
    extra = dict(ulysses_size=2) if strategy == "hybrid" else {}
    segments = checks.segments(B, S)
    with jax.enable_x64(True):
        args = _qkv(seed=6)
        checks.assert_matches(
            lambda q, k, v: sequence_parallel_attention(
                q, k, v, mesh=_mesh(), strategy=strategy, causal=True, segment_ids=segments,
                window=(20, 0), **extra),
            lambda q, k, v: reference.attention(q, k, v, causal=True, segment_ids=segments,
                                                window=(20, 0)),
            args, tolerances)


@pytest.mark.interpret
@pytest.mark.parametrize("kernel", ["mosaic", "pallas"])
def test_x64_mode_interpreted_kernels(kernel, tolerances):
    with jax.enable_x64(True):
        checks.assert_matches(
            lambda q, k, v: sequence_parallel_attention(
                q, k, v, mesh=_mesh(), strategy="ring", causal=True, kernel=kernel),
            lambda q, k, v: reference.attention(q, k, v, causal=True),
            _qkv(1, seed=7), tolerances)


# ---- issue 40's audit: a predicate's missing fields, lengths, int32 keywords ----------

def _reads_segment_ids(q, kv):
    return q.segment_ids == kv.segment_ids


@pytest.mark.parametrize("call", ["local", "ring"])
def test_mask_fn_reading_segment_ids_not_given_is_refused(call):
    """A predicate that reads ``segment_ids`` of a call given none is a ValueError naming
    the field and the keyword (it was ``None == None``: True, silently)."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask_fn read .*segment_ids.*pass segment_ids="):
        _global(call, q, k, v, causal=True, mask_fn=_reads_segment_ids)
    out = _global(call, q, k, v, causal=True, mask_fn=_reads_segment_ids,
                  segment_ids=jnp.zeros((B, S), jnp.int32))  # given: one document
    np.testing.assert_allclose(np.asarray(out), np.asarray(
        reference.attention(q, k, v, causal=True)), atol=2e-5, rtol=2e-5)


def test_mask_fn_reading_segment_ids_is_refused_where_none_are_shown():
    """``dot_product_attention`` and ``prefill`` show a predicate no segment ids: reading
    them is a ValueError saying so, not a comparison with None."""
    from jax_seqpar import KVCache, prefill

    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask_fn read .*segment_ids.*dot_product_attention"):
        dot_product_attention(q, k, v, is_causal=True, mask_fn=_reads_segment_ids)
    cache = KVCache.create(_mesh(), batch=B, capacity=S, num_kv_heads=H, head_dim=D,
                           dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"mask_fn read .*segment_ids"):
        prefill(q, k, v, cache, mask_fn=_reads_segment_ids)


def _table_mask():
    table = jnp.tril(jnp.ones((S, S), bool))  # closed over: a constant of the predicate
    return lambda q, kv: table[q.positions, kv.positions]


@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_mask_fn_holding_arrays_with_a_pallas_kernel_is_refused(kernel):
    """A predicate closing over an array cannot run in a Pallas kernel: asked for one by
    name, the call says so naming mask_fn and the kernels that can (it crashed naming
    ``pallas_call``)."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask_fn=.*closes over arrays.*kernel='xla'"):
        sequence_parallel_attention(q, k, v, kernel=kernel, mask_fn=_table_mask())


def test_chunk_size_must_fit_int32():
    """``chunk_size=2**31`` is a ValueError naming chunk_size (it was an OverflowError
    naming an argument path); ``2**31 - 1`` works, one chunk."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"chunk_size must fit int32.*chunk_size=2147483648"):
        sequence_parallel_attention(q, k, v, causal=True, chunk_size=2**31)
    with pytest.raises(ValueError, match=r"chunk_size must fit int32"):
        dot_product_attention(q, k, v, is_causal=True, chunk_size=2**40)
    out = sequence_parallel_attention(q, k, v, causal=True, chunk_size=INT32_MAX)
    np.testing.assert_allclose(np.asarray(out), np.asarray(
        reference.attention(q, k, v, causal=True)), atol=2e-5, rtol=2e-5)


def test_prefill_refuses_negative_seq_lengths():
    """``prefill(seq_lengths=)`` with a negative length is a ValueError naming it and the
    value, eagerly; under ``jit`` the program fails when it runs, with the same message
    (as decode's capacity check; not beside a split-axis hybrid, where a negative length
    reads as 0). The cache's length was -5."""
    from jax_seqpar import KVCache, prefill

    q, k, v = _qkv()
    mesh = _mesh()
    cache = KVCache.create(mesh, batch=B, capacity=S, num_kv_heads=H, head_dim=D,
                           dtype=jnp.float32)
    bad = jnp.array([3, -5], jnp.int32)
    with pytest.raises(ValueError, match=r"seq_lengths must be >= 0.*seq_lengths\[1\]=-5"):
        prefill(q, k, v, cache, seq_lengths=bad)
    with pytest.raises(ValueError, match=r"seq_lengths must be >= 0.*-5"):
        prefill(q, k, v, cache, seq_lengths=np.array([3, -5]))
    with jax.set_mesh(mesh):
        step = jax.jit(lambda lengths: prefill(q, k, v, cache, seq_lengths=lengths,
                                               strategy="ring")[1].length)
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"seq_lengths must be >= 0"):
            jax.block_until_ready(step(bad))
        np.testing.assert_array_equal(np.asarray(step(jnp.array([3, 0], jnp.int32))), [3, 0])
