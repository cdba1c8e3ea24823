"""Every strategy sends only what the mask lets a device see (issue 41): the reach of a
mask on the contiguous split (``strategies.halo.mask_reach``: windows, chunks, the
tighter of both, bidirectional ids), exactness against the reference (outputs and
gradients) where the reach bounds the exchange, compiled bytes equal ``comm_bytes``, no
collective at all where the reach is ``(0, 0)``, and ``strategy="auto"`` /
``layout="auto"`` sending least for chunks that fit a shard."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_seqpar as sp
from jax_seqpar import comm_bytes
from jax_seqpar.core import reference
from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import plan
from jax_seqpar.strategies import registry
from jax_seqpar.core.reach import is_local, mask_reach
from jax_seqpar.tools import hlo

import checks
import exactness

# --- the reach, on numbers ----------------------------------------------------------------

#: (mask, reach at L=1024 tokens a shard on 8 shards, with bidirectional ids).
REACHES = [
    (dict(causal=True, chunk_size=1024), (0, 0), (0, 0)),  # a chunk a shard
    (dict(causal=True, chunk_size=512), (0, 0), (0, 0)),  # two chunks a shard
    (dict(causal=True, chunk_size=2048), (1024, 0), (1024, 1024)),  # a chunk spans 2 shards
    (dict(chunk_size=2048), (1024, 1024), (1024, 1024)),  # non-causal: to the chunk's end
    (dict(chunk_size=3000), (2120, 2928), (2120, 2928)),  # uneven: max over the shards
    (dict(causal=True, chunk_size=3072), (2048, 0), (2048, 2048)),
    (dict(causal=True, window=(1024, 0)), (1024, 0), (1024, 0)),  # the window's halo
    (dict(causal=True, window=(1024, 0), chunk_size=512), (0, 0), (0, 0)),  # the tighter
    (dict(chunk_size=3000, window=(10, 10)), (10, 10), (10, 10)),
    (dict(causal=True), None, None),  # nothing bounds it
    (dict(causal=True, chunk_size=8192), None, None),  # one chunk: the whole sequence
    # non-causal chunks whose wrapped halo (zeros past the sequence ends) a query of
    # shard 0 would see: the full exchange, never a wrong answer
    (dict(chunk_size=5000), None, None),
]


@pytest.mark.parametrize("mask,reach,bidirectional", REACHES,
                         ids=[str(sorted(m.items())) for m, _, _ in REACHES])
def test_mask_reach(mask, reach, bidirectional):
    spec = MaskSpec.make(**mask)
    assert mask_reach(spec, 1024, 8) == reach
    if spec.causal:
        assert mask_reach(spec, 1024, 8, bidirectional=True) == bidirectional
    assert is_local(spec, 1024, 8) == (reach == (0, 0))


def test_the_reach_is_every_visible_key_a_shard_needs():
    """Brute force at S=96 on 8 shards: every (query, key) pair the mask keeps lies within
    its shard's reach, and the reach is attained (the tighter bound where both apply)."""
    from jax_seqpar.core import masks

    seq, shards = 96, 8
    local = seq // shards
    positions = np.arange(seq)[None]
    for causal in (False, True):
        for chunk in (4, 12, 16, 24, 36, 40, 50):
            for window in (None, (5, 3), (30, 0)):
                spec = MaskSpec.make(causal, window, chunk)
                tokens = masks.Tokens(positions)
                seen = np.asarray(masks.visible_tokens(spec, tokens, tokens))[0]
                q, k = np.nonzero(seen)
                start = q // local * local
                need = (int(np.max(start - k, initial=0)),
                        int(np.max(k - (start + local - 1), initial=0)))
                reach = mask_reach(spec, local, shards)
                if reach is not None:
                    assert need[0] <= reach[0] and need[1] <= reach[1], (causal, chunk, window)
                    if window is None:
                        assert need == reach, (causal, chunk)


# --- exactness: outputs and gradients against the reference ------------------------------

