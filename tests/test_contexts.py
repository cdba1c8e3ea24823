"""The global entry point in every context a user calls it from (tests/contexts.py).

Each strategy runs under each context, at a length the devices divide and one they do
not; causal masking and the dtypes (float32, bfloat16, float16) rotate over the cases so
that every strategy meets each (causal, dtype) pair and every context several. Out and
gradients are compared against the float32 reference, and on Explicit meshes the output
must carry the queries' sharding. The default tier runs each strategy, and each other
entry point, in one context (every context between them); the ``matrix`` tier the rest.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import checks
import contexts
import jax_seqpar as sp
from jax_seqpar.api import inference
from jax_seqpar.core import reference
from jax_seqpar.flax import SelfAttention, make_attention_fn

B, H, HKV, D = 1, 8, 2, 8
LENGTHS = (64, 60)  # divisible by the 8 devices (and the 16 zigzag half-shards); not divisible
#: strategy name -> (mesh shape, axis names, keyword arguments)
STRATEGIES = {
    "ring": ((8,), ("sp",), dict(strategy="ring")),
    "ulysses": ((8,), ("sp",), dict(strategy="ulysses")),
    "allgather": ((8,), ("sp",), dict(strategy="allgather")),
    "hybrid-2-axes": ((2, 4), ("dcn", "ici"), dict(strategy="hybrid")),
    "hybrid-1-axis": ((8,), ("sp",), dict(strategy="hybrid", ulysses_size=4)),
}
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
#: strategy -> its default-tier context (every context once) and (causal, dtype) at each
#: length (every strategy causal, every dtype several times).
DEFAULT = {"ring": ("explicit-set-mesh", (True, BF16), (True, F16)),
           "ulysses": ("auto", (True, F32), (False, F16)),
           "allgather": ("explicit", (True, F16), (False, BF16)),
           "hybrid-2-axes": ("jit-sharded", (False, F32), (True, BF16)),
           "hybrid-1-axis": ("jit-replicated", (True, F16), (True, F32))}
_MASK_DTYPES = list(itertools.product((True, False), (F32, BF16, F16)))


def _cases():
    for s, strategy in enumerate(STRATEGIES):
        for c, name in enumerate(contexts.NAMES):
            for n, seq in enumerate(LENGTHS):
                default = DEFAULT[strategy][0] == name
                causal, dtype = (DEFAULT[strategy][1 + n] if default else
                                 _MASK_DTYPES[(2 * c + n + s) % len(_MASK_DTYPES)])
                yield pytest.param(name, strategy, seq, causal, dtype,
                                   marks=() if default else pytest.mark.matrix,
                                   id=f"{name}-{strategy}-S{seq}-"
                                      f"{'causal' if causal else 'full'}-{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("context_name,strategy,seq,causal,dtype", list(_cases()))
def test_every_strategy_in_every_context(context_name, strategy, seq, causal, dtype, make_qkv,
                                         tolerances):
    context = contexts.Context(context_name)
    shape, names, kwargs = STRATEGIES[strategy]
    mesh = context.mesh(shape, names)
    seq_axes = names if len(names) > 1 else names[0]
    q, k, v = make_qkv(batch=B, seq=seq, heads=H, kv_heads=HKV, head_dim=D, dtype=dtype)

    def build(mesh):
        return functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=seq_axes,
                                 causal=causal, **kwargs)

    context.check(build, (q, k, v), functools.partial(reference.attention, causal=causal),
                  tolerances, mesh=mesh, seq_axes=seq_axes)


# --- the other global entry points, in every context ---------------------------------------

def _cache(mesh, q):
    return inference.KVCache.create(mesh, batch=q.shape[0], capacity=32, num_kv_heads=HKV,
                                    head_dim=D, dtype=q.dtype)


@pytest.mark.parametrize("context", contexts.tiered(2), indirect=True)
def test_prefill_pads_in_every_context(context, make_qkv, tolerances):
    """A prompt the zigzag layout pads (24 tokens, 16 pieces) fills the cache and attends."""
    mesh = context.mesh()
    q, k, v = make_qkv(batch=2, seq=24, heads=H, kv_heads=HKV, head_dim=D, dtype=jnp.float16)

    def build(mesh):
        return lambda q, k, v: inference.prefill(q, k, v, _cache(mesh, q), strategy="ring")[0]

    context.check(build, (q, k, v), functools.partial(reference.attention, causal=True),
                  tolerances, mesh=mesh, grads=False)


@pytest.mark.parametrize("context", contexts.tiered(3), indirect=True)
def test_decode_after_prefill_in_every_context(context, make_qkv, tolerances):
    mesh = context.mesh()
    q, k, v = make_qkv(batch=2, seq=21, heads=H, kv_heads=HKV, head_dim=D, dtype=jnp.bfloat16)

    def build(mesh):
        def decode(q, k, v):
            _, cache = inference.prefill(q[:, :20], k[:, :20], v[:, :20], _cache(mesh, q))
            return inference.decode(q[:, 20:], k[:, 20:], v[:, 20:], cache)[0]
        return decode

    context.check(build, (q, k, v), lambda q, k, v: reference.attention(q, k, v, causal=True)
                  [:, 20:], tolerances, mesh=mesh, grads=False)


@pytest.mark.parametrize("context", contexts.tiered(4), indirect=True)
def test_flax_attention_fn_in_every_context(context, make_qkv, tolerances):
    mesh = context.mesh()
    q, k, v = make_qkv(batch=1, seq=60, heads=H, kv_heads=HKV, head_dim=D, dtype=jnp.bfloat16)
    context.check(lambda mesh: make_attention_fn(mesh, strategy="ring", causal=True),
                  (q, k, v), functools.partial(reference.attention, causal=True), tolerances,
                  mesh=mesh)


@pytest.mark.parametrize("context", contexts.tiered(0), indirect=True)
def test_flax_self_attention_in_every_context(context, tolerances):
    mesh = context.mesh()
    x = checks.normal((2, 60, 32))

    def layer(mesh):
        return SelfAttention(32, H, num_kv_heads=HKV, head_dim=D, causal=True, mesh=mesh,
                             strategy="auto" if mesh is None else "ulysses",  # needs a mesh
                             rngs=nnx.Rngs(0))

    context.check(layer, (x,), layer(None), tolerances, mesh=mesh, argnums=(0,))


# --- one rule for every strategy, and no mesh ---------------------------------------------

@pytest.mark.parametrize("strategy", ["auto", "ring", "ulysses", "allgather", "hybrid"])
def test_mixed_dtypes_are_refused_by_every_strategy(strategy, make_qkv):
    q, k, v = make_qkv(batch=1, seq=64, heads=H, kv_heads=HKV, head_dim=D)
    mesh = contexts.make_mesh((8,), ("sp",))
    kwargs = dict(ulysses_size=4) if strategy == "hybrid" else {}
    with pytest.raises(ValueError, match="share one floating dtype.*k.dtype=bfloat16"):
        sp.sequence_parallel_attention(q, k.astype(jnp.bfloat16), v, mesh=mesh,
                                       strategy=strategy, **kwargs)


def test_no_mesh_attends_locally(make_qkv, tolerances):
    q, k, v = make_qkv(batch=2, seq=60, heads=H, kv_heads=HKV, head_dim=D)
    segments = (jnp.arange(60)[None] >= jnp.array([[20], [45]])).astype(jnp.int32)
    out, lse = sp.sequence_parallel_attention(q, k, v, mesh=None, causal=True,
                                              segment_ids=segments, return_lse=True)
    want, want_lse = reference.attention(q, k, v, causal=True, segment_ids=segments,
                                         return_lse=True)
    np.testing.assert_allclose(out, want, **tolerances(q.dtype))
    np.testing.assert_allclose(lse, want_lse, **tolerances(q.dtype))


@pytest.mark.parametrize("context", contexts.tiered(4), indirect=True)
def test_vmap_and_checkpoint_in_every_context(context, make_qkv, tolerances):
    """``jax.vmap`` over a leading axis and ``jax.checkpoint`` around the call."""
    mesh = context.mesh()
    q, k, v = make_qkv(batch=2, seq=60, heads=H, kv_heads=HKV, head_dim=D)

    def build(mesh):
        attend = jax.checkpoint(functools.partial(sp.sequence_parallel_attention, mesh=mesh,
                                                  strategy="ring", causal=True))
        return jax.vmap(lambda q, k, v: attend(q[None], k[None], v[None])[0])

    context.check(build, (q, k, v), functools.partial(reference.attention, causal=True),
                  tolerances, mesh=mesh)
