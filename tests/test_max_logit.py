"""``return_max_logit=True`` (issue 42, item 6; QK-Clip): per head, the largest scaled
logit ``scale * q.k`` (before the soft-cap) of any visible pair over the batch and the
sequence, from every entry point and strategy, against
:func:`jax_seqpar.core.reference.max_logit`.

The kernel's logits and the reference's are the same float32 products summed in another
order, so they agree to a few ulps (``RTOL``), not bit for bit. Every input puts the
largest raw logit of some head on a pair the mask hides (:func:`_hidden_peak`), so a mask
that were not applied, or a maximum taken after the soft-cap, would fail.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import checks
import jax_seqpar
from test_compile_once import compiles_per_call
from jax_seqpar.core import quant, reference
from jax_seqpar.core.masks import PAD_SEGMENT, Tokens

B, S, H, HKV, D = 2, 64, 16, 4, 8
RTOL = 2e-6  # a few float32 ulps: the products summed in another order


def _hidden_peak(q, k, *, query=0, key=S - 1):
    """q, k with one pair (``query`` -> ``key`` in every row, head 0) of logit far above
    all others: causal masks and windows hide it (key after query), documents too when
    they differ."""
    k = k.at[:, key, 0].set(8.0 * q[:, query, 0])
    return q, k


def _inputs(dtype=jnp.float32, seed=0):
    q, k, v = checks.normals([(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D)], seed=seed)
    q, k = _hidden_peak(q, k)
    return tuple(x.astype(dtype) for x in (q, k, v))


def _assert_max_logit(got, want, *, rtol=RTOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape == (want.shape[0],) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


def _documents():
    ids = np.zeros((B, S), np.int32)
    ids[:, S // 2:] = 1  # the peak pair (0 -> S-1) crosses documents
    ids[1, S // 4:] += 1
    return jnp.asarray(ids)


def _bidirectional():
    ids = np.zeros((B, S), np.int32)
    ids[:, 4:12] = 1  # a prefix seen both ways
    return jnp.asarray(ids)


def _even_keys(q_tokens: Tokens, kv_tokens: Tokens):
    return kv_tokens.positions % 2 == 0


#: Mask families, each keyword set of the global call and of the reference.
MASKS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(9, 0)),
    "chunk": dict(causal=True, chunk_size=16),
    "documents": dict(segment_ids=_documents()),
    "bidirectional": dict(causal=True, bidirectional_ids=_bidirectional()),
    "mask_fn": dict(mask_fn=_even_keys),
    "softcap": dict(causal=True, softcap=1.5),
    "chunk-in-shard": dict(causal=True, chunk_size=8),  # reach (0, 0): no exchange
    "sinks": dict(causal=True, sinks=jnp.full((H,), 50.0)),  # no pairs: never reported
}

#: (strategy, pipelining keywords) of the global call: every form a strategy runs in.
FORMS = {
    "ring": ("ring", {}),
    "allgather": ("allgather", {}),
    "allgather-pieces": ("allgather", dict(pieces=2)),
    "ulysses-pieces": ("ulysses", dict(pieces=2)),
    "ulysses-groups": ("ulysses", dict(head_groups=2)),
    "ulysses-whole": ("ulysses", dict(overlap=False)),
    "hybrid-pieces": ("hybrid", dict(pieces=2)),
    "hybrid-groups": ("hybrid", dict(head_groups=2)),
}

#: Each form causal (the full exchange), windowed and with two more mask families (every
#: family at least once over the forms); the window and the chunks on the contiguous
#: split make the ring, the all-gather and the hybrid's ring halo exchanges, chunks that
#: fit a shard local attention.
CASES = [(form, mask) for i, form in enumerate(FORMS)
         for mask in dict.fromkeys(("causal", "window", list(MASKS)[i % len(MASKS)],
                                   list(MASKS)[(i + 3) % len(MASKS)]))]


@pytest.mark.parametrize("form,mask", CASES)
def test_strategies_return_the_reference_max_logit(form, mask):
    strategy, pipelining = FORMS[form]
    mesh, seq_axes = checks.strategy_mesh(strategy)
    q, k, v = _inputs()
    kw = MASKS[mask]
    out, lse, high = jax_seqpar.sequence_parallel_attention(
        q, k, v, mesh=mesh, seq_axes=seq_axes, strategy=strategy, return_lse=True,
        return_max_logit=True, **pipelining, **kw)
    want_out, want_lse, want = reference.attention(q, k, v, return_lse=True,
                                                   return_max_logit=True, **kw)
    _assert_max_logit(high, want)
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)
    # The hidden peak is not what it reports (head 0's peak is far above every other pair).
    raw = float(jnp.max(jnp.einsum("bqd,bkd->bqk", q[..., 0, :], k[..., 0, :]))) * D ** -0.5
    assert float(high[0]) < raw


def test_the_mask_hides_the_largest_raw_logit():
    """Without the mask the peak is reported; with causal it is not (the feature broken
    to ignore the mask would report it)."""
    q, k, v = _inputs()
    unmasked = jax_seqpar.sequence_parallel_attention(q, k, v, return_max_logit=True)[1]
    causal = jax_seqpar.sequence_parallel_attention(q, k, v, causal=True,
                                                    return_max_logit=True)[1]
    raw = jnp.einsum("bqhd,bkhd->bhqk", q[:, :, :1], k[:, :, :1]).max() * D ** -0.5
    np.testing.assert_allclose(unmasked[0], raw, rtol=RTOL)
    assert float(causal[0]) < 0.5 * float(raw)
    _assert_max_logit(causal, reference.max_logit(q, k, v, causal=True))


@pytest.mark.parametrize("mask", list(MASKS))
def test_local_call_every_mask(mask):
    q, k, v = _inputs()
    kw = MASKS[mask]
    out, high = jax_seqpar.sequence_parallel_attention(q, k, v, return_max_logit=True, **kw)
    _assert_max_logit(high, reference.max_logit(q, k, v, **kw))
    np.testing.assert_allclose(out, reference.attention(q, k, v, **kw), rtol=2e-5, atol=2e-5)


def test_softcap_reports_the_logit_before_the_cap():
    q, k, v = _inputs()
    high = jax_seqpar.sequence_parallel_attention(q, k, v, softcap=0.5,
                                                  return_max_logit=True)[1]
    plain = jax_seqpar.sequence_parallel_attention(q, k, v, return_max_logit=True)[1]
    np.testing.assert_array_equal(high, plain)
    assert float(high.max()) > 0.5  # above the cap: not the capped logit


def test_bfloat16_inputs():
    q, k, v = _inputs(jnp.bfloat16)
    mesh, _ = checks.strategy_mesh("ring")
    for strategy in ("ring", "ulysses"):
        high = jax_seqpar.sequence_parallel_attention(
            q, k, v, mesh=mesh, strategy=strategy, causal=True, return_max_logit=True)[1]
        _assert_max_logit(high, reference.max_logit(q, k, v, causal=True))


@pytest.mark.parametrize("form", ["ring", "ulysses-pieces", "hybrid-groups"])
def test_fp8_max_logit_is_of_the_quantized_operands(form):
    """With an FP8 compute dtype the kernel's logits are those of the rotated, quantized
    q and k (K/V travel in FP8): the reference on those operands dequantized gives them
    (to float32 rounding of the per-token scales' products: 1e-5)."""
    q, k, v = _inputs()
    strategy, pipelining = FORMS[form]
    mesh, seq_axes = checks.strategy_mesh(strategy)
    high = jax_seqpar.sequence_parallel_attention(
        q, k, v, mesh=mesh, seq_axes=seq_axes, strategy=strategy, causal=True,
        compute_dtype=jnp.float8_e4m3fn, return_max_logit=True, **pipelining)[1]

    def dequantized(x):
        values, scales = quant.quantize(x @ quant.rotation(D), "float8_e4m3fn")
        return values.astype(jnp.float32) * scales[..., None]

    want = reference.max_logit(dequantized(q), dequantized(k), v, causal=True)
    _assert_max_logit(high, want, rtol=1e-5)
    exact = reference.max_logit(q, k, v, causal=True)
    assert not np.array_equal(np.asarray(high), np.asarray(exact))  # quantized, not exact


def test_no_gradient_and_the_output_gradients_unchanged():
    q, k, v = _inputs()
    mesh, _ = checks.strategy_mesh("ring")
    call = functools.partial(jax_seqpar.sequence_parallel_attention, mesh=mesh,
                             strategy="ring", causal=True)
    with jax.set_mesh(mesh):
        grads = jax.grad(lambda q, k: (call(q, k, v, return_max_logit=True)[0] ** 2).sum()
                         + call(q, k, v, return_max_logit=True)[1].sum(), (0, 1))(q, k)
        want = jax.grad(lambda q, k: (call(q, k, v) ** 2).sum(), (0, 1))(q, k)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "allgather", "hybrid"])
