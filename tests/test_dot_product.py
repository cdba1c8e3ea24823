"""``jax_seqpar.dot_product_attention`` as a drop-in for ``jax.nn.dot_product_attention``.

One rotating matrix (every placement: no mesh and each strategy; every context of
tests/contexts.py; float32/bfloat16/float16; GQA groups 1..8; causal, windows, lengths,
key-padding masks shared and per head, scale; 3-D and 4-D inputs; ``return_residual``)
is compared, out and gradients, against ``jax.nn``'s XLA path run in float32. Then
one test per behaviour a matrix case does not show: the residual's gradient, per-head
masks with sinks, ``vmap``, ``vjp`` with sharded cotangents outside ``jit``, the
output sharding ``jax.nn`` gives, and the errors.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import checks
import contexts
import jax_seqpar as sp
from jax_seqpar.core import reference

N, D = 8, 8  # query heads, head dim
#: placement -> (mesh shape, axis names, strategy); None: no mesh.
PLACEMENTS = {
    "local": None,
    "ring": ((8,), ("sp",), "ring"),
    "ulysses": ((8,), ("sp",), "ulysses"),
    "allgather": ((8,), ("sp",), "allgather"),
    "hybrid": ((2, 4), ("dcn", "ici"), "hybrid"),
    "auto": ((8,), ("sp",), "auto"),
}
#: jax.nn keywords; "mask" names a key-padding mask, "lengths" which lengths are passed.
FEATURES = [
    ("causal", dict(is_causal=True)),
    ("window-pair", dict(local_window_size=(5, 2))),
    ("causal-window-int", dict(is_causal=True, local_window_size=4)),
    ("lengths", dict(lengths="both")),
    ("causal-key-mask", dict(is_causal=True, mask="keys")),
    ("head-mask", dict(mask="heads")),
    ("scale-window-kv-lengths", dict(scale=0.3, local_window_size=(6, 6), lengths="kv")),
    ("key-mask-q-lengths", dict(mask="keys", lengths="q")),
]
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KV_HEADS = (8, 2, 1, 4)
CONTEXTS = sorted(contexts.CONTEXTS)


def _cases():
    """Two rounds over the placements; the other axes rotate so that each placement meets
    two dtypes, two GQA groupings, two contexts, 3-D and 4-D inputs, and the residual once.
    Each strategy's gradients in the first round (compiling them is the tests' cost; the
    local path's are tested below, and "auto" runs one of the strategies)."""
    for i in range(2 * len(PLACEMENTS)):
        placement, turn = list(PLACEMENTS)[i % len(PLACEMENTS)], i // len(PLACEMENTS)
        name, features = FEATURES[i % len(FEATURES)]
        if name == "head-mask" and placement in ("ulysses", "hybrid"):
            name, features = FEATURES[(i + 1) % len(FEATURES)]  # they split heads: refused
        dtype, kv_heads = DTYPES[(i + turn) % len(DTYPES)], KV_HEADS[i % len(KV_HEADS)]
        context = CONTEXTS[(i + turn) % len(CONTEXTS)]
        rank, residual = 3 if i % 4 in (1, 2) else 4, i % 4 in (0, 1)
        seq = 30 if i % 5 == 4 else 32  # 30: padded to what the devices divide
        heads = 4 if placement == "auto" and turn else N  # 4 heads on 8 devices: not Ulysses
        grads = not turn and placement not in ("local", "auto")
        yield pytest.param(
            placement, context, features, dtype, heads, min(kv_heads, heads), rank, residual,
            seq, grads, id=f"{placement}-{context}-{name}-{jnp.dtype(dtype).name}-N{heads}"
            f"K{min(kv_heads, heads)}-{rank}d{'-residual' if residual else ''}-S{seq}"
            f"{'-grads' if grads else ''}")


def _key_mask(kind, batch, heads, seq, seed=3):
    """A boolean key-padding mask ``[B, 1, 1, S]`` ("keys") or ``[B, N, 1, S]`` ("heads")."""
    shape = (batch, 1 if kind == "keys" else heads, 1, seq)
    return jnp.asarray(np.random.default_rng(seed).random(shape) < 0.75)


def _seen(residual):
    """Rows that see a key: jax.nn gives the others the mean of the values, we give zeros."""
    return residual.astype(jnp.float32) > -1e29