#: Masks whose reach on 8 shards of 8 tokens (S=64) is bounded.
MASKS = {
    "chunk_fits_a_shard": dict(causal=True, chunk_size=8),  # reach (0, 0)
    "two_chunks_a_shard": dict(causal=True, chunk_size=4),  # reach (0, 0)
    "chunk_two_shards": dict(causal=True, chunk_size=16),  # reach (8, 0)
    "chunk_and_window": dict(causal=True, chunk_size=16, window=(5, 0)),  # (5, 0)
    "non_causal_chunk": dict(chunk_size=16),  # (8, 8)
    "non_causal_uneven_chunk": dict(chunk_size=12),  # (8, 8)
}
_GLOBAL = ("ring", "allgather", "ulysses", "hybrid", "auto")
_DEFAULT_TIER = {"chunk_fits_a_shard", "chunk_two_shards", "non_causal_chunk"}


@pytest.mark.parametrize("strategy,mask", checks.tiered(
    [pytest.param(s, m, id=f"{s}-{m}") for m in MASKS for s in _GLOBAL],
    lambda i: list(MASKS)[i // len(_GLOBAL)] in _DEFAULT_TIER
    or _GLOBAL[i % len(_GLOBAL)] in ("ring", "auto")))
def test_bounded_reach_matches_reference(strategy, mask, tolerances):
    exactness.check(exactness.Case(strategy, shape=(1, 64, 8, 2, 16, 16), mask=MASKS[mask]),
                    tolerances)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses", "hybrid"])
@pytest.mark.parametrize("mask", ["chunk_fits_a_shard", "chunk_two_shards"])
def test_bounded_reach_per_shard_matches_reference(strategy, mask, tolerances):
    exactness.check(exactness.Case(strategy, entry="per_shard", shape=(1, 64, 8, 2, 16, 16),
                                   mask=MASKS[mask]), tolerances)


@pytest.mark.parametrize("strategy", ["ring", "auto"])
@pytest.mark.parametrize("mask", [dict(causal=True, chunk_size=8),
                                  dict(causal=True, chunk_size=16, segments=True)],
                         ids=["chunk_fits", "chunk_two_shards_documents"])
def test_bounded_reach_at_a_length_the_devices_do_not_divide(strategy, mask, make_qkv,
                                                             tolerances):
    seq = 60  # padded to 64 inside: 8 tokens a device
    q, k, v = make_qkv(batch=1, seq=seq, heads=8, kv_heads=2, head_dim=8, seed=seq)
    mask = dict(mask)
    if mask.pop("segments", False):
        mask["segment_ids"] = checks.segments(1, seq, seed=seq, documents=3)
    mesh, axes = checks.strategy_mesh(strategy)
    ours = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=axes,
                             strategy=strategy, **mask)
    checks.assert_matches(ours, functools.partial(reference.attention, **mask),
                          (q, k, v), tolerances)


def test_bidirectional_ids_widen_a_chunked_reach(tolerances):
    """A prefix-LM's bidirectional ids under causal chunks: the halo keeps the chunk's
    right side, and the ring and the all-gather stay exact."""
    for strategy in ("ring", "allgather"):
        exactness.check(exactness.Case(strategy, shape=(1, 64, 8, 2, 16, 16),
                                       family="prefix_lm", mask=dict(chunk_size=16)),
                        tolerances)


# --- bytes: the compiled program sends comm_bytes, nothing where the reach is (0, 0) ----

_SEQ, _HEADS, _KV_HEADS, _DIM = 1024, 8, 2, 16
#: Masks at S=1024 on 8 devices (128 tokens each).
BYTE_MASKS = {
    "chunk_fits": dict(causal=True, chunk_size=128),
    "chunk_half": dict(causal=True, chunk_size=64),
    "chunk_two_shards": dict(causal=True, chunk_size=256),
    "non_causal_chunk": dict(chunk_size=256),
    "chunk_and_window": dict(causal=True, chunk_size=256, window=(64, 0)),
}
_COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "all-reduce",
                "reduce-scatter")


def _compiled(strategy, mask, backward):
    mesh, axes = checks.strategy_mesh(strategy)
    q = jnp.ones((1, _SEQ, _HEADS, _DIM), jnp.float32)
    k = jnp.ones((1, _SEQ, _KV_HEADS, _DIM), jnp.float32)
    f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=axes,
                          strategy=strategy, **mask)
    if not backward:
        return jax.jit(f).lower(q, k, k).compile()

    def both(q, k, v, dout):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(dout)

    return jax.jit(both).lower(q, k, k, jnp.ones_like(q)).compile()


