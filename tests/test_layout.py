"""Token orders: global permutations and their per-shard equivalents."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import checks
from jax_seqpar.core import layout

NUM_SHARDS = 8


def _sharded(mesh_kind):
    """``(mesh, place)``: an 8-device "sp" mesh and a function placing ``[B, S, ...]``
    arrays sequence-sharded on it, for the Auto-axis ``Mesh`` and the Explicit-axis
    ``jax.make_mesh`` (used under ``jax.set_mesh``)."""
    if mesh_kind == "auto":
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("sp",))
        return mesh, lambda x: jax.device_put(x, jax.NamedSharding(mesh, P(None, "sp")))
    mesh = jax.make_mesh((NUM_SHARDS,), ("sp",))
    return mesh, lambda x: jax.reshard(x, P(None, "sp"))


def _mesh_context(mesh_kind, mesh):
    return jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext()


def _per_shard(f, mesh):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_permute_round_trip(num_shards, axis):
    x = checks.normal((4 * num_shards, 4 * num_shards, 2 * num_shards))
    y = layout.zigzag_permute(x, num_shards, axis=axis)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(layout.zigzag_unpermute(y, num_shards, axis=axis), x)
    if num_shards > 1:
        assert not np.array_equal(y, x)


@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
def test_zigzag_positions_are_permuted_arange(num_shards):
    seq_len = 6 * num_shards
    positions = layout.zigzag_positions(seq_len, num_shards)
    assert positions.shape == (seq_len,) and positions.dtype == jnp.int32
    np.testing.assert_array_equal(
        positions, layout.zigzag_permute(jnp.arange(seq_len), num_shards, axis=0))
    # Shard r holds half-shards r and 2P-1-r.
    chunk = seq_len // (2 * num_shards)
    for shard, local in enumerate(np.split(np.asarray(positions), num_shards)):
        expected = [shard, 2 * num_shards - 1 - shard]
        np.testing.assert_array_equal(local[::chunk] // chunk, expected)
    np.testing.assert_array_equal(layout.contiguous_positions(seq_len), np.arange(seq_len))


def test_permute_moves_rows_of_a_batch_together():
    tokens = jnp.arange(3 * 16).reshape(3, 16)
    permuted = layout.zigzag_permute(tokens, 4)
    np.testing.assert_array_equal(permuted, tokens[:, layout.zigzag_positions(16, 4)])


@pytest.mark.parametrize("seq_len", [12, 17])
def test_bad_seq_len_names_numbers(seq_len):
    with pytest.raises(ValueError, match=rf"2\*num_shards=8.*seq_len={seq_len}.*pad"):
        layout.zigzag_permute(jnp.zeros((1, seq_len)), 4)
    with pytest.raises(ValueError, match=rf"seq_len={seq_len}"):
        layout.zigzag_positions(seq_len, 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_shards"):
        layout.zigzag_permute(jnp.zeros((1, 8)), 0)
    with pytest.raises(ValueError, match="axis=2"):
        layout.zigzag_permute(jnp.zeros((1, 8)), 2, axis=2)
    with pytest.raises(ValueError, match="layout='diagonal'"):
        layout.shard_positions("diagonal", 4, axis_name="sp")


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("layout_name", ["contiguous", "zigzag"])
def test_shard_positions(mesh_kind, layout_name):
    mesh, _ = _sharded(mesh_kind)
    seq_len = 4 * NUM_SHARDS
    local_len = seq_len // NUM_SHARDS

    def positions():
        return layout.shard_positions(layout_name, local_len, axis_name="sp")[None]  # [1, S/P]

    f = jax.jit(jax.shard_map(positions, mesh=mesh, in_specs=(), out_specs=P(None, "sp")))
    with _mesh_context(mesh_kind, mesh):
        got = f()
    expected = (layout.zigzag_positions(seq_len, NUM_SHARDS) if layout_name == "zigzag"
                else layout.contiguous_positions(seq_len))
    assert got.shape == (1, seq_len) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got[0], expected)


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_to_and_from_zigzag_match_global_permutation(mesh_kind):
    mesh, place = _sharded(mesh_kind)
    x = checks.normal((2, 6 * NUM_SHARDS, 3, 5), seed=1)
    to_zigzag = _per_shard(functools.partial(layout.to_zigzag, axis_name="sp"), mesh)
    from_zigzag = _per_shard(functools.partial(layout.from_zigzag, axis_name="sp"), mesh)
    with _mesh_context(mesh_kind, mesh):
        x_sharded = place(x)
        zigzag = to_zigzag(x_sharded)
        back = from_zigzag(zigzag)
    assert zigzag.shape == x.shape and zigzag.dtype == x.dtype
    np.testing.assert_array_equal(zigzag, layout.zigzag_permute(x, NUM_SHARDS))
    np.testing.assert_array_equal(back, x)


def test_to_zigzag_other_axis():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("sp",))
    x = jnp.arange(3 * 2 * NUM_SHARDS).reshape(3, 2 * NUM_SHARDS).T  # [S, 3], seq on axis 0
    f = jax.jit(jax.shard_map(functools.partial(layout.to_zigzag, axis_name="sp", axis=0),
                              mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))
    np.testing.assert_array_equal(f(x), layout.zigzag_permute(x, NUM_SHARDS, axis=0))


def test_to_zigzag_odd_local_length_raises():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("sp",))
    to_zigzag = _per_shard(functools.partial(layout.to_zigzag, axis_name="sp"), mesh)
    with pytest.raises(ValueError, match="local_len=3"):
        to_zigzag(jnp.zeros((1, 3 * NUM_SHARDS)))


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_to_zigzag_gradient(mesh_kind):
    mesh, place = _sharded(mesh_kind)
    x = checks.normal((2, 4 * NUM_SHARDS, 3), seed=2)
    weights = jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) / x.size
    to_zigzag = _per_shard(functools.partial(layout.to_zigzag, axis_name="sp"), mesh)

    def loss(x):  # position-dependent, so a wrong transpose changes the gradient
        return jnp.sum(weights * to_zigzag(x) ** 2)

    def expected_loss(x):
        return jnp.sum(weights * layout.zigzag_permute(x, NUM_SHARDS) ** 2)

    with _mesh_context(mesh_kind, mesh):
        grad = jax.grad(loss)(place(x))
    expected = jax.grad(expected_loss)(x)
    assert grad.shape == x.shape
    np.testing.assert_allclose(grad, expected, atol=1e-6, rtol=1e-6)


def test_two_sequence_axes():
    """``axis_name`` may be a tuple of mesh axes (the sequence sharded over both)."""
    mesh = jax.make_mesh((2, NUM_SHARDS // 2), ("outer", "inner"))
    axes = ("outer", "inner")
    seq_len = 4 * NUM_SHARDS
    x = jnp.arange(2 * seq_len).reshape(2, seq_len)
    spec = P(None, axes)
    to_zigzag = jax.jit(jax.shard_map(functools.partial(layout.to_zigzag, axis_name=axes),
                                      mesh=mesh, in_specs=spec, out_specs=spec))
    positions = jax.jit(jax.shard_map(
        lambda: layout.shard_positions("zigzag", seq_len // NUM_SHARDS, axis_name=axes)[None],
        mesh=mesh, in_specs=(), out_specs=spec))
    with jax.set_mesh(mesh):
        zigzag = to_zigzag(jax.reshard(x, spec))
        got_positions = positions()
    np.testing.assert_array_equal(zigzag, layout.zigzag_permute(x, NUM_SHARDS))
    np.testing.assert_array_equal(got_positions[0], layout.zigzag_positions(seq_len, NUM_SHARDS))


def test_striped_round_trip_and_positions():
    x = jnp.arange(2 * 128 * 3).reshape(2, 128, 3)
    striped = layout.striped_permute(x, 8)
    np.testing.assert_array_equal(layout.striped_unpermute(striped, 8), x)
    np.testing.assert_array_equal(striped[0, :16, 0] // 3, jnp.arange(0, 128, 8))
    np.testing.assert_array_equal(layout.striped_positions(128, 8),
                                  layout.striped_permute(jnp.arange(128), 8, axis=0))
    with pytest.raises(ValueError, match="divisible by num_shards=8"):
        layout.striped_permute(jnp.arange(12), 8, axis=0)


def test_to_striped_matches_global_permutation():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("sp",))
    x = jnp.arange(2 * 128 * 3, dtype=jnp.float32).reshape(2, 128, 3)

    def shard_map(f, in_specs=P(None, "sp")):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P(None, "sp"))

    to = shard_map(lambda x: layout.to_striped(x, axis_name="sp"))
    back = shard_map(lambda x: layout.from_striped(x, axis_name="sp"))
    positions = jax.shard_map(lambda: layout.shard_positions("striped", 16, axis_name="sp"),
                              mesh=mesh, in_specs=(), out_specs=P("sp"))()
    np.testing.assert_array_equal(to(x), layout.striped_permute(x, 8))
    np.testing.assert_array_equal(back(to(x)), x)
    np.testing.assert_array_equal(positions, layout.striped_positions(128, 8))
    with pytest.raises(ValueError, match="divisible by the 8 shards"):
        to(jnp.zeros((1, 32, 1)))