def _with_residual(out, residual):
    """One array carrying ``out`` and the residual's values (its gradient is tested apart)."""
    residual = jnp.where(_seen(residual), residual, 0)
    return out + jax.lax.stop_gradient(residual)[..., None]


def _jax_nn(*, residual, **kwargs):
    """``jax.nn.dot_product_attention``'s XLA path in float32, rows that see no key zeroed."""

    def attend(q, k, v, mask, q_lengths, kv_lengths):
        out, lse = jax.nn.dot_product_attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), mask=mask,
            query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            implementation="xla", return_residual=True, **kwargs)
        out = jnp.where(_seen(lse)[..., None], out, 0).astype(q.dtype)
        return _with_residual(out, lse.astype(k.dtype)) if residual else out

    return jax.jit(attend)  # one program, not one per op: compiling is the tests' cost


@pytest.mark.parametrize("placement,context_name,features,dtype,heads,kv_heads,rank,residual,"
                         "seq,grads", list(_cases()))
def test_matches_jax_nn(placement, context_name, features, dtype, heads, kv_heads, rank,
                        residual, seq, grads, make_qkv, tolerances):
    context = contexts.Context(context_name)
    features = dict(features)
    mask_kind, lengths = features.pop("mask", None), features.pop("lengths", None)
    batch = 1 if rank == 3 else 2
    q, k, v = make_qkv(batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=D,
                       dtype=dtype, seed=seq + kv_heads)
    mask = None if mask_kind is None else _key_mask(mask_kind, batch, heads, seq)
    q_lengths = jnp.array([seq, 19][:batch], jnp.int32) if lengths in ("both", "q") else None
    kv_lengths = jnp.array([23, seq - 3][:batch], jnp.int32) if lengths in ("both", "kv") else None
    if rank == 3:
        q, k, v = q[0], k[0], v[0]
        mask = None if mask is None else mask[0]
    shape, names, strategy = PLACEMENTS[placement] or ((8,), ("sp",), None)
    mesh = context.mesh(shape, names)
    seq_axes = names if len(names) > 1 else names[0]

    def build(mesh):
        def ours(q, k, v, mask, q_lengths, kv_lengths):
            result = sp.dot_product_attention(
                q, k, v, mask=mask, query_seq_lengths=q_lengths,
                key_value_seq_lengths=kv_lengths, return_residual=residual,
                mesh=None if strategy is None else mesh, seq_axes=seq_axes,
                strategy=strategy or "auto", **features)
            return _with_residual(*result) if residual else result

        return ours

    context.check(build, (q, k, v, mask, q_lengths, kv_lengths),
                  _jax_nn(residual=residual, **features), tolerances, mesh=mesh,
                  seq_axes=seq_axes, grads=grads)


# --- the residual is differentiable ---------------------------------------------------------

@pytest.mark.parametrize("placement,context_name,dtype,rank", [
    ("local", "jit-replicated", jnp.bfloat16, 4), ("ring", "explicit", jnp.float32, 3)])
def test_residual_gradient_matches_reference(placement, context_name, dtype, rank, make_qkv,
                                             tolerances):
    """``(out, residual)`` in jax.nn's layout and dtype, differentiable through both (jax.nn
    stops the residual's gradient): against the reference's ``return_lse``."""
    context = contexts.Context(context_name)
    mesh = context.mesh()
    q, k, v = make_qkv(batch=1, seq=32, heads=N, kv_heads=2, head_dim=D, dtype=dtype, seed=20)
    if rank == 3:
        q, k, v = q[0], k[0], v[0]

    def build(mesh):
        def ours(q, k, v):
            out, residual = sp.dot_product_attention(
                q, k, v, is_causal=True, local_window_size=(5, 2), return_residual=True,
                mesh=None if placement == "local" else mesh,
                strategy="auto" if placement == "local" else placement)
            assert residual.shape == q.shape[:-1] and residual.dtype == k.dtype
            return out + residual[..., None]

        return ours

    def expected(q, k, v):
        out, lse = reference.attention(*(x[None] if rank == 3 else x for x in (q, k, v)),
                                       causal=True, window=(5, 2), return_lse=True)
        both = out + lse[..., None].astype(out.dtype)
        return both[0] if rank == 3 else both

    context.check(build, (q, k, v), jax.jit(expected), tolerances, mesh=mesh)