def _model(strategy, mask, backward):
    sizes = (2, 4) if strategy == "hybrid" else 8
    if strategy == "auto":  # what the call chooses on the 8 devices' one axis
        shape = LayerShape(1, _SEQ, _HEADS, _KV_HEADS, _DIM, dtype=jnp.float32, **mask)
        strategy, inner = plan.auto_choice(shape, checks.strategy_mesh("ring")[0], ("sp",))
        sizes = (8 // inner, inner) if inner else 8
    return comm_bytes(strategy, batch=1, seq_len=_SEQ, num_heads=_HEADS,
                      num_kv_heads=_KV_HEADS, head_dim=_DIM, axis_sizes=sizes, dtype_bytes=4,
                      backward=backward, **mask)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses", "hybrid", "auto"])
@pytest.mark.parametrize("mask", list(BYTE_MASKS))
def test_compiled_bytes_are_the_reach(mask, strategy, backward):
    mask = BYTE_MASKS[mask]
    compiled = _compiled(strategy, mask, backward)
    sent = sum(hlo.collective_bytes(compiled).values())
    expected = _model(strategy, mask, backward)
    assert sent == expected
    local = is_local(MaskSpec.make(**mask), _SEQ // 8, 8)
    if local:
        text = compiled.as_text()
        assert expected == 0 and not [c for c in _COLLECTIVES if c in text], \
            [c for c in _COLLECTIVES if c in text]
    elif strategy in ("ring", "allgather"):
        reach = mask_reach(MaskSpec.make(**mask), _SEQ // 8, 8)
        halo = sum(reach) * _KV_HEADS * 2 * _DIM * 4  # K/V of the reach, float32
        assert sent == halo * (2 if backward else 1)  # dK/dV home in float32


def test_auto_attends_chunks_that_fit_a_shard_locally_in_contiguous_order(caplog):
    """``strategy="auto"`` with ``chunk_size = S/P``: contiguous order, nothing sent (today
    it picked Ulysses and sent its all-to-alls); the planner says why."""
    mesh, _ = checks.strategy_mesh("ring")
    spec = MaskSpec.make(causal=True, chunk_size=_SEQ // 8)
    shape = LayerShape(1, _SEQ, _HEADS, _KV_HEADS, _DIM, dtype=jnp.float32, causal=True,
                       chunk_size=_SEQ // 8)
    strategy, _, why = plan.auto_plan(shape, mesh, ("sp",))
    assert registry.default_layout(strategy, spec, seq_len=_SEQ, num_shards=8) == "contiguous"
    assert all(sent == 0 for sent in plan.plan_layer(shape, {"sp": 8},
                                                     hardware="cpu").candidates.values())
    by_bytes = plan.plan_layer(shape, {"sp": 8})
    assert by_bytes.bytes_per_device == 0 and "attends locally" in by_bytes.reason
    for name in registry.names():
        assert registry.default_layout(name, spec, seq_len=_SEQ, num_shards=8) == "contiguous"
    with caplog.at_level(logging.INFO, logger="jax_seqpar"):
        compiled = _compiled("auto", dict(causal=True, chunk_size=_SEQ // 8), backward=True)
    assert sum(hlo.collective_bytes(compiled).values()) == 0


def test_window_halo_is_what_the_planner_sends_by_bytes():
    """Without hardware the choice is by bytes: a causal window of one shard's length
    goes to the halo ring (one neighbour's K/V), not Ulysses' all-to-alls."""
    chosen = plan.plan(8192, 8, 8, 64, 8, causal=True, window=(1024, 0))
    assert chosen.strategy == "ring"
    assert chosen.bytes_per_device == comm_bytes(
        "ring", batch=1, seq_len=8192, num_heads=8, num_kv_heads=8, head_dim=64,
        axis_sizes=8, backward=True, causal=True, window=(1024, 0))
    chunked = plan.plan_layer(LayerShape(1, 8192, 8, 8, 64, causal=True, chunk_size=2048),
                              {"sp": 8})
    assert chunked.strategy == "ring" and chunked.bytes_per_device < comm_bytes(
        "ulysses", batch=1, seq_len=8192, num_heads=8, num_kv_heads=8, head_dim=64,
        axis_sizes=8, backward=True)


def test_hybrid_whose_ring_reach_is_zero_pipelines_ulysses_alone(tolerances):
    """Chunks of a ring group's length on the hybrid's 2 x 4 mesh: the outer ring's reach is
    (0, 0) (no ring), the whole mask's is not (a chunk spans 4 devices); the inner
    exchange is cut into sequence pieces behind Ulysses' own kernels, exact."""
    from jax_seqpar.strategies.hybrid import outer_ring

    spec = MaskSpec.make(causal=True, chunk_size=32)
    assert outer_ring(spec, 32, 2) == "none" and not is_local(spec, 8, 8)
    assert outer_ring(MaskSpec.make(causal=True, chunk_size=64), 32, 4) == "halo"
    assert outer_ring(MaskSpec.make(causal=True), 32, 2) == "ring"
    exactness.check(exactness.Case("hybrid", shape=(1, 64, 8, 2, 16, 16),
                                   mask=dict(causal=True, chunk_size=32),
                                   pipeline=dict(pieces=2)), tolerances)


def _hybrid_bytes(seq: int, mask: dict, *, backward: bool) -> dict:
    """Collective bytes by kind of the hybrid's compiled program on its 2x4 CPU mesh,
    float32 ``[1, seq]`` inputs: the forward, or with ``backward`` forward + vjp."""
    mesh, axes = checks.strategy_mesh("hybrid")
    q = jnp.ones((1, seq, _HEADS, _DIM), jnp.float32)
    k = jnp.ones((1, seq, _KV_HEADS, _DIM), jnp.float32)
    f = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=axes,
                          strategy="hybrid", **mask)

    def both(q, k, v, dout):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(dout)

    fn, args = (both, (q, k, k, jnp.ones_like(q))) if backward else (f, (q, k, k))
    return hlo.collective_bytes(jax.jit(fn).lower(*args).compile())


def test_hybrid_without_a_ring_sends_comm_bytes_in_pieces():
    """The same at S=4096 (512 tokens a device: pieces="auto" cuts them): compiled bytes
    equal comm_bytes (the all-to-alls, the <dout, out> rows, no collective-permute)."""
    seq, mask = 4096, dict(causal=True, chunk_size=2048)
    sent = _hybrid_bytes(seq, mask, backward=True)
    assert sent["collective-permute"] == 0
    assert sum(sent.values()) == comm_bytes(
        "hybrid", batch=1, seq_len=seq, num_heads=_HEADS, num_kv_heads=_KV_HEADS,
        head_dim=_DIM, axis_sizes=(2, 4), dtype_bytes=4, backward=True, **mask)


@pytest.mark.parametrize("mask", [dict(causal=True, window=(1024, 0)), dict(window=(700, 300))],
                         ids=["causal-window", "window-both-sides"])
def test_hybrid_halo_sends_comm_bytes_in_pieces(mask):
    """A window on the contiguous split at S=4096 (512 tokens a device: pieces="auto" cuts
    them) makes the hybrid's ring a halo exchange, cut into pieces: compiled bytes equal
    comm_bytes, forward and backward (the all-to-alls and the <dout, out> rows; across,
    the halo's K/V and its float32 dK/dV back, never the full ring)."""
    from jax_seqpar.strategies.hybrid import outer_ring

    seq = 4096
    assert outer_ring(MaskSpec.make(**mask), seq // 2, 2, shard_len=seq // 8) == "halo"
    shape = dict(batch=1, seq_len=seq, num_heads=_HEADS, num_kv_heads=_KV_HEADS,
                 head_dim=_DIM, axis_sizes=(2, 4), dtype_bytes=4, **mask)
    for backward in (False, True):
        sent = _hybrid_bytes(seq, mask, backward=backward)
        assert sum(sent.values()) == comm_bytes("hybrid", backward=backward, **shape), sent
        # Across: the halo only, K/V of the window's tokens (one K/V head a device after
        # the inner all-to-all), and their float32 dK/dV back.
        assert sent["collective-permute"] == sum(mask["window"]) * 2 * _DIM * 4 * (1 + backward)
