"""Documents stay home (issue 41, item 3): ``max_document_shards=D`` bounds the reach of
the segment ids to ``D - 1`` shards either side in any token order. Exactness against the
reference (outputs and gradients) for every strategy at D = 1 and 2, the home layout's
span and balance, the refusal of ids that break the bound (eager and under ``jit``),
and the compiled bytes equal ``comm_bytes`` and the reach's hops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_seqpar as sp
from jax_seqpar import comm_bytes
from jax_seqpar.core import home_packing, masks, packing, reference
from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.core.reach import mask_reach
from jax_seqpar.tools import hlo, mixes

import checks
import exactness


def test_the_documents_bound_the_reach_in_any_order():
    spec = MaskSpec.make(causal=True, max_document_shards=2)
    assert mask_reach(spec, 1024, 8, contiguous=False) == (1024, 1024)
    assert mask_reach(MaskSpec.make(causal=True, max_document_shards=1), 1024, 8,
                      contiguous=False) == (0, 0)
    assert mask_reach(MaskSpec.make(causal=True, max_document_shards=5), 1024, 8,
                      contiguous=False) is None  # reaches (nearly) every shard
    assert mask_reach(MaskSpec.make(causal=True), 1024, 8, contiguous=False) is None
    # the tighter bound wins, side by side, on the contiguous split
    both = MaskSpec.make(causal=True, window=(100, 0), max_document_shards=2)
    assert mask_reach(both, 1024, 8) == (100, 0)
    assert mask_reach(both, 1024, 8, contiguous=False) == (1024, 1024)
    with pytest.raises(ValueError, match="max_document_shards must be a positive int"):
        MaskSpec.make(max_document_shards=0)


def test_document_shards_counts_the_widest_span():
    ids = np.repeat(np.arange(3), [5, 6, 5])
    assert packing.document_shards(ids, 4) == 2
    assert packing.document_shards(jnp.asarray(ids)[None], 4) == 2
    assert packing.document_shards(np.full(8, masks.PAD_SEGMENT), 4) == 0
    assert packing.document_shards(np.array([0, 1, 1, 1, 1, 1, 1, 0]), 4) == 4


@pytest.mark.parametrize("bound", [1, 2])
@pytest.mark.parametrize("entry", ["global", "per_shard"])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses", "hybrid"])
def test_bounded_documents_match_reference(strategy, entry, bound, tolerances):
    exactness.check(exactness.Case(strategy, entry=entry, mask=dict(causal=True),
                                   max_document_shards=bound), tolerances)


def _ring_call(ids, positions, bound):
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q = checks.normal((1, 64, 2, 8))
    def f(q, k, v, ids, positions):
        return sp.ring_attention(q, k, v, seq_axes="sp", causal=True, segment_ids=ids,
                                 positions=positions, max_document_shards=bound)
    seq = P(None, "sp")
    return jax.shard_map(f, mesh=mesh, in_specs=(seq,) * 5, out_specs=seq), (
        q, q, q, ids, positions)


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_ids_that_break_the_bound_are_refused(how):
    ids, positions = exactness.home_documents(1, 64, 8, 2)  # documents on 2 shards
    mapped, args = _ring_call(ids, positions, 1)
    call = mapped if how == "eager" else jax.jit(mapped)
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                       match=r"max_document_shards=1, but in row 0 document \d+ spans 2"):
        jax.block_until_ready(call(*args))
    with pytest.raises(ValueError, match="needs|pass their segment_ids"):
        sp.ring_attention(*args[:3], seq_axes="sp", max_document_shards=1)


def test_the_global_call_keeps_the_order_the_bound_is_about():
    q = checks.normal((1, 64, 2, 8))
    mesh = jax.make_mesh((8,), ("sp",))
    ids = jnp.zeros((1, 64), jnp.int32)
    with pytest.raises(ValueError, match="layout='zigzag' would move them"):
        sp.sequence_parallel_attention(q, q, q, mesh=mesh, causal=True, segment_ids=ids,
                                       layout="zigzag", max_document_shards=2)


def test_the_global_call_refuses_a_broken_bound_in_the_call_eager_and_under_jit():
    """Eager: a ValueError from the call itself, before anything runs. Under ``jit``: the
    program fails, and reading its output raises with the same numbers."""
    ids, positions = exactness.home_documents(1, 64, 8, 2)  # documents on 2 shards
    q = checks.normal((1, 64, 2, 8))
    mesh = jax.make_mesh((8,), ("sp",))
    call = functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy="ring",
                             causal=True, max_document_shards=1)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"max_document_shards=1, but in row 0 document "
                                             r"\d+ spans 2 consecutive shards of 8"):
            call(q, q, q, segment_ids=ids, positions=positions)
        jitted = jax.jit(lambda q, ids, positions: call(q, q, q, segment_ids=ids,
                                                        positions=positions))
        with pytest.raises((ValueError, jax.errors.JaxRuntimeError),
                           match=r"max_document_shards=1, but in row 0 document \d+ spans 2"):
            jax.block_until_ready(jitted(q, ids, positions))
        # within the bound: no error, eager or jitted
        jax.block_until_ready(call(q, q, q, segment_ids=ids, positions=positions,
                                   max_document_shards=2))


_SEQ, _HEADS, _DIM = 1024, 8, 16


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("bound", [pytest.param(1, marks=pytest.mark.matrix), 2,
                                   pytest.param(3, marks=pytest.mark.matrix)])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses", "hybrid"])
def test_compiled_bytes_are_the_documents_reach(strategy, bound, backward):
    mesh, axes = checks.strategy_mesh(strategy)
    ids, positions = exactness.home_documents(1, _SEQ, 8, bound)
    q = jnp.ones((1, _SEQ, _HEADS, _DIM), jnp.float32)
    f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=axes,
                          strategy=strategy, causal=True, max_document_shards=bound)

    def both(q, k, v, ids, positions):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, segment_ids=ids, positions=positions),
                           q, k, v)
        return (out, vjp(out)) if backward else out

    compiled = jax.jit(both).lower(q, q, q, ids, positions).compile()
    sent = sum(hlo.collective_bytes(compiled).values())
    sizes = (2, 4) if strategy == "hybrid" else 8
    expected = comm_bytes(strategy, batch=1, seq_len=_SEQ, num_heads=_HEADS,
                          num_kv_heads=_HEADS, head_dim=_DIM, axis_sizes=sizes, dtype_bytes=4,
                          backward=backward, with_segment_ids=True, max_document_shards=bound)
    if strategy == "hybrid" and bound == 3 and backward:
        # D=3 reaches every group of a ring of 2: the full ring, whose backward's single
        # K/V hop XLA merges with the forward's (comm_bytes' documented exception)
        assert sent < expected
        return
    assert sent == expected
    check = _SEQ * 4 * 7 / 8  # the bound's check: every shard's ids, gathered
    if strategy in ("ring", "allgather"):
        hops = 2 * (bound - 1) * _SEQ // 8  # tokens of the reach
        halo = hops * (_HEADS * 2 * _DIM * 4 + 2 * 4)  # K/V, ids and positions, float32
        assert sent == check + halo + (hops * _HEADS * 2 * _DIM * 4 if backward else 0)
    if bound == 1:
        assert sent == check  # local attention: nothing but the check


def test_a_bound_that_bounds_nothing_is_neither_checked_nor_counted():
    """On 8 shards ``D = 5`` reaches 4 shards either side: every shard. The ring is then
    the full ring, with no gather of the ids, and ids that span more are not refused
    (no key can be missed); ``D = 4`` still bounds it (6 of 7 hops)."""
    shape = dict(batch=1, seq_len=_SEQ, num_heads=_HEADS, num_kv_heads=_HEADS, head_dim=_DIM,
                 axis_sizes=8, with_segment_ids=True, causal=True, backward=True)
    assert comm_bytes("ring", max_document_shards=5, **shape) == comm_bytes("ring", **shape)
    assert comm_bytes("ring", max_document_shards=4, **shape) < comm_bytes("ring", **shape)
    mesh = jax.make_mesh((8,), ("sp",))
    ids = jnp.asarray(np.arange(_SEQ, dtype=np.int32)[None] % 3)  # every document everywhere
    q = checks.normal((1, _SEQ, 2, 8))
    gathered = {}
    for bound in (None, 4, 5):
        call = jax.jit(functools.partial(sp.sequence_parallel_attention, mesh=mesh,
                                         causal=True, strategy="ring", layout="contiguous",
                                         max_document_shards=bound))
        with jax.set_mesh(mesh):
            compiled = call.lower(q, q, q, segment_ids=ids).compile()
        gathered[bound] = hlo.collective_bytes(compiled)["all-gather"]  # with the output's
    assert gathered[5] == gathered[None] == gathered[4] - _SEQ * 4 * 7 / 8, gathered
    with jax.set_mesh(mesh):
        out = call(q, q, q, segment_ids=ids)  # D = 5: not refused
    want = reference.attention(q, q, q, causal=True, segment_ids=ids)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    ids = np.asarray(ids)
    assert sp.permute_batch({"ids": ids}, "per_document", 8, segment_ids=ids,
                            max_document_shards="auto")  # "auto" tries D <= 4 only


def _heavy(seed, seq, longest=2048):
    rng = np.random.default_rng(seed)
    return mixes.draw(lambda r, n: np.minimum(np.ceil(64 * (1 + r.pareto(1.3, n))), longest),
                      1, seq, rng)


def _home_layout_keeps(ids, bound):
    batch, positions = sp.permute_batch({"ids": ids}, "per_document", 8, segment_ids=ids,
                                        max_document_shards=bound)
    span = packing.document_shards(batch["ids"], 8)
    laid = masks.Tokens(positions, batch["ids"])
    pairs, tiles = home_packing.balance(MaskSpec(causal=True), laid, 8, 128)
    assert span <= bound and pairs <= home_packing.PAIRS_BOUND, (span, pairs)
    assert tiles <= home_packing.TILES_BOUND, tiles
    assert sorted(positions[0].tolist()) == list(range(ids.shape[1]))
    back = sp.unpermute_batch(batch, "per_document", 8, positions=positions)
    np.testing.assert_array_equal(back["ids"], ids)


def test_home_layout_keeps_documents_home_and_the_balance():
    _home_layout_keeps(_heavy(0, 32768, longest=1024), 2)


@pytest.mark.matrix
@pytest.mark.parametrize("seed", range(5))
def test_home_layout_at_scale(seed):
    """S=131072, 8 shards, lengths 64..8192: D=3 keeps the balance on every seed."""
    _home_layout_keeps(_heavy(seed, 131072, longest=8192), 3)


def test_an_impossible_bound_names_its_lower_bound():
    ids = _heavy(1, 131072, longest=8192)  # one document of 2.5x a shard's mean pairs
    natural = masks.Tokens(np.arange(ids.shape[1])[None], ids)
    floors = home_packing.lower_bounds(MaskSpec(causal=True), natural, 8)
    assert floors[1] > home_packing.PAIRS_BOUND >= floors[2]


def test_a_bound_that_misses_the_balance_is_refused_with_the_numbers():
    ids = _heavy(0, 16384)
    with pytest.raises(ValueError, match=r"max_document_shards=1 cannot keep the per-document "
                                         r"balance .* reaches busiest/mean visible pairs"):
        sp.permute_batch({"ids": ids}, "per_document", 8, segment_ids=ids,
                         max_document_shards=1)
    with pytest.raises(ValueError, match="numpy"):
        sp.permute_batch({"ids": ids}, "per_document", 8, segment_ids=jnp.asarray(ids),
                         max_document_shards=2)