def test_per_shard_functions_pmax_over_the_sequence(strategy):
    functions = {"ring": jax_seqpar.ring_attention, "ulysses": jax_seqpar.ulysses_attention,
                 "allgather": jax_seqpar.allgather_attention,
                 "hybrid": jax_seqpar.hybrid_attention}
    mesh, seq_axes = checks.strategy_mesh(strategy)
    q, k, v = _inputs()
    spec = P(None, seq_axes)
    f = jax.shard_map(functools.partial(functions[strategy], seq_axes=seq_axes, causal=True,
                                        return_max_logit=True),
                      mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P()))
    out, high = jax.jit(f)(q, k, v)
    _assert_max_logit(high, reference.max_logit(q, k, v, causal=True))


def test_dot_product_attention():
    q, k, v = _inputs()
    mesh, _ = checks.strategy_mesh("ring")
    lengths = jnp.array([S, S // 2], jnp.int32)
    out, residual, high = jax_seqpar.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths, mesh=mesh,
        return_residual=True, return_max_logit=True)
    segments = jnp.where(jnp.arange(S)[None] < lengths[:, None], 0, 1).astype(jnp.int32)
    want = reference.max_logit(q, k, v, causal=True, segment_ids=jnp.zeros_like(segments),
                               kv_segment_ids=segments)
    _assert_max_logit(high, want)
    local = jax_seqpar.dot_product_attention(q, k, v, is_causal=True, return_max_logit=True)
    _assert_max_logit(local[1], reference.max_logit(q, k, v, causal=True))
    with pytest.raises(ValueError, match="return_max_logit"):
        jax_seqpar.dot_product_attention(q, k, v, bias=jnp.zeros((B, H, S, S)),
                                         return_max_logit=True)


def test_empty_head_and_empty_call_are_minus_inf():
    q, k, v = _inputs()
    ids = jnp.full((B, S), PAD_SEGMENT, jnp.int32)  # nothing visible
    high = jax_seqpar.sequence_parallel_attention(q, k, v, segment_ids=ids,
                                                  return_max_logit=True)[1]
    assert np.all(np.isneginf(np.asarray(high)))
    empty = jax_seqpar.sequence_parallel_attention(q[:, :0], k[:, :0], v[:, :0],
                                                   return_max_logit=True)[1]
    assert empty.shape == (H,) and np.all(np.isneginf(np.asarray(empty)))


def test_refusals():
    """A non-bool flag and the inference calls are refused; every kernel computes it
    (``kernel="pallas"`` / ``"mosaic"``: ``test_max_logit_kernels.py``)."""
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="return_max_logit"):
        jax_seqpar.sequence_parallel_attention(q, k, v, return_max_logit=1)
    cache = jax_seqpar.KVCache.create(checks.strategy_mesh("ring")[0], batch=B, capacity=S,
                                      num_kv_heads=HKV, head_dim=D)
    with pytest.raises(ValueError, match="prefill does not return the max logit"):
        jax_seqpar.prefill(q, k, v, cache, return_max_logit=True)
    with pytest.raises(ValueError, match="decode does not return the max logit"):
        jax_seqpar.decode(q[:, :1], k[:, :1], v[:, :1], cache, return_max_logit=True)


