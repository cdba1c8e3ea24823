"""The hybrid's inner exchange pipelined along the sequence around its ring
(:mod:`jax_seqpar.strategies.ring_pieces`) beyond exactness (tests/test_exactness.py runs
every chunk count against the reference, per shard and through the global call): a
training step through it compiles once, and the model hides what its pieces hide."""

import jax
import jax.numpy as jnp

import checks
import jax_seqpar as sp
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import hardware, predict
from jax_seqpar.strategies import heads as head_split, registry
from test_compile_once import compiles_per_call


def test_hybrid_chunks_compile_once():
    """A jitted training step through the chunked hybrid compiles once."""
    mesh = jax.make_mesh((2, 4), ("dcn", "ici"))
    q, k, v = checks.normals([(1, 64, 8, 8), (1, 64, 2, 8), (1, 64, 2, 8)])

    def loss(q, k, v):
        out = sp.sequence_parallel_attention(q, k, v, mesh=mesh, strategy="hybrid",
                                             seq_axes=("dcn", "ici"), causal=True, pieces=3)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        counts = compiles_per_call(lambda: step(q, k, v))
    assert counts[0] >= 1 and counts[1:] == [0, 0], counts


def test_the_model_hides_what_the_hybrid_pieces_hide():
    """The planner cuts the hybrid's inner exchange as ``pieces="auto"`` does (16 pieces'
    worth at 2048 tokens a device over 4: 5 pieces), hides all but one piece's share of
    the all-to-all bytes where the target overlaps all-to-alls; a window (the ring is then
    a halo exchange) is cut alike."""
    shape = LayerShape(1, 16384, 16, 4, 128, dtype="bfloat16", causal=True)
    hybrid = registry.get("hybrid")
    assert hybrid.pieces(shape, 2, 4) == (16, 16)
    assert head_split.resolve_pieces("auto", "auto", "auto", 16, 4, 4, 2048,
                                     shared_kv=False) == (5, 1)
    assert hybrid.pieces(shape.replace(window=(256, 0)), 2, 4) == (16, 16)
    candidate = predict.Candidate("hybrid", 2, 4)
    model = predict.predict(candidate, shape, "h100")
    assert model["hidden_bytes"] / model["bytes"] >= 0.9, model
    serial = predict.predict(candidate, shape, hardware.H100.replace(overlaps=()))
    assert serial["hidden_bytes"] == 0.0
    assert serial["exposed_comm_seconds"] > model["exposed_comm_seconds"]
