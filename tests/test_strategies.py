"""The strategies beyond exactness at one call (tests/test_exactness.py holds that): the
custom ring backward against autodiff of a plain ring, data- and tensor-parallel axes
beside the sequence's, ``vmap`` and ``checkpoint``, sharded-cache decode, bad input and
the planner's pick for ``strategy="auto"``."""

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import checks
import jax_seqpar as sp
from jax_seqpar.core import masks, reference

B, S, H, D = 2, 64, 8, 16


_mesh = checks.strategy_mesh


def _plain_scan_ring(q, k, v, tokens, *, axis_name, options):
    """The ring written naively: differentiated by JAX autodiff through the scan."""
    from jax_seqpar import kernels
    from jax_seqpar.core.merge import merge
    from jax_seqpar.core.masks import EMPTY_LSE

    size = jax.lax.axis_size(axis_name)
    perm = [(i, (i + 1) % size) for i in range(size)]

    def step(carry, _):
        out, lse, kv = carry
        o, l = kernels.attention(options, q, kv[0], kv[1], tokens, kv[2])
        out, lse = merge(out, lse, o, l)
        kv = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), kv)
        return (out, lse, kv), None

    from jax_seqpar.core import compat as _compat

    init = _compat.match_varying(
        (jnp.zeros(q.shape[:3] + v.shape[3:]), jnp.full(q.shape[:3], EMPTY_LSE)), q)
    (out, _, _), _ = jax.lax.scan(step, (*init, (k, v, tokens)), length=size)
    return out.astype(q.dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_custom_ring_backward_matches_autodiff_of_plain_ring(causal, make_qkv):
    from jax_seqpar.strategies.inputs import Metadata, shard_operands
    from jax_seqpar import kernels
    from jax_seqpar.kernels import make_options

    q, k, v = make_qkv(batch=B, seq=S, heads=H, kv_heads=2, head_dim=D, v_head_dim=8, seed=4)
    segment_ids = checks.segments(B, S, seed=9)
    mesh, axes = _mesh("ring")

    def plain(q, k, v, segment_ids):
        options = make_options(q, masks.MaskSpec(causal=causal), kernel="xla")
        tokens = shard_operands(q, options, Metadata(segment_ids=segment_ids), axes).q_tokens
        return _plain_scan_ring(q, k, v, tokens, axis_name=axes, options=options)

    def ours(q, k, v, segment_ids):
        return sp.ring_attention(q, k, v, seq_axes=axes, causal=causal, segment_ids=segment_ids)

    weights = checks.normal(q.shape[:3] + (8,), seed=2)
    grads = []
    for fn in (plain, ours):
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(None, axes),) * 4,
                               out_specs=P(None, axes))
        loss = lambda q, k, v: jnp.sum(mapped(q, k, v, segment_ids) * weights)  # noqa: E731
        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    for got, want in zip(*grads[::-1]):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def _shard_map_in_specs(f, *args):
    """The ``in_specs`` of the (first) ``shard_map`` in ``f``'s program: what stays sharded
    inside, whatever sharding the output is given back in."""
    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "shard_map":
                return eqn.params["in_specs"]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found = find(sub)
                if found is not None:
                    return found
        return None

    return find(jax.make_jaxpr(f)(*args).jaxpr)


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_explicit_mesh_with_data_axis(strategy, make_qkv, tolerances):
    """``jax.make_mesh`` (Explicit axes): batch sharding over "dp" is kept."""
    q, k, v = make_qkv(batch=2, seq=S, heads=H, kv_heads=4, head_dim=D)
    mesh = jax.make_mesh((2, 4), ("dp", "sp"))
    with jax.set_mesh(mesh):
        q_s, k_s, v_s = (jax.reshard(x, P("dp")) for x in (q, k, v))
        f = jax.jit(functools.partial(sp.sequence_parallel_attention, mesh=mesh,
                                      strategy=strategy, causal=True))
        out = f(q_s, k_s, v_s)
        assert out.sharding.spec[:2] == ("dp", None)  # like q's
        assert _shard_map_in_specs(f, q_s, k_s, v_s)[0] == P("dp", "sp", None, None)
        grad = jax.grad(lambda q: f(q, k_s, v_s).sum())(q_s)
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True),
                               **tolerances(q.dtype))
    expected = jax.grad(lambda q: reference.attention(q, k, v, causal=True).sum())(q)
    np.testing.assert_allclose(grad, expected, **tolerances(q.dtype, "grad"))


def test_vmap_and_checkpoint(make_qkv, tolerances):
    q, k, v = make_qkv(batch=1, seq=S, heads=H, head_dim=D)
    mesh, axes = _mesh("ring")
    attend = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=axes,
                               strategy="ring", causal=True)
    stacked = jnp.stack([q, 0.5 * q])
    out = jax.jit(jax.vmap(lambda q: attend(q, k, v)))(stacked)
    for i in range(2):
        np.testing.assert_allclose(out[i], reference.attention(stacked[i], k, v, causal=True),
                                   **tolerances(q.dtype))
    grad = jax.jit(jax.grad(jax.checkpoint(lambda q: attend(q, k, v).sum())))(q)
    expected = jax.grad(lambda q: reference.attention(q, k, v, causal=True).sum())(q)
    np.testing.assert_allclose(grad, expected, **tolerances(q.dtype, "grad"))


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_decode_matches_reference(kernel, make_qkv, tolerances):
    from jax_seqpar.api.program import can_check_vma
    from jax_seqpar.strategies.decode import decode_attention

    capacity, new = 64, 2
    _, k, v = make_qkv(batch=3, seq=capacity, heads=4, kv_heads=2, head_dim=D, seed=6)
    q = checks.normal((3, new, 4, D), seed=8)
    kv_length = jnp.array([64, 20, 3], jnp.int32)  # full, mid-shard, first shard only
    mesh, axes = _mesh("ring")
    f = jax.shard_map(
        lambda q, k, v, n: decode_attention(q, k, v, seq_axes=axes, seq_lengths=n, kernel=kernel),
        mesh=mesh, in_specs=(P(), P(None, axes), P(None, axes), P()), out_specs=P(),
        check_vma=can_check_vma(kernel))
    out = jax.jit(f)(q, k, v, kv_length)
    for b, n in enumerate(kv_length.tolist()):
        positions = (n - new + jnp.arange(new, dtype=jnp.int32))[None]
        expected = reference.attention(
            q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=True, positions=positions,
            kv_positions=jnp.arange(n, dtype=jnp.int32)[None])
        np.testing.assert_allclose(out[b:b + 1], expected, **tolerances(q.dtype))