@pytest.mark.parametrize("entry", ["global", "local", "dot_product"])
def test_compiles_once(entry):
    q, k, v = _inputs()
    mesh, _ = checks.strategy_mesh("ring")
    calls = {
        "global": lambda: jax_seqpar.sequence_parallel_attention(
            q, k, v, mesh=mesh, strategy="ring", causal=True, return_max_logit=True),
        "local": lambda: jax_seqpar.sequence_parallel_attention(q, k, v, causal=True,
                                                                return_max_logit=True),
        "dot_product": lambda: jax_seqpar.dot_product_attention(
            q, k, v, is_causal=True, mesh=mesh, return_max_logit=True),
    }
    counts = compiles_per_call(calls[entry])
    assert counts[1:] == [0, 0], f"compilations per call: {counts}"


def test_flax_self_attention():
    from flax import nnx

    from jax_seqpar.flax import SelfAttention

    mesh, _ = checks.strategy_mesh("ring")
    layer = SelfAttention(32, 4, num_kv_heads=2, head_dim=8, causal=True, mesh=mesh,
                          strategy="ring", rngs=nnx.Rngs(0))
    x = checks.normal((B, S, 32))
    y, high = layer(x, return_max_logit=True)
    q, k, v = layer._projected_qkv(x, jnp.arange(S, dtype=jnp.int32))
    _assert_max_logit(high, reference.max_logit(q, k, v, causal=True))
    np.testing.assert_allclose(y, layer(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="max logit"):
        layer.init_cache(B, S)
        layer(x, decode=True, return_max_logit=True)


@pytest.mark.parametrize("split", [True, False], ids=["ring", "no-mesh"])
def test_batch_sharded_on_an_explicit_mesh(split):
    """Rows on different devices of a data axis: the max over every row (the global call:
    over the whole batch; the local path: a pmax over the batch's axis)."""
    q, k, v = _inputs()
    q = q.at[1, 3, 5].multiply(4.0)  # row 1's peak for head 5 lies on the second "dp" device
    mesh = jax.make_mesh((2, 4), ("dp", "sp"))
    with jax.set_mesh(mesh):
        placed = [jax.reshard(x, P("dp")) for x in (q, k, v)]
        call = functools.partial(jax_seqpar.sequence_parallel_attention, causal=True,
                                 return_max_logit=True)
        if split:
            call = functools.partial(call, mesh=mesh, strategy="ring")
        out, high = jax.jit(call)(*placed)
    assert out.sharding.spec[0] == "dp"
    _assert_max_logit(high, reference.max_logit(q, k, v, causal=True))


@pytest.mark.parametrize("form", ["ring", "ulysses-pieces", "ulysses-groups", "hybrid-groups"])
def test_the_only_bytes_added_are_one_all_reduce_of_heads(form):
    """Compiled, the call with the max logit sends what the call without it sends and
    one all-reduce of ``float32[H]`` (``2 (P-1)/P`` of its bytes): the ring's steps merge
    the maxima in their carry, Ulysses' pipelines send nothing for them."""
    from jax_seqpar.tools import hlo

    strategy, pipelining = FORMS[form]
    mesh, seq_axes = checks.strategy_mesh(strategy)
    q, k = jnp.ones((1, 256, H, D)), jnp.ones((1, 256, HKV, D))

    def sent(**keywords):
        f = functools.partial(jax_seqpar.sequence_parallel_attention, mesh=mesh,
                              seq_axes=seq_axes, strategy=strategy, causal=True,
                              layout="contiguous", **pipelining, **keywords)
        return hlo.collective_bytes(jax.jit(f).lower(q, k, k).compile())

    without, with_max = sent(), sent(return_max_logit=True)
    added = {kind: with_max[kind] - without[kind] for kind in without
             if with_max[kind] != without[kind]}
    assert added == {"all-reduce": 2 * 7 / 8 * H * 4}, added
