"""The hybrid's inner exchange pipelined along the sequence around its ring
(:mod:`jax_seqpar.strategies.ring_chunks`) against the reference: outputs, log-sum-exps
and the gradients of q, k, v and the sinks, for every chunk count the 8 local tokens
allow, on rings of 2 and 4 devices (no middle step; two) and of one (Ulysses' pipeline
over the inner axis), with causal / full masks,
windows on given positions, sinks, segment ids, GQA and replicated K/V."""

import functools

import jax
import jax.numpy as jnp
import pytest

import checks
import contexts
import jax_seqpar as sp
from jax_seqpar.core import reference
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import hardware, predict
from jax_seqpar.strategies import heads as head_split, registry
from test_compile_once import compiles_per_call
from test_pipelines import _check

# (heads, kv heads, outer, chunks, variant). S = 64 over 8 devices: 8 local tokens,
# chunk counts 1..4 (query pieces of 4 4 / 2 2 2 2 ... rows, K/V pieces of the first's).
HYBRID_CHUNK_CASES = [
    (16, 4, 2, 4, dict(order="zigzag", causal=True, sinks=True, return_lse=True)),
    (8, 2, 4, 3, dict(order="zigzag", causal=True, segments=True)),
    (16, 8, 4, 2, dict(causal=False, sinks=True, return_lse=True)),
    (8, 8, 2, 3, dict(order="zigzag", window=(9, 4), segments=True)),
    (16, 2, 4, 4, dict(causal=True, dtype=jnp.bfloat16)),  # K/V replicated (float32)
    (8, 4, 2, 2, dict(order="zigzag", causal=True, sinks=True, dtype=jnp.float16)),
    (16, 4, 1, 3, dict(causal=True, return_lse=True)),  # no ring: Ulysses' pipeline
]


def _case_id(case):
    heads, kv_heads, outer, chunks, variant = case
    return (f"h{heads}-kv{kv_heads}-o{outer}-c{chunks}-"
            + "-".join(f"{k}{v}" for k, v in variant.items() if k != "dtype")
            + (f"-{jnp.dtype(variant['dtype']).name}" if "dtype" in variant else ""))


@pytest.mark.parametrize("heads, kv_heads, outer, chunks, variant", checks.tiered([
    pytest.param(*case, id=_case_id(case)) for case in HYBRID_CHUNK_CASES],
    lambda i: i in (0, 1)))
def test_hybrid_chunks(heads, kv_heads, outer, chunks, variant, tolerances):
    _check("hybrid", tolerances, heads=heads, kv_heads=kv_heads, outer=outer, chunks=chunks,
           **variant)


# The README's context first (an Explicit mesh from jax.make_mesh, jax.set_mesh, jit, the
# gradient), then an Auto mesh; 60 tokens: padded to whole shards (8 a device).
@pytest.mark.parametrize("context_name, seq, dtype", [
    ("jit-replicated", 64, jnp.float32),
    pytest.param("explicit-set-mesh", 60, jnp.bfloat16, marks=pytest.mark.matrix),
    pytest.param("auto", 64, jnp.float16, marks=pytest.mark.matrix)])
def test_hybrid_chunks_through_the_global_call(context_name, seq, dtype, make_qkv, tolerances):
    context = contexts.Context(context_name)
    mesh = context.mesh((2, 4), ("dcn", "ici"))
    q, k, v = make_qkv(batch=1, seq=seq, heads=8, kv_heads=2, head_dim=8, dtype=dtype)

    def build(mesh):
        return functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy="hybrid",
                                 seq_axes=("dcn", "ici"), causal=True, chunks=2)

    context.check(build, (q, k, v), functools.partial(reference.attention, causal=True),
                  tolerances, mesh=mesh, seq_axes=("dcn", "ici"))


def test_hybrid_chunks_compile_once():
    """A jitted training step through the chunked hybrid compiles once."""
    mesh = jax.make_mesh((2, 4), ("dcn", "ici"))
    q, k, v = checks.normals([(1, 64, 8, 8), (1, 64, 2, 8), (1, 64, 2, 8)])

    def loss(q, k, v):
        out = sp.sequence_parallel_attention(q, k, v, mesh=mesh, strategy="hybrid",
                                             seq_axes=("dcn", "ici"), causal=True, chunks=3)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        counts = compiles_per_call(lambda: step(q, k, v))
    assert counts[0] >= 1 and counts[1:] == [0, 0], counts


def test_the_model_hides_what_the_hybrid_pieces_hide():
    """The planner cuts the hybrid's inner exchange as ``chunks="auto"`` does (16 pieces'
    worth at 2048 tokens a device over 4: 5 chunks), hides all but one piece's share of
    the all-to-all bytes where the target overlaps all-to-alls, and none with a window
    (the ring is then a halo exchange: not chunked)."""
    shape = LayerShape(1, 16384, 16, 4, 128, dtype="bfloat16", causal=True)
    hybrid = registry.get("hybrid")
    assert hybrid.pieces(shape, 2, 4) == (16, 16)
    assert head_split.resolve_pieces("auto", "auto", "auto", 16, 4, 4, 2048,
                                     shared_kv=False) == (5, 1)
    assert hybrid.pieces(shape.replace(window=(256, 0)), 2, 4) != (16, 16)
    candidate = predict.Candidate("hybrid", 2, 4)
    model = predict.predict(candidate, shape, "h100")
    assert model["hidden_bytes"] / model["bytes"] >= 0.9, model
    serial = predict.predict(candidate, shape, hardware.H100.replace(overlaps=()))
    assert serial["hidden_bytes"] == 0.0
    assert serial["exposed_comm_seconds"] > model["exposed_comm_seconds"]