@pytest.mark.parametrize("kwargs,message", [
    pytest.param(dict(strategy="ulysses", heads=12, kv_heads=4), "num_heads=12 is not divisible",
                 id="ulysses-heads"),
    pytest.param(dict(strategy="ring", heads=6, kv_heads=4), "multiple of num_kv_heads=4",
                 id="gqa-ratio"),
    pytest.param(dict(strategy="tree"), "strategy='tree'", id="strategy"),
    pytest.param(dict(seq_axes="tp"), "not an axis of the mesh", id="axis"),
    pytest.param(dict(layout="diagonal"), "layout='diagonal'", id="layout"),
    pytest.param(dict(bad_segments=True), "segment_ids must have shape", id="segments"),
    pytest.param(dict(rank3=True), "must have rank 4", id="rank"),
    pytest.param(dict(block_sizes="256", kernel="xla"),
                 "is not a jax_seqpar.kernels.BlockSizes",
                 id="block-sizes"),
    pytest.param(dict(k_dim=8), "must share head_dim", id="head-dim"),
    pytest.param(dict(k_batch=1), "share the batch size", id="batch"),
    pytest.param(dict(strategy="hybrid", hybrid_heads=6), "inner) axis 'ici' of size 4",
                 id="hybrid-heads"),
])
def test_bad_input_raises_value_error(kwargs, message):
    kwargs = dict(kwargs)
    seq, heads = kwargs.pop("seq", 32), kwargs.pop("heads", 8)
    kv_heads = kwargs.pop("kv_heads", 8)
    strategy = kwargs.pop("strategy", "ring")
    mesh, axes = _mesh(strategy)
    if kwargs.pop("hybrid_heads", None):
        heads, kv_heads = 6, 2
    q = jnp.zeros((2, seq, heads, 16))
    k = jnp.zeros((kwargs.pop("k_batch", 2), seq, kv_heads, kwargs.pop("k_dim", 16)))
    v = jnp.zeros(k.shape[:3] + (16,))
    if kwargs.pop("rank3", False):
        q = q[0]
    if kwargs.pop("bad_segments", False):
        kwargs["segment_ids"] = jnp.zeros((2, seq + 1), jnp.int32)
    kwargs.setdefault("seq_axes", axes)
    with pytest.raises(ValueError, match=re.escape(message)):
        sp.sequence_parallel_attention(q, k, v, mesh=mesh, strategy=strategy, **kwargs)


def test_tensor_parallel_heads_with_replicated_gqa_kv(make_qkv, tolerances):
    """q split over heads ("tp") while GQA k/v are not: resharded, never mispaired."""
    q, k, v = make_qkv(batch=1, seq=S, heads=H, kv_heads=2, head_dim=D, seed=14)
    mesh = jax.make_mesh((2, 4), ("tp", "sp"))
    with jax.set_mesh(mesh):
        q_s = jax.reshard(q, P(None, None, "tp"))
        k_s, v_s = (jax.reshard(x, P()) for x in (k, v))
        out = jax.jit(functools.partial(sp.sequence_parallel_attention, mesh=mesh,
                                        strategy="ring", causal=True))(q_s, k_s, v_s)
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True),
                               **tolerances(q.dtype))


def test_tensor_parallel_heads_shared_by_q_and_kv(make_qkv, tolerances):
    """q, k and v all split over heads ("tp"): the head sharding is kept inside."""
    q, k, v = make_qkv(batch=1, seq=S, heads=H, kv_heads=4, head_dim=D, seed=15)
    mesh = jax.make_mesh((2, 4), ("tp", "sp"))
    with jax.set_mesh(mesh):
        q_s, k_s, v_s = (jax.reshard(x, P(None, None, "tp")) for x in (q, k, v))
        f = jax.jit(functools.partial(sp.sequence_parallel_attention, mesh=mesh,
                                      strategy="ulysses", causal=True))
        out = f(q_s, k_s, v_s)
        assert out.sharding.spec[:3] == (None, None, "tp")  # like q's
        assert _shard_map_in_specs(f, q_s, k_s, v_s)[0] == P(None, "sp", "tp", None)
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True),
                               **tolerances(q.dtype))


@pytest.mark.parametrize("kv_heads,expected", [(8, "ulysses"), (1, "ring")])
def test_auto_strategy(kv_heads, expected):
    """The planner's pick for ``strategy="auto"`` (tests/test_exactness.py runs these
    calls against the reference: ``auto-kv8``, ``auto-kv1``)."""
    from jax_seqpar.planning import plan

    chosen = plan.plan(S, H, kv_heads, D, {"sp": 8}, v_head_dim=8 if kv_heads == 1 else D,
                       dtype_bytes=4)
    assert chosen.strategy == expected, chosen.reason
