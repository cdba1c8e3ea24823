"""The registry is open: a strategy written here, in the test file, is registered with
``registry.register`` and then checked by the exactness driver (per shard and through
the global entry point), counted by ``comm_bytes`` and weighed by the planner
(``plan_layer``, by bytes and by predicted time, and ``auto_choice``), with no module of
the package touched. The fixture unregisters it, so other tests see the package's own.
"""

import dataclasses
import math

import exactness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_seqpar import comm_bytes
from jax_seqpar.core import reference
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import plan as planner, predict
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.entry import Strategy

NAME = "replicate"


def replicate_attention(q, k, v, *, seq_axes, causal=False):
    """K/V all-gathered along the sequence, the local queries attended to them (the
    contiguous split: shard r holds tokens ``r*L .. (r+1)*L - 1``)."""
    local = q.shape[1]
    k_all = jax.lax.all_gather(k, seq_axes, axis=1, tiled=True)  # [B, S, Hkv, D]
    v_all = jax.lax.all_gather(v, seq_axes, axis=1, tiled=True)  # [B, S, Hkv, Dv]
    start = jax.lax.axis_index(seq_axes) * local
    positions = jnp.broadcast_to(start + jnp.arange(local), q.shape[:2])  # [B, L]
    kv_positions = jnp.broadcast_to(jnp.arange(k_all.shape[1]), k_all.shape[:2])  # [B, S]
    return reference.attention(q, k_all, v_all, causal=causal, positions=positions,
                               kv_positions=kv_positions)


def replicate_bytes(sizes, *, batch, seq_len, num_heads, num_kv_heads, head_dim, v_head_dim,
                    dtype_bytes, backward, **_):
    """all_gather of K/V ((P-1)/P of the gathered buffer); backward: psum_scatter of dK/dV
    (as much again). Positions are computed, not sent."""
    devices = math.prod(sizes)
    gathered = batch * seq_len * num_kv_heads * (head_dim + v_head_dim) * dtype_bytes
    return (devices - 1) / devices * gathered * (2 if backward else 1)


def replicate_steps(size, shape):
    """K and V gathered (``size - 1`` steps each); backward: dK and dV scattered."""
    return (size - 1) * (4 if shape.backward else 2)


def replicate_memory(shape, ring, ulysses):
    """The gathered K/V, and with backward their gradients before the scatter."""
    kv = shape.batch * shape.seq_len * shape.num_kv_heads * (shape.head_dim + shape.v_head_dim)
    return kv * shape.dtype_bytes * (2 if shape.backward else 1)


ENTRY = Strategy(NAME, replicate_attention, replicate_bytes, zigzag_balances=False,
                 preference=3, exchanges=("all-gather", "reduce-scatter"),
                 exchange_steps=replicate_steps, gathers_kv=True, kv_memory=replicate_memory)

#: One K/V head for 32 query heads: Ulysses would move far more, the ring sends positions.
MQA = LayerShape(1, 8192, 32, 1, 128, causal=True)


@pytest.fixture
def registered():
    registry.register(ENTRY)
    try:
        yield ENTRY
    finally:
        registry.unregister(NAME)
    assert NAME not in registry.STRATEGIES