# --- per-head key-padding masks: every head a batch row -------------------------------------

def _per_head_reference(q, k, v, mask, sinks):
    """The reference one head at a time, head ``n`` seeing the keys ``mask[:, n, 0]`` keeps."""
    groups = q.shape[2] // k.shape[2]
    outs = [reference.attention(q[:, :, n:n + 1], k[:, :, n // groups:n // groups + 1],
                                v[:, :, n // groups:n // groups + 1], sinks=sinks[n:n + 1],
                                segment_ids=jnp.zeros(q.shape[:2], jnp.int32),
                                kv_segment_ids=jnp.where(mask[:, n, 0], 0, 1), causal=True)
            for n in range(q.shape[2])]
    return jnp.concatenate(outs, axis=2)


@pytest.mark.parametrize("placement,context_name", [("local", "jit-replicated"),
                                                    ("allgather", "jit-sharded")])
def test_per_head_mask_with_sinks(placement, context_name, make_qkv, tolerances):
    """A ``[B, N, 1, S]`` mask, with per-head sinks folded in after the heads come back;
    with a mesh on sequence-sharded inputs (the folds state their Explicit shardings)."""
    context = contexts.Context(context_name)
    mesh = context.mesh()
    q, k, v = make_qkv(batch=2, seq=32, heads=N, kv_heads=2, head_dim=D, seed=21)
    mask = _key_mask("heads", 2, N, 32, seed=5)
    sinks = jnp.linspace(-1.0, 2.0, N)

    def build(mesh):
        return functools.partial(sp.dot_product_attention, is_causal=True,
                                 strategy="auto" if placement == "local" else placement,
                                 mesh=None if placement == "local" else mesh)

    def ours(q, k, v, mask, sinks):  # the test's argument order: mask and sinks are data
        return build(mesh)(q, k, v, mask=mask, sinks=sinks)

    context.check(lambda mesh: ours, (q, k, v, mask, sinks), jax.jit(_per_head_reference),
                  tolerances, mesh=mesh, grads=False)


# --- transformations and shardings a jax.nn user has ----------------------------------------

@pytest.mark.parametrize("placement,axis_type,lengths,kernel", checks.tiered([
    ("local", None, True, "auto"), ("ring", "explicit", True, "auto"),
    ("ring", "explicit", True, "xla"), ("allgather", "auto", False, "auto")], lambda i: i < 2))
def test_vmap_jit_and_grad(placement, axis_type, lengths, kernel, make_qkv, tolerances):
    """``jax.jit(jax.grad(...))`` of a loss over ``jax.vmap`` of ``[T, N, H]`` inputs (the
    vmapped axis folds into the kernels' batch: the staged Pallas branch of ``"auto"``
    too, which ``vmap`` could not batch inside ``shard_map`` before)."""
    q, k, v = make_qkv(batch=2, seq=32, heads=N, kv_heads=2, head_dim=D, seed=22)
    kv_lengths = jnp.array([32, 20], jnp.int32)
    mesh = None if axis_type is None else contexts.Context(axis_type).mesh()

    def loss(attend):
        def each(q, k, v, length):
            out = attend(q, k, v, is_causal=True,
                         key_value_seq_lengths=length[None] if lengths else None)
            return jnp.sum(out * out)

        return lambda q, k, v: jnp.sum(jax.vmap(each)(q, k, v, kv_lengths))

    ours = loss(functools.partial(sp.dot_product_attention, mesh=mesh,
                                  strategy="auto" if mesh is None else placement, kernel=kernel))
    theirs = loss(functools.partial(jax.nn.dot_product_attention, implementation="xla"))
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], **tolerances(q.dtype))
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, **tolerances(q.dtype, "grad"))


