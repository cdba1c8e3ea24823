"""The mask families (chunked causal, prefix-LM, vision-language, a mask_fn) in the
strategies beyond exactness (tests/test_exactness.py runs each family through every
strategy against the reference): ring steps whose shards share no visible pair run no
kernel, and bad mask arguments are refused by name at the global and per-shard entry
points."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_seqpar as sp
from jax_seqpar.strategies.allgather import allgather_attention
from jax_seqpar.strategies.hybrid import hybrid_attention
from jax_seqpar.strategies.ring import ring_attention
from jax_seqpar.strategies.ulysses import ulysses_attention

import checks

#: The kernel the strategies run: the XLA kernel (the CPU's), named so that these tests
#: hold the strategies' part whatever the other platforms' kernels take.
KERNEL = "xla"


def test_ring_runs_a_kernel_only_for_shard_pairs_with_a_visible_pair(monkeypatch):
    """Chunked causal attention in the ring: the forward's kernel calls, counted as they
    run (``checks.record_xla_tiles``), equal the (query shard, key shard) pairs that hold
    a visible (query, key) pair; every other step is skipped."""
    from jax_seqpar.core import masks

    batch, seq, shards = 1, 64, 8
    keywords = dict(causal=True, chunk_size=16)  # a chunk spans two shards
    q, k, v = checks.normals([(batch, seq, 2, 8)] * 3, seed=2)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    mesh = jax.make_mesh((shards,), ("sp",))
    spec = masks.MaskSpec.make(True, chunk_size=16)
    tokens = masks.Tokens(np.asarray(positions))
    visible = np.asarray(masks.visible_tokens(spec, tokens, tokens))[0]  # [S, S]
    local = seq // shards
    pairs = visible.reshape(shards, local, shards, local).any(axis=(1, 3))
    events = []
    jax.clear_caches()  # a program traced before reports nothing
    checks.record_xla_tiles(monkeypatch, lambda *event: events.append(event[0]))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: sp.sequence_parallel_attention(
            q, k, v, mesh=mesh, strategy="ring", positions=positions, kernel=KERNEL,
            **keywords))(q, k, v)
        jax.block_until_ready(out)
        jax.effects_barrier()
    assert pairs.sum() == 12 < shards * shards
    assert events.count("call") == pairs.sum()


# Bad input: refused by name, with the numbers, at every entry point.

def _bad_inputs():
    seq = 16
    return [
        ("bidirectional_ids", dict(causal=True, bidirectional_ids=jnp.zeros((1, seq + 1),
                                                                           jnp.int32)),
         r"bidirectional_ids.*\(1, 17\)"),
        ("chunk_size_zero", dict(causal=True, chunk_size=0), r"chunk_size.*chunk_size=0"),
        ("chunk_size_negative", dict(chunk_size=-4), r"chunk_size.*chunk_size=-4"),
        ("mask_fn_not_bool", dict(mask_fn=lambda q, kv: q.positions - kv.positions),
         r"mask_fn.*int32"),
        ("mask_fn_shape", dict(mask_fn=lambda q, kv: jnp.ones((3, 5, 7), bool)),
         r"mask_fn.*\[3, 5, 7\]"),
        ("bidirectional_without_causal", dict(bidirectional_ids=jnp.ones((1, seq), jnp.int32)),
         r"causal=True"),
    ]


@pytest.mark.parametrize("name,keywords,match", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
@pytest.mark.parametrize("entry", ["global", "local", "per_shard"])
def test_bad_mask_arguments_are_refused(entry, name, keywords, match):
    q = k = v = jnp.zeros((1, 16, 2, 4), jnp.float32)
    mesh = jax.make_mesh((8,), ("sp",))
    if entry == "per_shard":
        return _per_shard_refuses(mesh, q, k, v, keywords, match)
    with pytest.raises(ValueError, match=match), jax.set_mesh(mesh):
        if entry == "global":
            sp.sequence_parallel_attention(q, k, v, mesh=mesh, strategy="ring", **keywords)
        else:
            sp.sequence_parallel_attention(q, k, v, mesh=None, **keywords)


def _per_shard_refuses(mesh, q, k, v, keywords, match):
    """Each per-shard function, inside ``shard_map``, refuses ``keywords`` (arrays among
    them given whole to every shard: a wrong shape there too)."""
    arrays = {name: x for name, x in keywords.items() if isinstance(x, jax.Array)}
    static = {name: x for name, x in keywords.items() if name not in arrays}
    for function, axes in ((ring_attention, "sp"), (ulysses_attention, "sp"),
                           (allgather_attention, "sp"), (hybrid_attention, ("a", "b"))):
        here = mesh if axes == "sp" else jax.make_mesh((2, 4), axes)
        seq = P(None, axes)

        def body(q, k, v, arrays, function=function, axes=axes):
            return function(q, k, v, seq_axes=axes, **static, **arrays)

        with pytest.raises(ValueError, match=match), jax.set_mesh(here):
            placed = [jax.reshard(x, seq) for x in (q, k, v)]
            jax.shard_map(body, mesh=here, in_specs=(seq, seq, seq, P()),
                          out_specs=seq)(*placed, arrays)
