"""The per-document layout (core.packing, permute_batch) and the work counts (core.work):
the balance bound on random and adversarial document mixes (many seeds), the inverse,
the traced layout, and the counts against brute force."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from document_mixes import ADVERSARIAL, with_padding
import jax_seqpar as sp
from jax_seqpar.core import packing, work
from jax_seqpar.core.masks import PAD_SEGMENT, MaskSpec, Tokens
from jax_seqpar.tools import mixes

CAUSAL = MaskSpec(causal=True)

#: A shard with at least this many real tokens (on average) is within 1.05 of the mean;
#: below, a few tokens' work is more than 5% of a shard's (no order of whole tokens helps),
#: and the a-priori bound is what holds.
REAL_TOKENS_FOR_1_05 = 64


def _check_order(ids, positions, num_shards):
    """A permutation per row; each shard in (document, position) order, padding last."""
    rows, seq_len = ids.shape
    local = seq_len // num_shards
    assert positions.dtype == np.int32 and positions.shape == ids.shape
    for b in range(rows):
        np.testing.assert_array_equal(np.sort(positions[b]), np.arange(seq_len))
        laid = ids[b][positions[b]]
        for r in range(num_shards):
            seg, pos = laid[r * local:(r + 1) * local], positions[b][r * local:(r + 1) * local]
            pad = seg == PAD_SEGMENT
            assert not (pad[:-1] & ~pad[1:]).any(), "padding is last in its shard"
            key = seg[~pad].astype(np.int64) * seq_len + pos[~pad]
            assert (np.diff(key) > 0).all(), "a shard's tokens are in (document, position) order"


def _ratios(ids, positions, num_shards):
    """Per row: busiest/mean work, and the real tokens per shard."""
    per_row = work.work_per_shard(CAUSAL, Tokens(positions, np.take_along_axis(ids, positions, 1)),
                                  num_shards, per_row=True)
    mean = per_row.mean(1)
    ratio = np.where(mean > 0, per_row.max(1) / np.maximum(mean, 1e-9), 1.0)
    return ratio, (ids != PAD_SEGMENT).sum(1) / num_shards


def _check_balance(ids, num_shards, block):
    positions = packing.per_document_positions(ids, num_shards, block)
    _check_order(ids, positions, num_shards)
    ratio, real = _ratios(ids, positions, num_shards)
    bound = packing.balance_bound(ids, num_shards, block)
    assert (ratio <= bound + 1e-9).all(), (ratio, bound)
    assert (ratio[real >= REAL_TOKENS_FOR_1_05] <= 1.05).all(), (ratio, real)
    return ratio


@pytest.mark.parametrize("seq,num_shards,block", [(4096, 8, 128), (2048, 4, 64),
                                                  (1536, 3, 32), (4096, 16, 16)])
def test_balance_on_adversarial_mixes(seq, num_shards, block):
    for name, mix in ADVERSARIAL.items():
        for seed in range(4):
            _check_balance(mix(2, seq, np.random.default_rng(seed)), num_shards, block)


def test_balance_on_random_mixes():
    """Property test: random lengths of every kind, sizes, shard counts, tiles, padding."""
    rng = np.random.default_rng(1234)
    for case in range(240):
        num_shards = int(rng.choice([2, 3, 4, 5, 8, 16]))
        seq = num_shards * int(rng.integers(2, 4096 // num_shards + 1))
        block = int(rng.choice([8, 16, 64, 128, 256]))
        scale = int(rng.integers(2, seq + 1))
        samplers = [
            lambda r, n: r.integers(1, scale, n),
            lambda r, n: np.ceil(r.lognormal(np.log(scale), 2.0, n)),
            lambda r, n: np.ceil(8 * (1 + r.pareto(rng.uniform(0.6, 2.0), n))),
            lambda r, n: r.choice([1, 2, 3, 2 * num_shards - 1, 2 * num_shards + 1,
                                   seq // 3 + 1], n),
        ]
        ids = mixes.draw(samplers[case % 4], 2, seq, rng)
        if rng.random() < 0.3:
            ids[:, seq - int(rng.integers(1, seq)):] = PAD_SEGMENT
        _check_balance(ids, num_shards, block)


def test_heavy_tailed_mix_at_the_issue_size():
    """B=2, S=16384, P=8, the heavy-tailed mix: zigzag's busiest device does far more than
    the mean; the per-document order is within 1.05 on every seed."""
    zigzag = np.broadcast_to(np.asarray(sp.zigzag_positions(16384, 8)), (2, 16384))
    before, after = [], []
    for seed in range(8):
        ids = mixes.heavy_tailed(2, 16384, np.random.default_rng(seed))
        counts = work.work_per_shard(CAUSAL, Tokens(zigzag, np.take_along_axis(ids, zigzag, 1)), 8)
        before.append(counts.max() / counts.mean())
        after.append(_check_balance(ids, 8, 128).max())
    assert np.median(before) > 1.5 and max(after) <= 1.05, (before, after)


def test_permute_and_unpermute_batch():
    rng = np.random.default_rng(0)
    ids = with_padding(mixes.heavy_tailed, 3, 512, rng)
    batch = {"ids": ids, "x": rng.normal(size=(3, 512, 2)), "j": jnp.asarray(ids)}
    laid, positions = sp.permute_batch(batch, "per_document", 8, segment_ids=ids, block_size=16)
    assert isinstance(positions, np.ndarray) and isinstance(laid["x"], np.ndarray)
    np.testing.assert_array_equal(positions, packing.per_document_positions(ids, 8, 16))
    np.testing.assert_array_equal(laid["ids"], np.take_along_axis(ids, positions, 1))
    np.testing.assert_array_equal(laid["x"][1, :, 0], batch["x"][1, positions[1], 0])
    np.testing.assert_array_equal(laid["j"], laid["ids"])
    back = sp.unpermute_batch(laid, "per_document", 8, positions=positions)
    for name in batch:
        np.testing.assert_array_equal(back[name], batch[name])
    # JAX ids give JAX positions, the same order; another sequence axis works too.
    jax_laid, jax_positions = sp.permute_batch(jnp.asarray(ids.T), "per_document", 8, axis=0,
                                               segment_ids=jnp.asarray(ids[0]), block_size=16)
    assert isinstance(jax_positions, jax.Array) and jax_positions.shape == (512,)
    np.testing.assert_array_equal(
        sp.unpermute_batch(jax_laid, "per_document", 8, axis=0, positions=jax_positions), ids.T)


def test_permute_batch_errors():
    ids = np.zeros((2, 64), np.int32)
    with pytest.raises(ValueError, match="pass segment_ids="):
        sp.permute_batch(ids, "per_document", 8)
    with pytest.raises(ValueError, match="pass the positions="):
        sp.unpermute_batch(ids, "per_document", 8)
    with pytest.raises(ValueError, match="per_document layout only"):
        sp.permute_batch(ids, "zigzag", 8, segment_ids=ids)
    with pytest.raises(ValueError, match="leading dims"):
        sp.permute_batch(ids, "per_document", 8, segment_ids=ids[:, :32])
    with pytest.raises(ValueError, match="divisible by num_shards.*pad the rows to 66"):
        sp.permute_batch(ids[:, :62], "per_document", 6, segment_ids=ids[:, :62])


def test_traced_layout_is_a_balanced_order():
    """Under jit (float32 merge keys): a valid order within the bound, mostly the numpy one."""
    layout = jax.jit(lambda ids: packing.per_document_positions(ids, 8, 16))
    same = 0
    for seed, mix in enumerate(["pareto_1.3", "padded_short", "two_big", "primes"]):
        ids = ADVERSARIAL[mix](2, 1024, np.random.default_rng(seed))
        positions = np.asarray(layout(jnp.asarray(ids)))
        _check_order(ids, positions, 8)
        ratio, _ = _ratios(ids, positions, 8)
        assert (ratio <= packing.balance_bound(ids, 8, 16) + 1e-9).all()
        same += np.array_equal(positions, packing.per_document_positions(ids, 8, 16))
    assert same >= 3


def _brute_visible(positions, ids, causal, window):
    q, k = positions[:, :, None], positions[:, None, :]
    seen = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != PAD_SEGMENT)
    if causal:
        seen &= k <= q
    if window is not None:
        seen &= (k >= q - window[0]) & (k <= q + window[1])
    return seen


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (5, 0)),
                                           (False, (7, 3))])
def test_work_counts_against_brute_force(causal, window):
    rng = np.random.default_rng(3)
    seq, shards = 192, 4
    local = seq // shards
    for mix in ("padded_pareto", "shorter_than_2P", "primes"):
        ids = ADVERSARIAL[mix](2, seq, rng)
        positions = np.stack([rng.permutation(seq) for _ in range(2)]).astype(np.int32)
        laid = np.take_along_axis(ids, positions, 1)
        seen = _brute_visible(positions, laid, causal, window)
        spec, tokens = MaskSpec.make(causal, window), Tokens(positions, laid)
        np.testing.assert_array_equal(work.token_work(spec, tokens), seen.sum(2))
        per_row = seen.sum(2).reshape(2, shards, local).sum(2)
        np.testing.assert_array_equal(
            work.work_per_shard(spec, tokens, shards, per_row=True), per_row)
        steps = work.work_per_step(spec, tokens, shards)
        for r in range(shards):
            for step in range(shards):
                j = (r - step) % shards
                assert steps[r, step] == seen[:, r * local:(r + 1) * local,
                                              j * local:(j + 1) * local].sum()
    assert work.ring_makespans(np.ones((4, 4)))["lockstep"] == 1.0