def test_vjp_with_sharded_cotangents_outside_jit(make_qkv, tolerances):
    """An Explicit mesh without ``jax.set_mesh`` or ``jit``: inputs and cotangents (of out
    and residual) sharded along the sequence, as a jax.nn user's are; the gradients keep
    the inputs' sharding."""
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = make_qkv(batch=1, seq=32, heads=N, kv_heads=2, head_dim=D, seed=23)
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    _, vjp = jax.vjp(functools.partial(sp.dot_product_attention, is_causal=True, mesh=mesh,
                                       strategy="ring", return_residual=True), *placed)
    cotangents = tuple(checks.normals([q.shape, q.shape[:3]], seed=8))
    grads = vjp(tuple(jax.device_put(x, NamedSharding(mesh, P(None, "sp")))
                      for x in cotangents))
    expected = jax.jit(lambda *a: jax.vjp(functools.partial(
        reference.attention, causal=True, return_lse=True), *a[:3])[1](a[3:]))(
            q, k, v, *cotangents)
    for got, want, x in zip(grads, expected, placed):
        assert jax.typeof(got).sharding.spec == jax.typeof(x).sharding.spec
        np.testing.assert_allclose(got, want, **tolerances(q.dtype, "grad"))


def test_output_sharding_is_jax_nns(make_qkv):
    """Inputs sharded over batch and heads (where jax.nn runs on an Explicit mesh; the
    contexts check replicated and sequence-sharded inputs): out and residual carry the
    shardings jax.nn gives them, through a per-head mask's folds."""
    mesh = jax.make_mesh((2, 2, 2), ("dp", "tp", "sp"))
    q, k, v = make_qkv(batch=2, seq=32, heads=N, kv_heads=N, head_dim=D, seed=24)
    mask = _key_mask("heads", 2, N, 32)
    with jax.set_mesh(mesh):
        q, k, v = (jax.reshard(x, P("dp", None, "tp")) for x in (q, k, v))
        ours = sp.dot_product_attention(q, k, v, mask=mask, return_residual=True, mesh=mesh,
                                        strategy="ring")
        theirs = jax.nn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
    for got, want in zip(ours, theirs):
        assert jax.typeof(got).sharding.spec == jax.typeof(want).sharding.spec


# --- without a mesh: two sequences, sharded inputs, and what only jax.nn serves ---------------

@pytest.mark.parametrize("spec", [P("dp"), P(None, None, "tp"), P("dp", "sp", "tp")],
                         ids=["batch", "heads", "batch-seq-heads"])
def test_sharded_inputs_without_a_mesh(spec, make_qkv, tolerances):
    """Inputs sharded over an Explicit mesh, no ``mesh=``: each device attends its rows and
    heads (as jax.nn's XLA path would run), and out keeps the inputs' sharding."""
    mesh = jax.make_mesh((2, 2, 2), ("dp", "sp", "tp"))
    q, k, v = make_qkv(batch=2, seq=32, heads=4, kv_heads=2, head_dim=D, seed=25)
    with jax.set_mesh(mesh):
        placed = [jax.reshard(x, spec) for x in (q, k, v)]
        loss = lambda attend: lambda *a: jnp.sum(attend(*a, is_causal=True) ** 2)  # noqa: E731
        out = jax.jit(functools.partial(sp.dot_product_attention, is_causal=True))(*placed)
        grads = jax.jit(jax.grad(loss(sp.dot_product_attention), argnums=(0, 1, 2)))(*placed)
    want = reference.attention(q, k, v, causal=True)
    want_grads = jax.grad(loss(lambda *a, is_causal: reference.attention(*a, causal=is_causal)),
                          argnums=(0, 1, 2))(q, k, v)
    assert tuple(jax.typeof(out).sharding.spec)[:3] == (tuple(spec) + (None,) * 3)[:3]
    np.testing.assert_allclose(out, want, **tolerances(q.dtype))
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, **tolerances(q.dtype, "grad"))


def test_cross_attention_3d_without_a_mesh(make_qkv, tolerances):
    q, _, _ = make_qkv(batch=1, seq=24, heads=4, kv_heads=2, head_dim=D, seed=9)
    _, k, v = make_qkv(batch=1, seq=40, heads=4, kv_heads=2, head_dim=D, seed=10)
    mask = _key_mask("keys", 1, 4, 40)[0].at[..., 0].set(True)  # [1, 1, S] for [T, N, H]
    got = jax.jit(functools.partial(sp.dot_product_attention, is_causal=True,
                                    return_residual=True))(q[0], k[0], v[0], mask=mask)
    want = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                     return_residual=True))(q[0], k[0], v[0], mask=mask)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, **tolerances(q.dtype))


