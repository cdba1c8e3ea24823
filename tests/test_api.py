"""The global entry point on real-model inputs: laid-out batches, padding, data and tensor
parallelism, unequal lengths (the jax.nn-compatible ``dot_product_attention``:
tests/test_dot_product.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import checks
import jax_seqpar as sp
from jax_seqpar.tools import hlo
from jax_seqpar import comm_bytes
from jax_seqpar.core import reference
from jax_seqpar.core.layout import zigzag_permute

STRATEGIES = list(checks.STRATEGIES)
_mesh = checks.strategy_mesh


# --- unequal local lengths: an error, never a silent answer ------------------------------

@pytest.mark.parametrize("strategy", ["ring", "ulysses", "allgather"])
def test_per_shard_unequal_lengths_raise(strategy, make_qkv):
    q, _, _ = make_qkv(batch=1, seq=128, heads=8, head_dim=8)
    _, k, v = make_qkv(batch=1, seq=64, heads=8, head_dim=8)
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    fn = functools.partial(getattr(sp, f"{strategy}_attention"), seq_axes="sp", causal=True)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match="64 local query tokens and 32 local key/value"):
        mapped(q, k, v)


# --- positions=: the batch is laid out once, no layer relayouts ---------------------------

@pytest.mark.parametrize("strategy,layout", checks.tiered(  # default: one layout each
    [pytest.param(s, layout, id=f"{s}-{layout}") for layout in ("zigzag", "striped")
     for s in STRATEGIES], lambda i: i // len(STRATEGIES) == i % 2))
def test_positions_on_permuted_inputs(strategy, layout, make_qkv, tolerances):
    q, k, v = make_qkv(batch=2, seq=128, heads=8, kv_heads=2, head_dim=8, seed=4)
    segment_ids = checks.segments(2, 128, documents=3)
    mesh, axes = _mesh(strategy)
    batch, positions = sp.permute_batch((q, k, v, segment_ids), layout, num_shards=8)

    def ours(q, k, v):
        out = sp.sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=axes, strategy=strategy, causal=True, window=(40, 5),
            segment_ids=batch[3], positions=positions)
        return sp.unpermute_batch(out, layout, num_shards=8)

    def theirs(q, k, v):
        q, k, v = sp.unpermute_batch((q, k, v), layout, num_shards=8)
        return reference.attention(q, k, v, causal=True, window=(40, 5), segment_ids=segment_ids)

    checks.assert_matches(ours, theirs, batch[:3], tolerances)


def test_permute_batch_round_trip_and_positions():
    tokens = jnp.arange(2 * 32).reshape(2, 32)
    batch, positions = sp.permute_batch({"tokens": tokens, "x": tokens[..., None] * 1.0},
                                        "zigzag", num_shards=4)
    np.testing.assert_array_equal(batch["tokens"], zigzag_permute(tokens, 4))
    np.testing.assert_array_equal(positions, jnp.broadcast_to(sp.zigzag_positions(32, 4),
                                                               (2, 32)))
    back = sp.unpermute_batch(batch, "zigzag", num_shards=4)
    np.testing.assert_array_equal(back["tokens"], tokens)
    with pytest.raises(ValueError, match="share its leading"):
        sp.permute_batch({"a": tokens, "b": tokens[:, :16]}, "zigzag", num_shards=4)


def test_positions_with_a_layout_is_refused(make_qkv):
    q, k, v = make_qkv(batch=1, seq=64, heads=8, head_dim=8)
    mesh, _ = _mesh("ring")
    positions = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (1, 64))
    with pytest.raises(ValueError, match="would relayout them again"):
        sp.sequence_parallel_attention(q, k, v, mesh=mesh, positions=positions,
                                       layout="zigzag")


def test_layer_with_positions_sends_exactly_comm_bytes():
    """A ring layer fed laid-out tokens: the whole program's bytes are the model's."""
    mesh, _ = _mesh("ring")
    batch, seq, heads, kv_heads, dim = 1, 1024, 8, 1, 64
    q = jnp.ones((batch, seq, heads, dim), jnp.float32)
    k = v = jnp.ones((batch, seq, kv_heads, dim), jnp.float32)
    positions = jnp.broadcast_to(sp.zigzag_positions(seq, 8), (batch, seq))
    f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy="ring",
                          causal=True, positions=positions)
    model = functools.partial(comm_bytes, "ring", batch=batch, seq_len=seq,
                              num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                              axis_sizes=8, dtype_bytes=4)
    fwd = hlo.collective_bytes(jax.jit(f).lower(q, k, v).compile())
    assert sum(fwd.values()) == model(), fwd
    vjp = lambda q, k, v, dout: jax.vjp(f, q, k, v)[1](dout)  # noqa: E731
    both = hlo.collective_bytes(jax.jit(lambda *a: (f(*a[:3]), vjp(*a))).lower(
        q, k, v, jnp.ones_like(q)).compile())
    assert sum(both.values()) == model(backward=True), both


# --- any length: padding inside -------------------------------------------------------------

LENGTH_CASES = [
    pytest.param(1000, dict(causal=True, segments=True), id="1000-causal-segments"),
    pytest.param(1023, dict(window=(70, 20), segments=True), id="1023-window-segments"),
    pytest.param(999, dict(causal=True, window=90), id="999-causal-window"),
]


@pytest.mark.parametrize("strategy,seq,mask", checks.tiered(  # default: one length each
    [pytest.param(strategy, *case.values, id=f"{case.id}-{strategy}")
     for case in LENGTH_CASES for strategy in STRATEGIES],
    lambda i: (i // len(STRATEGIES)) == i % len(STRATEGIES) % len(LENGTH_CASES)))
def test_any_sequence_length(strategy, seq, mask, make_qkv, tolerances):
    q, k, v = make_qkv(batch=1, seq=seq, heads=8, kv_heads=2, head_dim=8, seed=seq)
    mask = dict(mask)
    if mask.pop("segments", False):
        mask["segment_ids"] = checks.segments(1, seq, seed=seq, documents=3)
    mesh, axes = _mesh(strategy)
    ours = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=axes,
                             strategy=strategy, **mask)
    checks.assert_matches(ours, functools.partial(reference.attention, **mask), (q, k, v),
                          tolerances)


@pytest.mark.parametrize("strategy", ["auto", pytest.param("hybrid", marks=pytest.mark.matrix)])
def test_split_hybrid_at_a_length_the_devices_do_not_divide(strategy, make_qkv, tolerances):
    """At S=60 on 8 devices ``"auto"`` picks the hybrid over the one axis split 2 x 4; under
    ``jit`` and ``grad`` on an Explicit mesh its gradients come back on the caller's mesh
    (they were left with the padded sequence's split-mesh sharding, which the caller's
    mesh cannot name: an IndivisibleError at compile time)."""
    q, k, v = make_qkv(batch=1, seq=60, heads=8, kv_heads=8, head_dim=16, seed=60)
    mesh = jax.make_mesh((8,), ("sp",))
    split = {} if strategy == "auto" else dict(ulysses_size=4)
    ours = functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy=strategy,
                             causal=True, **split)
    with jax.set_mesh(mesh):
        checks.assert_matches(ours, functools.partial(reference.attention, causal=True),
                              (q, k, v), tolerances)


# --- data and tensor parallelism kept ------------------------------------------------------

def _auto_dp_sp():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "sp"))


def test_auto_mesh_keeps_the_batch_sharding(make_qkv, tolerances):
    q, k, v = make_qkv(batch=2, seq=128, heads=8, kv_heads=2, head_dim=8, seed=5)
    mesh = _auto_dp_sp()
    placed = [jax.device_put(x, NamedSharding(mesh, P("dp", "sp"))) for x in (q, k, v)]
    ours = functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy="ring",
                             causal=True)
    assert jax.jit(ours)(*placed).sharding.spec[:2] == ("dp", "sp")
    checks.assert_matches(ours, functools.partial(reference.attention, causal=True), placed,
                          tolerances)


def test_auto_mesh_dp_sp_sends_the_groups_bytes():
    """Auto mesh (dp=2, sp=4): each sequence group runs its own ring on its batch half."""
    mesh = _auto_dp_sp()
    batch, seq, heads, kv_heads, dim = 2, 512, 8, 2, 32
    sharding = NamedSharding(mesh, P("dp", "sp"))
    q = jax.ShapeDtypeStruct((batch, seq, heads, dim), jnp.float32, sharding=sharding)
    k = jax.ShapeDtypeStruct((batch, seq, kv_heads, dim), jnp.float32, sharding=sharding)
    f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy="ring",
                          causal=True, layout="contiguous")
    sent = hlo.collective_bytes(jax.jit(f).lower(q, k, k).compile())
    assert sum(sent.values()) == comm_bytes(
        "ring", batch=batch // 2, seq_len=seq, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=dim, axis_sizes=4, dtype_bytes=4), sent


def test_batch_axes_errors(make_qkv):
    q, k, v = make_qkv(batch=3, seq=64, heads=8, head_dim=8)
    mesh = _auto_dp_sp()
    with pytest.raises(ValueError, match="not divisible by the 2 devices"):
        sp.sequence_parallel_attention(q, k, v, mesh=mesh, batch_axes="dp")
    with pytest.raises(ValueError, match="not a mesh axis outside"):
        sp.sequence_parallel_attention(q, k, v, mesh=mesh, batch_axes="sp")


def test_auto_strategy_counts_the_heads_each_group_holds(make_qkv, tolerances):
    """Explicit (tp=2, sp=4), 4 heads over tp: 2 heads per group, so not Ulysses over 4."""
    q, k, v = make_qkv(batch=1, seq=64, heads=4, kv_heads=4, head_dim=8, seed=6)
    mesh = jax.make_mesh((2, 4), ("tp", "sp"))
    ours = functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy="auto",
                             causal=True)
    with jax.set_mesh(mesh):
        placed = [jax.reshard(x, P(None, None, "tp")) for x in (q, k, v)]
        checks.assert_matches(ours, functools.partial(reference.attention, causal=True),
                              placed, tolerances)


def test_missing_extra_names_it():
    from jax_seqpar.core.extras import require

    with pytest.raises(ImportError, match=r"pip install 'jax_seqpar\[flax\]'"):
        require("no_such_module_here", "flax", "a test")


# --- windows, sinks, soft-capping and the log-sum-exp through the global view --------------

SINKS = jnp.array([0.5, -1.0, 2.0, 0.0, 1.5, -3.0, 0.25, 4.0], jnp.float32)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_global_sinks_softcap_window_and_lse(strategy, make_qkv, tolerances):
    q, k, v = make_qkv(batch=1, seq=100, heads=8, kv_heads=2, head_dim=8, seed=12)
    mesh, axes = _mesh(strategy)
    mask = dict(causal=True, window=(20, 0), softcap=5.0)

    def ours(q, k, v, sinks):
        out, lse = sp.sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=axes, strategy=strategy, sinks=sinks,
            return_lse=True, **mask)
        return out + lse[..., None]  # one output that carries both

    def theirs(q, k, v, sinks):
        out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, **mask)
        return out + lse[..., None]

    checks.assert_matches(ours, theirs, (q, k, v, SINKS), tolerances, argnums=(0, 1, 2, 3))


def test_global_window_ring_sends_only_the_halo():
    """layout="auto" keeps a windowed causal ring contiguous: bytes do not grow with S/P
    hops, and equal comm_bytes(window=)."""
    mesh, _ = _mesh("ring")
    q = jnp.ones((1, 1024, 8, 16), jnp.float32)
    k = jnp.ones((1, 1024, 2, 16), jnp.float32)
    f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy="ring",
                          causal=True, window=(64, 0))
    sent = sum(hlo.collective_bytes(jax.jit(f).lower(q, k, k).compile()).values())
    model = functools.partial(comm_bytes, "ring", batch=1, seq_len=1024, num_heads=8,
                              num_kv_heads=2, head_dim=16, axis_sizes=8, dtype_bytes=4,
                              causal=True)
    assert sent == model(window=(64, 0)) < model() / 4
