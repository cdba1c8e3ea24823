"""A short training run gives the same losses sharded and unsharded."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_seqpar.examples import (ModelConfig, Parallelism, TrainConfig, init_params, mesh_for,
                                 pack_documents, train, training_batches)

MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=8, num_kv_heads=2, mlp_hidden=64)
TRAIN = TrainConfig(steps=12, batch=2, seq_len=256, warmup_steps=3, peak_learning_rate=1e-2)


@pytest.fixture(scope="module")
def data():
    return training_batches(steps=TRAIN.steps, batch=TRAIN.batch, seq_len=TRAIN.seq_len,
                            seed=TRAIN.seed)


@pytest.fixture(scope="module")
def unsharded(data):
    return train(MODEL, TRAIN, params=init_params(MODEL, TRAIN.seed), data=data)


def test_packing_marks_document_boundaries():
    rows = pack_documents([b"abc", b"de", b"fghij"], seq_len=3)
    np.testing.assert_array_equal(rows.tokens, [list(b"abc"), list(b"def"), list(b"ghi")])
    np.testing.assert_array_equal(rows.targets, [list(b"bcd"), list(b"efg"), list(b"hij")])
    np.testing.assert_array_equal(rows.segment_ids, [[0, 0, 0], [1, 1, 2], [2, 2, 2]])
    np.testing.assert_array_equal(rows.weights, [[1, 1, 0], [1, 0, 1], [1, 1, 1]])


def test_data_is_deterministic(data):
    assert data.tokens.shape == (TRAIN.steps, TRAIN.batch, TRAIN.seq_len)
    assert data.tokens.dtype == np.int32 and data.tokens.max() < MODEL.vocab_size
    again = training_batches(steps=TRAIN.steps, batch=TRAIN.batch, seq_len=TRAIN.seq_len,
                             seed=TRAIN.seed)
    np.testing.assert_array_equal(again.tokens, data.tokens)


def test_unsharded_loss_falls(unsharded):
    losses = unsharded.losses
    assert losses.shape == (TRAIN.steps,) and np.isfinite(losses).all()
    assert losses[-3:].mean() < losses[:3].mean() - 0.5


@pytest.mark.parametrize("strategy,fsdp", [("ulysses", False), ("ring", True)],
                         ids=["ulysses", "ring-fsdp"])
def test_sharded_training_matches_unsharded(strategy, fsdp, data, unsharded):
    """Each batch laid out once (zigzag for the ring); with FSDP the parameters and
    optimizer state are split over the 8 devices too, at the same losses."""
    mesh, seq_axes = mesh_for(strategy)
    assert mesh.size == jax.device_count() == 8
    result = train(MODEL, TRAIN, Parallelism(mesh, seq_axes, strategy, fsdp=fsdp),
                   params=init_params(MODEL, TRAIN.seed), data=data)
    np.testing.assert_allclose(result.losses, unsharded.losses, rtol=1e-4)
    if fsdp:  # every matrix splits 8 ways; norms and biases stay whole
        assert result.state_bytes < unsharded.state_bytes / 4, (result.state_bytes,
                                                                unsharded.state_bytes)
    else:
        assert result.state_bytes == unsharded.state_bytes


def test_fsdp_sharding_splits_the_largest_divisible_dim():
    from jax_seqpar.examples._train import fsdp_sharding

    mesh, _ = mesh_for("ring")
    assert fsdp_sharding(mesh, np.zeros((256, 24))).spec == P("sp", None)
    assert fsdp_sharding(mesh, np.zeros((12, 64))).spec == P(None, "sp")
    assert fsdp_sharding(mesh, np.zeros((12,))).spec == P()
