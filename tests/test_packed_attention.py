"""Attention on packed documents in the per-document order: exact through every strategy
(windows, sinks, gradients), and layout="per_document" in the global entry point."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import checks
from document_mixes import with_padding
import jax_seqpar as sp
from jax_seqpar.core import reference
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.tools import mixes

STRATEGIES = list(checks.STRATEGIES)
_mesh = checks.strategy_mesh


def _documents(batch, seq, seed=0):
    """Packed heavy-tailed documents with a padded tail: a long document is dealt to every
    shard, short ones are kept whole, padding goes last."""
    ids = with_padding(lambda b, s, r: mixes.heavy_tailed(b, s, r, scale=8), batch, seq,
                       np.random.default_rng(seed), max_fraction=0.2)
    ids[0, :120] = -7  # one long document (any id but the padding one is a document)
    return ids


def _check(ours, theirs, args, tolerances):
    out = jax.jit(ours)(*args)
    expected = theirs(*args)
    np.testing.assert_allclose(out, expected, **tolerances(out.dtype))
    weights = jax.random.normal(jax.random.key(7), out.shape)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * weights)  # noqa: E731
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(*args)
    for got, want in zip(grads, jax.grad(loss(theirs), argnums=(0, 1, 2, 3))(*args)):
        scale = max(1.0, float(jnp.abs(want).max()))
        np.testing.assert_allclose(got / scale, want / scale, **tolerances(got.dtype, "grad"))


@pytest.mark.parametrize("strategy,window", checks.tiered(  # default: the ring, a window
    [("ring", None)] + [(s, (24, 0)) for s in STRATEGIES], lambda i: i in (0, 3)))
def test_per_document_positions_are_exact(strategy, window, make_qkv, tolerances):
    """The batch laid out once (permute_batch), attended with its positions, and back."""
    q, k, v = make_qkv(batch=2, seq=256, heads=8, kv_heads=2, head_dim=8, seed=5)
    ids = _documents(2, 256)
    (q, k, v, laid_ids), positions = sp.permute_batch((q, k, v, ids), "per_document", 8,
                                                      segment_ids=ids, block_size=8)
    sinks = jnp.linspace(-1.0, 1.0, 8) if window else None
    mesh, axes = _mesh(strategy)

    def ours(q, k, v, sinks):
        out = sp.sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=axes, strategy=strategy, causal=True, window=window,
            segment_ids=laid_ids, positions=positions, sinks=sinks)
        return sp.unpermute_batch(out, "per_document", 8, positions=positions)

    def theirs(q, k, v, sinks):
        q, k, v = sp.unpermute_batch((q, k, v), "per_document", 8, positions=positions)
        return reference.attention(q, k, v, causal=True, window=window, sinks=sinks,
                                   segment_ids=jnp.asarray(ids))

    _check(ours, theirs, (q, k, v, sinks if sinks is not None else jnp.zeros(8)), tolerances)


@pytest.mark.parametrize("strategy", checks.tiered(["ring", "hybrid"], lambda i: i == 1))
def test_layout_per_document_in_the_entry_point(strategy, make_qkv, tolerances):
    """Natural-order inputs of a length the devices do not divide: padded, put in the
    per-document order of the segment ids inside the call, and back."""
    q, k, v = make_qkv(batch=2, seq=250, heads=8, kv_heads=2, head_dim=8, seed=6)
    ids = jnp.asarray(_documents(2, 250, seed=1))
    mesh, axes = _mesh(strategy)

    def ours(q, k, v, sinks):
        return sp.sequence_parallel_attention(
            q, k, v, mesh=mesh, seq_axes=axes, strategy=strategy, causal=True, sinks=sinks,
            segment_ids=ids, layout="per_document", kernel="xla",
            block_sizes=sp.kernels.BlockSizes(16, 16))

    def theirs(q, k, v, sinks):
        return reference.attention(q, k, v, causal=True, segment_ids=ids, sinks=sinks)

    _check(ours, theirs, (q, k, v, jnp.linspace(-1.0, 0.5, 8)), tolerances)


def test_layout_per_document_needs_segment_ids(make_qkv):
    q, k, v = make_qkv(batch=1, seq=64, heads=8, head_dim=8)
    mesh, _ = _mesh("ring")
    with pytest.raises(ValueError, match="pass segment_ids="):
        sp.sequence_parallel_attention(q, k, v, mesh=mesh, causal=True, layout="per_document")


@pytest.mark.parametrize("layout", ["per_document", "contiguous"])
def test_kernels_compute_only_tiles_and_steps_that_share_a_document(layout, make_qkv,
                                                                     monkeypatch):
    """The XLA kernel's computed tiles and kernel calls in a ring, counted as they run,
    equal what work.computed_tiles_per_shard predicts: tiles whose queries and keys share
    no document (per batch row) are skipped, and so are whole ring steps (short documents
    in natural order: a shard shares documents with its neighbours only)."""
    from jax_seqpar.core import work

    batch, seq, shards, block = 2, 256, 8, 8
    ids = np.stack([np.arange(seq) // 16, np.arange(seq) // 24 + 100])  # short documents
    q, k, v = make_qkv(batch=batch, seq=seq, heads=4, kv_heads=2, head_dim=8, seed=2)
    if layout == "per_document":
        ids[0, 40:200] = 7  # one long document: dealt to every shard
        (q, k, v, ids), positions = sp.permute_batch((q, k, v, ids), layout, shards,
                                                     segment_ids=ids, block_size=block)
    else:
        positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    mesh, axes = _mesh("ring")
    events = []
    jax.clear_caches()  # a program traced before reports nothing
    checks.record_xla_tiles(monkeypatch, lambda *event: events.append(event[0]))
    out = jax.jit(lambda q, k, v: sp.sequence_parallel_attention(
        q, k, v, mesh=mesh, seq_axes=axes, strategy="ring", causal=True,
        segment_ids=ids, positions=positions, kernel="xla",
        block_sizes=sp.kernels.BlockSizes(block, block)))(q, k, v)
    jax.block_until_ready(out)
    jax.effects_barrier()
    per_step = work.computed_tiles_per_shard(
        MaskSpec(causal=True), Tokens(np.asarray(positions), np.asarray(ids)), shards,
        block_q=block, per_step=True)
    every_tile = batch * shards * shards * (seq // shards // block) ** 2
    assert events.count("tile") == per_step.sum() < every_tile // 3
    assert events.count("call") == (per_step > 0).sum()
    if layout == "contiguous":
        assert (per_step > 0).sum() <= 2 * shards  # its own shard and its left neighbour's


@pytest.mark.interpret
@pytest.mark.parametrize("kernel,shards,block", [("pallas", 8, 16), ("mosaic", 2, 128)])
def test_pallas_kernels_on_per_document_positions(kernel, shards, block, make_qkv,
                                                  tolerances):
    """The Triton and Mosaic kernels (interpreted on CPU) in the ring on per-document
    positions, with a window and sinks: their per-row tile plans skip only what no
    document shares (out and grads against the reference)."""
    seq = 256 if kernel == "pallas" else 512
    q, k, v = make_qkv(batch=2, seq=seq, heads=2, kv_heads=1, head_dim=8, seed=4)
    ids = _documents(2, seq, seed=2)
    (q, k, v, laid_ids), positions = sp.permute_batch((q, k, v, ids), "per_document", shards,
                                                      segment_ids=ids, block_size=block)
    mesh = Mesh(np.array(jax.devices()[:shards]), ("sp",))
    window = (3 * block // 2, 0)

    def ours(q, k, v, sinks):
        out = sp.sequence_parallel_attention(
            q, k, v, mesh=mesh, strategy="ring", causal=True, window=window,
            segment_ids=laid_ids, positions=positions, sinks=sinks, kernel=kernel,
            block_sizes=sp.kernels.BlockSizes(block, block, block, block))
        return sp.unpermute_batch(out, "per_document", shards, positions=positions)

    def theirs(q, k, v, sinks):
        q, k, v = sp.unpermute_batch((q, k, v), "per_document", shards, positions=positions)
        return reference.attention(q, k, v, causal=True, window=window, sinks=sinks,
                                   segment_ids=jnp.asarray(ids))

    _check(ours, theirs, (q, k, v, jnp.linspace(-1.0, 1.0, 2)), tolerances)