def test_split_axis_hybrid_through_the_drop_in(make_qkv, tolerances):
    """``ulysses_size=`` reaches the hybrid on one axis, as in the global call (a split
    asked for is honoured, never dropped)."""
    q, k, v = make_qkv(batch=1, seq=64, heads=4, kv_heads=2, head_dim=D, seed=11)
    mesh = jax.make_mesh((8,), ("sp",))
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(sp.dot_product_attention, mesh=mesh, is_causal=True,
                                        strategy="hybrid", ulysses_size=4))(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, **tolerances(q.dtype))
    with pytest.raises(ValueError, match="ulysses_size"):
        sp.dot_product_attention(q, k, v, ulysses_size=4)  # needs a mesh


def test_dense_mask_and_bias_are_jax_nns_without_a_mesh(make_qkv, tolerances):
    q, k, v = make_qkv(batch=1, seq=32, heads=4, head_dim=D, seed=11)
    mask = np.random.default_rng(1).random((1, 4, 32, 32)) < 0.7
    mask[..., 0] = True
    mask, bias = jnp.asarray(mask), checks.normal((1, 1, 32, 32), seed=2)
    for got, want in zip(
            jax.jit(functools.partial(sp.dot_product_attention, return_residual=True))(
                q, k, v, bias, mask),
            jax.jit(functools.partial(jax.nn.dot_product_attention, return_residual=True))(
                q, k, v, bias, mask)):
        np.testing.assert_allclose(got, want, **tolerances(q.dtype))


# --- errors name the numbers and the way out ------------------------------------------------

def test_errors(make_qkv):
    q, k, v = make_qkv(batch=2, seq=32, heads=N, kv_heads=2, head_dim=D, seed=12)
    mesh = jax.make_mesh((8,), ("sp",))
    call = functools.partial(sp.dot_product_attention, mesh=mesh)
    q4, k4, v4 = make_qkv(batch=1, seq=32, heads=4, head_dim=D)
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by the ulysses axis "
                                         'size 8; use strategy="ring"'):
        call(q4, k4, v4, strategy="ulysses")
    with pytest.raises(ValueError, match=r"num_heads=2 is not divisible by the ulysses \(inner\) "
                                         "axis 'ici' of size 4"):
        sp.dot_product_attention(q4[:, :, :2], k4[:, :, :2], v4[:, :, :2], strategy="hybrid",
                                 mesh=jax.make_mesh((2, 4), ("dcn", "ici")),
                                 seq_axes=("dcn", "ici"))
    with pytest.raises(ValueError, match=r"per-head mask of shape \(2, 8, 1, 32\) runs each of "
                                         "the 8 heads.*use strategy='ring'"):
        call(q, k, v, mask=_key_mask("heads", 2, N, 32), strategy="ulysses")
    with pytest.raises(ValueError, match=r"dense mask of shape \(1, 8, 32, 32\) cannot be"):
        call(q, k, v, mask=jnp.ones((1, N, 32, 32), bool))
    with pytest.raises(ValueError, match=r"a bias of shape \(1, 1, 1, 32\) cannot be"):
        call(q, k, v, bias=jnp.zeros((1, 1, 1, 32)))
    with pytest.raises(ValueError, match="query length 32 and key/value length 16"):
        call(q, k[:, :16], v[:, :16])
    with pytest.raises(ValueError, match="implementation='xla' names a jax.nn kernel"):
        call(q, k, v, implementation="xla")
    with pytest.raises(ValueError, match=r"query_seq_lengths must be an integer array \(int32\)"):
        sp.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="mask must be boolean"):
        sp.dot_product_attention(q, k, v, mask=jnp.ones((2, 1, 1, 32), jnp.int32))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 3, 1, 32\) does not broadcast to "
                                         r"\[B, N, T, S\]=\(2, 8, 32, 32\)"):
        sp.dot_product_attention(q, k, v, mask=jnp.ones((2, 3, 1, 32), bool))
    with pytest.raises(ValueError, match="softcap= and sinks= are ours"):
        sp.dot_product_attention(q, k, v, mask=jnp.ones((1, 1, 32, 32), bool), softcap=5.0)
