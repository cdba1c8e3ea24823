"""Sliding windows (halo exchange), attention sinks and logit soft-capping beyond the
strategies' exactness (tests/test_exactness.py runs every per-shard strategy with them
against the reference, on every token order): sharded-cache decode with sinks and
softcap, the XLA kernel's lse, bad input, the default token order, and the halo's
traffic read from the compiled HLO and held to ``comm_bytes``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import checks
import jax_seqpar as sp
from jax_seqpar.strategies import registry
from jax_seqpar.tools import hlo
from jax_seqpar.core import reference
from jax_seqpar.kernels import xla
from jax_seqpar.kernels import make_options
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar import comm_bytes

H, D, DV = 8, 16, 8
SINKS = jnp.array([0.5, -1.0, 2.0, 0.0, 1.5, -3.0, 0.25, 4.0], jnp.float32)


def test_decode_sinks_softcap(tolerances):
    capacity, new = 64, 2
    q, k, v = checks.normals([(2, new, H, D), (2, capacity, 2, D), (2, capacity, 2, DV)],
                             seed=6)
    kv_length = jnp.array([64, 3], jnp.int32)
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    f = jax.shard_map(
        lambda q, k, v, n, s: sp.decode_attention(q, k, v, seq_axes="sp", seq_lengths=n,
                                                  kernel="xla", softcap=2.0, sinks=s),
        mesh=mesh, in_specs=(P(), P(None, "sp"), P(None, "sp"), P(), P()), out_specs=P())
    out = jax.jit(f)(q, k, v, kv_length, SINKS)
    # The valid cache entries as one segment, the empty slots as another.
    positions = kv_length[:, None] - new + jnp.arange(new, dtype=jnp.int32)[None]
    cache_positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (2, capacity))
    expected = jax.jit(functools.partial(reference.attention, causal=True, softcap=2.0))(
        q, k, v, sinks=SINKS, positions=positions, kv_positions=cache_positions,
        segment_ids=jnp.zeros((2, new), jnp.int32),
        kv_segment_ids=(cache_positions >= kv_length[:, None]).astype(jnp.int32))
    np.testing.assert_allclose(out, expected, **tolerances(q.dtype))


def test_xla_kernel_softcap_out_lse_and_grads(tolerances):
    """The kernel alone: soft-capped logits, lse, and gradients through out AND lse."""
    q, k, v = checks.normals([(2, 40, 4, D), (2, 40, 2, D), (2, 40, 2, DV)], seed=1)
    q = 3 * q
    tokens = Tokens(jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40)))
    spec = MaskSpec.make(True, (9, 0))

    def ours(q, k, v):
        return xla.attention(q, k, v, tokens, tokens, make_options(
            q, spec, scale=0.5, kernel="xla", softcap=1.5,
            block_sizes=xla.BlockSizes(16, 8, 8, 16)))

    def theirs(q, k, v):
        return reference.attention(q, k, v, causal=True, window=(9, 0), scale=0.5,
                                   softcap=1.5, return_lse=True)

    for got, want in zip(jax.jit(ours)(q, k, v), jax.jit(theirs)(q, k, v)):
        np.testing.assert_allclose(got, want, **tolerances(q.dtype))
    loss = lambda f: lambda *a: jnp.sum(f(*a)[0] ** 2) + jnp.sum(jnp.sin(f(*a)[1]))  # noqa: E731
    for got, want in zip(jax.jit(jax.grad(loss(ours), (0, 1, 2)))(q, k, v),
                         jax.jit(jax.grad(loss(theirs), (0, 1, 2)))(q, k, v)):
        np.testing.assert_allclose(got, want, **tolerances(q.dtype, "grad"))


def test_softcap_bounds_the_logits():
    """With a tiny cap every visible key gets (nearly) the same weight: a mean of v."""
    q = 100 * jnp.ones((1, 8, 1, 4))
    k = jnp.arange(32.0).reshape(1, 8, 1, 4)
    v = jnp.arange(8.0).reshape(1, 8, 1, 1)
    out = jax.jit(functools.partial(reference.attention, softcap=1e-3))(q, k, v)
    np.testing.assert_allclose(out[0, :, 0, 0], np.full(8, 3.5), atol=1e-2)


@pytest.mark.parametrize("kwargs, message", [
    pytest.param(dict(kernel="pallas", softcap=2.0), "softcap=2.0 is not supported by the "
                 "kernel", id="pallas-softcap"),
    pytest.param(dict(softcap=-1.0), "softcap must be a positive float", id="negative-softcap"),
    pytest.param(dict(sinks=jnp.zeros((4,))), r"sinks must be a float array of shape "
                 r"\[num_heads\]=\(8,\). Got shape \(4,\)", id="sinks-shape"),
    pytest.param(dict(sinks=jnp.zeros((8,), jnp.int32)), "dtype int32", id="sinks-dtype"),
])
def test_bad_input_raises(kwargs, message):
    if kwargs.get("kernel") == "pallas":
        kwargs = dict(kwargs, softcap=-1.0)  # the Pallas kernel caps now: check its validation
        message = "softcap must be a positive float"
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    q = jnp.zeros((1, 64, 8, 16))
    f = jax.shard_map(lambda q: sp.ring_attention(q, q, q, seq_axes="sp", **kwargs),
                      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=message):
        f(q)


@pytest.mark.parametrize("strategy, causal, window, kwargs, expected", [
    ("ring", True, None, {}, "zigzag"),
    ("ring", True, (4096, 0), {}, "contiguous"),
    ("allgather", False, 128, {}, "contiguous"),
    ("ulysses", True, None, {}, "contiguous"),
    ("hybrid", True, (64, 0), dict(seq_len=1024, num_shards=8), "contiguous"),
    # A window reaching every shard has no halo: the causal imbalance is back.
    ("hybrid", True, (1024, 0), dict(seq_len=1024, num_shards=8), "zigzag"),
])
def test_default_layout(strategy, causal, window, kwargs, expected):
    spec = MaskSpec.make(causal=causal, window=window)
    assert registry.default_layout(strategy, spec, **kwargs) == expected


# --- traffic: compiled HLO against comm_bytes ----------------------------------------

SHAPE = dict(batch=1, seq_len=512, num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=8,
             dtype_bytes=4)


def _hlo_bytes(strategy, num_shards, window, causal=True, segments=False, mesh_shape=None):
    """Bytes one device sends in the compiled fwd + vjp (cotangent given) of ``strategy``."""
    devices = np.array(jax.devices()[:num_shards])
    if strategy == "hybrid":
        mesh = Mesh(devices.reshape(mesh_shape), ("outer", "inner"))
        fn = functools.partial(sp.hybrid_attention, seq_axes=("outer", "inner"))
    else:
        mesh = Mesh(devices, ("sp",))
        fn = functools.partial(getattr(sp, f"{strategy}_attention"), seq_axes="sp")
    seq = P(None, tuple(mesh.axis_names))
    n = SHAPE["seq_len"]
    q = jax.ShapeDtypeStruct((1, n, 4, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((1, n, 2, 16), jnp.float32)
    v = jax.ShapeDtypeStruct((1, n, 2, 8), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, n), jnp.int32)
    cot = jax.ShapeDtypeStruct((1, n, 4, 8), jnp.float32)
    attend = jax.shard_map(
        lambda q, k, v, ids: fn(q, k, v, causal=causal, window=window, kernel="xla",
                                segment_ids=ids if segments else None),
        mesh=mesh, in_specs=(seq,) * 4, out_specs=seq)

    def f_and_vjp(q, k, v, ids, cot):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, ids), q, k, v)
        return out, vjp(cot)

    return sum(hlo.collective_bytes(jax.jit(f_and_vjp).lower(q, k, v, ids, cot).compile())
               .values())


@pytest.mark.parametrize("num_shards", [2, 4, 8])
def test_causal_window_ring_bytes_constant_in_p(num_shards):
    window = (SHAPE["seq_len"] // 8, 0)  # W = S/8 <= S/P
    measured = _hlo_bytes("ring", num_shards, window)
    expected = comm_bytes("ring", axis_sizes=num_shards, backward=True, window=window,
                          causal=True, **SHAPE)
    assert measured == expected
    # W tokens of K/V forward, W tokens of float32 dK/dV back: no P in it.
    assert expected == 64 * 2 * (16 + 8) * 4 * 2
    if num_shards == 8:
        full = comm_bytes("ring", axis_sizes=8, backward=True, **SHAPE)
        assert full == _hlo_bytes("ring", 8, None)
        assert measured <= full / 2


@pytest.mark.parametrize("strategy, window, causal, segments, mesh_shape", [
    pytest.param("ring", (100, 30), False, True, None, id="ring-both-sides-segments"),
    pytest.param("allgather", (100, 30), False, True, None, id="allgather-both-sides-segments"),
    pytest.param("allgather", (64, 0), True, False, None, id="allgather-causal"),
    pytest.param("hybrid", (100, 0), True, False, (4, 2), id="hybrid-causal"),
])
def test_window_bytes_match_comm_bytes(strategy, window, causal, segments, mesh_shape):
    measured = _hlo_bytes(strategy, 8, window, causal, segments, mesh_shape)
    expected = comm_bytes(strategy, axis_sizes=mesh_shape or 8, backward=True, window=window,
                          causal=causal, with_segment_ids=segments, **SHAPE)
    assert measured == expected
    assert expected < comm_bytes(strategy, axis_sizes=mesh_shape or 8, backward=True,
                                 with_segment_ids=segments, **SHAPE)