def test_registered_runs_and_matches_the_reference(registered, make_qkv):
    q, k, v = make_qkv(batch=1, seq=64, heads=4, kv_heads=2, head_dim=16)
    mesh = Mesh(np.array(jax.devices()[:8]), ("sp",))
    attention = registry.get(NAME).attention
    out = jax.shard_map(lambda q, k, v: attention(q, k, v, seq_axes="sp", causal=True),
                        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("entry, context", [
    ("per_shard", "auto"), ("per_shard", "auto-jit"), ("per_shard", "auto-set-mesh-jit"),
    ("global", "explicit-set-mesh"), ("global", "auto"), ("global", "jit-sharded")])
def test_the_exactness_driver_checks_it(entry, context, tolerances):
    """The driver every built-in strategy goes through (tests/exactness.py) takes the
    registered one by its name: per shard and through the global entry point (with its
    ``attend`` core), outputs and gradients against the reference, from the contexts
    users call from."""
    registry.register(dataclasses.replace(ENTRY, attend=replicate_attend))
    try:
        exactness.check(exactness.Case(NAME, entry=entry, shape=(2, 64, 4, 2, 16, 16),
                                       mask=dict(causal=True), layout=(
                                           "contiguous" if entry == "global" else None),
                                       context=context), tolerances)
    finally:
        registry.unregister(NAME)


def test_comm_bytes_counts_it(registered):
    assert registry.names()[-1] == NAME and registry.get(NAME) is ENTRY
    sent = comm_bytes(NAME, axis_sizes=8, **MQA.comm_kwargs())
    assert sent == replicate_bytes((8,), **MQA.comm_kwargs()) > 0
    assert comm_bytes(NAME, axis_sizes=1, **MQA.comm_kwargs()) == 0
    with pytest.raises(ValueError, match="not divisible"):  # comm_bytes' own checks
        comm_bytes(NAME, axis_sizes=3, **MQA.comm_kwargs())


def test_register_refuses_a_taken_name(registered):
    with pytest.raises(ValueError, match="registered already"):
        registry.register(ENTRY)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(dataclasses.replace(registry.get("ring"), preference=9))


def test_plan_by_bytes_considers_and_picks_it(registered):
    chosen = planner.plan_layer(MQA, {"sp": 8})
    assert NAME in chosen.candidates and "ring" in chosen.candidates
    assert chosen.candidates[NAME] < chosen.candidates["ring"]
    assert chosen.strategy == NAME and chosen.factorization == (8, 1)
    assert chosen.bytes_per_device == comm_bytes(NAME, axis_sizes=8, **MQA.comm_kwargs())
    assert chosen.reason.startswith(f"{NAME}: ") and "ulysses would move" in chosen.reason
    # Many K/V heads: Ulysses sends far less; the new strategy is weighed, not chosen.
    mha = MQA.replace(num_kv_heads=32)
    assert planner.plan_layer(mha, 8).strategy == "ulysses"
    assert NAME in planner.plan_layer(mha, 8).candidates
    # On two axes a strategy that splits no heads runs over both flattened.
    assert NAME in planner.plan_layer(MQA, {"dcn": 2, "ici": 4}).candidates


def test_plan_predicted_considers_it(registered):
    labels = {c.label for c in predict.candidates(8, MQA.num_heads)}
    assert NAME in labels
    chosen = planner.plan_layer(MQA, 8, hardware="h100")
    assert NAME in chosen.predicted_seconds and NAME in chosen.memory_bytes
    result = predict.predict(predict.Candidate(NAME, 8, 1), MQA, "h100")
    assert result["bytes"] == comm_bytes(NAME, axis_sizes=8, **MQA.comm_kwargs())
    assert result["seconds"] >= result["compute_seconds"] > 0


def test_a_tiny_bytes_model_wins_the_predicted_choice():
    """Sending (almost) nothing, it is the fastest predicted (not causal: its contiguous
    split is balanced), and ``auto_choice`` on the emulated CPU mesh (the ``"cpu"``
    preset) takes it."""
    tiny = dataclasses.replace(ENTRY, bytes=lambda sizes, **_: 1.0,
                               exchange_steps=lambda size, shape: 0)
    shape = MQA.replace(causal=False)
    registry.register(tiny)
    try:
        assert planner.plan_layer(shape, 8, hardware="h100").strategy == NAME
        mesh = Mesh(np.array(jax.devices()[:8]), ("sp",))
        assert planner.auto_choice(shape, mesh, ("sp",)) == (NAME, None)
    finally:
        registry.unregister(NAME)
    assert NAME not in registry.names()


def replicate_attend(q, k, v, options, metadata, *, seq_axes):
    """The core the global view runs: the call's descriptions (``options``: the mask and
    scale; ``metadata``: positions, which this strategy leaves to the contiguous split)."""
    assert metadata.positions is None and metadata.segment_ids is None
    out = replicate_attention(q, k, v, seq_axes=seq_axes, causal=options.spec.causal)
    return (out, None) if options.return_lse else out


def test_the_global_call_runs_and_auto_plans_it(make_qkv):
    """Registered with an ``attend`` core, the strategy runs through
    ``sequence_parallel_attention`` (named, and as ``strategy="auto"``'s pick), exact in
    outputs and gradients; without one, the global call refuses it by name."""
    import jax_seqpar

    q, k, v = make_qkv(batch=1, seq=64, heads=4, kv_heads=1, head_dim=16)
    mesh = Mesh(np.array(jax.devices()[:8]), ("sp",))
    tiny = dataclasses.replace(ENTRY, attend=replicate_attend, bytes=lambda sizes, **_: 1.0,
                               exchange_steps=lambda size, shape: 0)
    registry.register(tiny)
    try:
        for strategy in (NAME, "auto"):
            def loss(q, k, v):
                out = jax_seqpar.sequence_parallel_attention(
                    q, k, v, mesh=mesh, strategy=strategy, layout="contiguous")
                return jnp.sum(out ** 2), out

            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            want, want_grads = jax.grad(
                lambda q, k, v: (lambda o: (jnp.sum(o ** 2), o))(reference.attention(q, k, v)),
                argnums=(0, 1, 2), has_aux=True)(q, k, v)[::-1]
            np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
            for got, expected in zip(grads, want_grads):
                np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)
        shape = LayerShape(1, 64, 4, 1, 16)
        assert planner.auto_choice(shape, mesh, ("sp",)) == (NAME, None)
    finally:
        registry.unregister(NAME)
    registry.register(ENTRY)  # no attend core: per shard only
    try:
        with pytest.raises(ValueError, match="has no attend core"):
            jax_seqpar.sequence_parallel_attention(q, k, v, mesh=mesh, strategy=NAME)
    finally:
        registry.unregister(NAME)
