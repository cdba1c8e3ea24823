"""The new masks (``chunk_size``, ``bidirectional_ids``, ``mask_fn``) at the entry points
above the global one: ``dot_product_attention``, ``prefill`` / ``decode`` (a prefix-LM
prompt prefilled bidirectionally and decoded causally, PaliGemma's loop), the Flax
``attention_fn`` and ``SelfAttention``, the example LM and the CLI's ``demo --mask``.

Outputs and gradients against :func:`jax_seqpar.core.reference.attention` in the
README's context (an Explicit mesh from ``jax.make_mesh((8,), ("sp",))`` inside
``jax.set_mesh``, unsharded inputs, ``jax.jit``, ``jax.grad``), and bad input refused
with a ``ValueError`` that names the numbers."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checks
from test_compile_once import compiles_per_call
import jax_seqpar
from jax_seqpar.api import inference
from jax_seqpar.core import reference

B, S, H, HKV, D = 2, 64, 4, 2, 8


def _every_third(q, kv):
    """A mask_fn no family covers: a key two tokens back is hidden."""
    return (q.positions - kv.positions) != 2


def _ids(batch=B, seq=S):
    """``int32[B, S]``: row 0 a prefix-LM prompt (positions 0..19 one id); row 1 two
    image-like spans (ids 1 and 2) amid causal text."""
    ids = np.zeros((batch, seq), np.int32)
    ids[0, :20] = 1
    ids[1, 5:17] = 1
    ids[1, 40:52] = 2
    return jnp.asarray(ids)


@pytest.fixture
def mesh():
    mesh = jax.make_mesh((8,), ("sp",))
    with jax.set_mesh(mesh):
        yield mesh


# --- dot_product_attention -----------------------------------------------------------

#: (name, keywords of dot_product_attention and of the reference, key/query lengths)
DROP_IN = {
    "chunked": dict(chunk_size=12),
    "prefix": dict(bidirectional_ids=True),
    "mask_fn": dict(mask_fn=_every_third),
    "all": dict(chunk_size=24, bidirectional_ids=True, mask_fn=_every_third, lengths=True),
}


def _drop_in_case(name):
    keywords = dict(DROP_IN[name])
    lengths = keywords.pop("lengths", False)
    if keywords.get("bidirectional_ids"):
        keywords["bidirectional_ids"] = _ids()
    kv_lengths = jnp.array([S, 41], jnp.int32) if lengths else None
    q_lengths = jnp.array([50, S], jnp.int32) if lengths else None
    return keywords, q_lengths, kv_lengths


def _segments_of(q_lengths, kv_lengths):
    """The reference's segment ids for jax.nn's lengths: masked keys 1, padded queries 2."""
    if kv_lengths is None:
        return {}
    below = lambda n: jnp.arange(S)[None] < n[:, None]  # noqa: E731
    return dict(segment_ids=jnp.where(below(q_lengths), 0, 2),
                kv_segment_ids=jnp.where(below(kv_lengths), 0, 1))


@pytest.mark.parametrize("name", checks.tiered(list(DROP_IN), lambda i: i == 3))
@pytest.mark.parametrize("with_mesh", checks.tiered([True, False], lambda i: i == 0))
def test_dot_product_attention_masks_match_reference(mesh, name, with_mesh, tolerances):
    keywords, q_lengths, kv_lengths = _drop_in_case(name)
    q, k, v = checks.normals([(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D)])
    ours = lambda q, k, v: jax_seqpar.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths, mesh=mesh if with_mesh else None,
        strategy="ring" if with_mesh else "auto", **keywords)
    ref = lambda q, k, v: reference.attention(  # noqa: E731
        q, k, v, causal=True, **_segments_of(q_lengths, kv_lengths), **keywords)
    checks.assert_matches(ours, ref, (q, k, v), tolerances)


@pytest.mark.parametrize("with_mesh", checks.tiered([True, False], lambda i: i == 1))
def test_dot_product_attention_per_head_mask_keeps_the_new_masks(mesh, with_mesh, tolerances):
    """A per-head key mask folds the heads into the batch: the bidirectional ids, the
    chunks and the mask_fn follow every head."""
    q, k, v = checks.normals([(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D)])
    keep = np.random.default_rng(1).random((B, H, 1, S)) > 0.2
    ids = _ids()
    ours = lambda q, k, v: jax_seqpar.dot_product_attention(  # noqa: E731
        q, k, v, mask=jnp.asarray(keep), is_causal=True, chunk_size=24, bidirectional_ids=ids,
        mask_fn=_every_third, mesh=mesh if with_mesh else None,
        strategy="ring" if with_mesh else "auto")

    def ref(q, k, v):
        heads = [reference.attention(
            q[:, :, h:h + 1], k[:, :, h // (H // HKV)][:, :, None],
            v[:, :, h // (H // HKV)][:, :, None], causal=True, chunk_size=24,
            bidirectional_ids=ids, mask_fn=_every_third, segment_ids=jnp.zeros((B, S), jnp.int32),
            kv_segment_ids=jnp.where(keep[:, h, 0], 0, 1)) for h in range(H)]
        return jnp.concatenate(heads, axis=2)

    checks.assert_matches(ours, ref, (q, k, v), tolerances)


# --- prefill and decode ----------------------------------------------------------------

def _stream(tokens, seed=0):
    """q, k, v of every position each row will ever hold: ``[B, tokens, ., D]``."""
    return checks.normals([(B, tokens, H, D), (B, tokens, HKV, D), (B, tokens, HKV, D)],
                          seed=seed)


def _cache(mesh, capacity=48):
    return inference.KVCache.create(mesh, batch=B, capacity=capacity, num_kv_heads=HKV,
                                    head_dim=D, dtype=jnp.float32)


def test_prefix_lm_prefilled_bidirectionally_then_decoded_token_by_token(mesh, tolerances):
    """PaliGemma's loop: the prompt (image + prefix, one bidirectional id) prefilled, then
    one causal token a step; every output equals attention over the whole sequence with
    the prefix bidirectional, ragged rows included, and the decode step compiles once."""
    prompt, new = 24, 6
    lengths = np.array([24, 13])
    q, k, v = _stream(prompt + new)
    ids = np.zeros((B, prompt + new), np.int32)
    ids[0, :16], ids[1, :9] = 1, 1  # each row's prefix; the rest (and padding) causal
    prompt_ids = ids[:, :prompt].copy()
    prompt_ids[1, lengths[1]:] = 1  # the padding's ids must not matter
    expected = np.asarray(reference.attention(q, k, v, causal=True,
                                              bidirectional_ids=jnp.asarray(ids)))
    # row b's decoded tokens sit at lengths[b] + t: the stream shifted per row
    at = lambda x, t: x[np.arange(B), lengths + t][:, None]  # noqa: E731

    out, cache = jax.jit(inference.prefill)(q[:, :prompt], k[:, :prompt], v[:, :prompt],
                                            _cache(mesh), seq_lengths=jnp.asarray(lengths),
                                            bidirectional_ids=jnp.asarray(prompt_ids))
    for b in range(B):
        np.testing.assert_allclose(out[b, :lengths[b]], expected[b, :lengths[b]],
                                   **tolerances(jnp.float32))
    decode = jax.jit(inference.decode)
    state, outs = [cache], []

    def step():
        t = len(outs)
        out, state[0] = decode(at(q, t), at(k, t), at(v, t), state[0])
        outs.append(out)
        return out

    assert compiles_per_call(step, times=new)[1:] == [0] * (new - 1)
    for t, out in enumerate(outs):
        np.testing.assert_allclose(out, at(expected, t), **tolerances(jnp.float32),
                                   err_msg=f"decode step {t}")


@pytest.mark.parametrize("name", checks.tiered(["chunked-mask_fn", "image"],
                                               lambda i: False))
def test_decode_with_chunks_mask_fn_or_bidirectional_new_tokens(mesh, name, tolerances):
    """chunk_size: a new token sees only the cached keys of its chunk; mask_fn: on the
    cache's positions; bidirectional ids of new tokens (an image appended over two steps):
    every step equals attention over the sequence so far."""
    prompt, new = 20, 4
    q, k, v = _stream(prompt + new, seed=2)
    if name == "image":
        ids = np.zeros((B, prompt + new), np.int32)
        ids[:, prompt:] = 3
        ids = jnp.asarray(ids)
        mask = lambda part: dict(bidirectional_ids=ids[:, part])  # noqa: E731
        prefill_mask = {}
    else:
        mask = lambda part: dict(chunk_size=9, mask_fn=_every_third)  # noqa: E731
        prefill_mask = mask(None)
    out, cache = inference.prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], _cache(mesh),
                                   **prefill_mask)
    expected = reference.attention(q[:, :prompt], k[:, :prompt], v[:, :prompt], causal=True,
                                   **prefill_mask)
    np.testing.assert_allclose(out, expected, **tolerances(jnp.float32))
    for start in range(prompt, prompt + new, 2):  # two steps of T=2
        part, so_far = slice(start, start + 2), slice(0, start + 2)
        out, cache = inference.decode(q[:, part], k[:, part], v[:, part], cache, **mask(part))
        expected = reference.attention(q[:, so_far], k[:, so_far], v[:, so_far], causal=True,
                                       **mask(so_far))[:, part]
        np.testing.assert_allclose(out, expected, **tolerances(jnp.float32),
                                   err_msg=f"step at {start}")


# --- Flax ------------------------------------------------------------------------------

def test_flax_attention_fn_takes_chunks_mask_fn_and_bidirectional_ids(mesh, tolerances):
    """chunk_size and mask_fn configure the attention_fn; bidirectional ids come per call,
    like segment ids."""
    from jax_seqpar.flax import make_attention_fn

    attention_fn = make_attention_fn(mesh, strategy="ring", causal=True, chunk_size=24,
                                     mask_fn=_every_third)
    ids, segments = _ids(), checks.segments(B, S)
    q, k, v = checks.normals([(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D)])
    ours = lambda q, k, v: attention_fn(q, k, v, segment_ids=segments,  # noqa: E731
                                        bidirectional_ids=ids)
    ref = lambda q, k, v: reference.attention(  # noqa: E731
        q, k, v, causal=True, chunk_size=24, mask_fn=_every_third, segment_ids=segments,
        bidirectional_ids=ids)
    checks.assert_matches(ours, ref, (q, k, v), tolerances)


def _layer(mesh, **options):
    from flax import nnx

    from jax_seqpar.flax import SelfAttention

    return SelfAttention(32, H, num_kv_heads=HKV, mesh=mesh, causal=True, rngs=nnx.Rngs(0),
                         **options)


@pytest.mark.matrix
def test_flax_layer_sharded_equals_unsharded_and_decodes_a_prefix_lm(mesh, tolerances):
    """SelfAttention(chunk_size=, mask_fn=) with bidirectional ids per call: the sharded
    layer and its gradients equal the unsharded one's; prefilled with the prefix's ids
    and decoded token by token (the layer keeps its chunks), it equals the full call."""
    from flax import nnx

    options = dict(chunk_size=24, mask_fn=_every_third)
    sharded, local = _layer(mesh, **options), _layer(None, **options)
    x = checks.normal((B, S, 32), seed=4)
    ids = _ids()

    def loss(layer, x):
        return jnp.sum(layer(x, bidirectional_ids=ids) ** 2)

    grad = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
    (value, (params, dx)), (want, (want_params, want_dx)) = grad(sharded, x), grad(local, x)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(dx, want_dx, **tolerances(jnp.float32, "grad"))
    for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        checks.assert_gradient_close(got, expected, tolerances(jnp.float32, "grad"))

    prompt = 40
    prefix = jnp.where(jnp.arange(S)[None] < 12, 1, 0).astype(jnp.int32) * jnp.ones((B, 1),
                                                                                    jnp.int32)
    full = sharded(x, bidirectional_ids=prefix)
    sharded.init_cache(B, 48, dtype=jnp.float32)
    out = sharded.prefill(x[:, :prompt], bidirectional_ids=prefix[:, :prompt])
    np.testing.assert_allclose(out, full[:, :prompt], **tolerances(jnp.float32))
    for t in range(prompt, prompt + 3):
        np.testing.assert_allclose(sharded.decode(x[:, t:t + 1]), full[:, t:t + 1],
                                   **tolerances(jnp.float32), err_msg=f"position {t}")


# --- the example LM and the CLI --------------------------------------------------------

def test_masked_batches_carry_ids_and_hide_what_a_token_sees():
    from jax_seqpar.examples import training_batches

    plain = training_batches(steps=1, batch=2, seq_len=64, seed=0)
    for mask in ("prefix", "vlm"):
        data = training_batches(steps=1, batch=2, seq_len=64, seed=0, mask=mask)
        ids = data.bidirectional_ids
        assert ids.shape == (1, 2, 64) and ids.dtype == np.int32 and (ids > 0).any()
        np.testing.assert_array_equal(data.tokens, plain.tokens)
        sees_target = (ids[..., :-1] != 0) & (ids[..., 1:] == ids[..., :-1])
        assert sees_target.any() and not data.weights[..., :-1][sees_target].any(), mask
        np.testing.assert_array_equal(data.weights[..., :-1][~sees_target],
                                      plain.weights[..., :-1][~sees_target])
    prefix = training_batches(steps=1, batch=2, seq_len=64, seed=0, mask="prefix")
    first = prefix.segment_ids[0, :, 0]  # each row's first document opens on a prefix
    assert (prefix.bidirectional_ids[0, :, 0] == 1).all(), first
    assert training_batches(steps=1, batch=2, seq_len=64, seed=0,
                            mask="chunked").bidirectional_ids is None


@pytest.mark.matrix
@pytest.mark.parametrize("mask", ["chunked", "prefix", "vlm"])
def test_sharded_training_with_a_mask_matches_unsharded(mask):
    """The example LM trained with each mask: the ring over 8 devices (zigzag batches,
    ids permuted with the tokens) at the unsharded run's losses."""
    import dataclasses

    from jax_seqpar.examples import (ModelConfig, Parallelism, TrainConfig, init_params,
                                     mesh_for, train, training_batches)

    model = ModelConfig(d_model=32, num_layers=2, num_heads=8, num_kv_heads=2, mlp_hidden=64,
                        global_every=2, chunk_size=16 if mask == "chunked" else None)
    config = TrainConfig(steps=3, batch=2, seq_len=64, warmup_steps=1, peak_learning_rate=1e-2)
    data = training_batches(steps=3, batch=2, seq_len=64, seed=0, mask=mask)
    params = init_params(model, config.seed)
    unsharded = train(model, config, params=params, data=data)
    mesh, seq_axes = mesh_for("ring")
    sharded = train(model, config, Parallelism(mesh, seq_axes, "ring"), params=params,
                    data=data)
    np.testing.assert_allclose(sharded.losses, unsharded.losses, rtol=1e-4)
    plain = train(dataclasses.replace(model, chunk_size=None), config, params=params,
                  data=dataclasses.replace(data, bidirectional_ids=None))
    assert np.abs(plain.losses - unsharded.losses).max() > 1e-3  # the mask mattered


def test_cli_demo_takes_every_mask(capsys):
    from jax_seqpar.examples import MASKS
    from jax_seqpar.tools.cli import build_parser

    parser = build_parser()
    for mask in MASKS:
        assert parser.parse_args(["demo", "--mask", mask]).mask == mask
    assert parser.parse_args(["demo"]).mask is None
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--mask", "diagonal"])
    assert "invalid choice" in capsys.readouterr().err


# --- bad input -------------------------------------------------------------------------

def _qkv(seq=S):
    return checks.normals([(B, seq, H, D), (B, seq, HKV, D), (B, seq, HKV, D)])


def _wrong_shape(q, kv):
    return jnp.ones((3,), bool)


def _not_bool(q, kv):
    return q.positions - kv.positions


BAD = [
    pytest.param(dict(bidirectional_ids=jnp.zeros((B, 32), jnp.int32)),
                 r"bidirectional_ids must have shape \[batch.*\]=\(2, 64\).*\(2, 32\)",
                 id="ids-shape"),
    pytest.param(dict(bidirectional_ids=jnp.zeros((B, S), jnp.float32)),
                 "bidirectional_ids must be an integer array", id="ids-float"),
    pytest.param(dict(chunk_size=0), "chunk_size must be a positive int.*chunk_size=0",
                 id="chunk-0"),
    pytest.param(dict(chunk_size=-8), "chunk_size=-8", id="chunk-negative"),
    pytest.param(dict(chunk_size=2.5), "chunk_size=2.5", id="chunk-float"),
    pytest.param(dict(mask_fn="causal"), "mask_fn must be a callable", id="mask_fn-str"),
    pytest.param(dict(mask_fn=_wrong_shape), r"\[2, 64, 64\].*bool\[3\]",
                 id="mask_fn-shape"),
    pytest.param(dict(mask_fn=_not_bool), r"booleans.*int32\[2, 64, 64\]", id="mask_fn-int"),
]


@pytest.mark.parametrize("keywords,message", BAD)
@pytest.mark.parametrize("entry", ["dot_product_attention", "prefill", "attention_fn"])
def test_bad_mask_arguments_are_refused_at_every_entry_point(mesh, entry, keywords, message):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=message):
        if entry == "dot_product_attention":
            jax_seqpar.dot_product_attention(q, k, v, is_causal=True, mesh=mesh, **keywords)
        elif entry == "prefill":
            inference.prefill(q, k, v, _cache(mesh, capacity=64), **keywords)
        else:
            from jax_seqpar.flax import make_attention_fn

            ids = keywords.pop("bidirectional_ids", None)
            make_attention_fn(mesh, causal=True, **keywords)(q, k, v, bidirectional_ids=ids)


@pytest.mark.parametrize("keywords,message", [
    (dict(bidirectional_ids=jnp.zeros((B, 2), jnp.int32)),
     r"bidirectional_ids must have shape \[batch, seq\]=\(2, 1\).*\(2, 2\)"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(mask_fn=_wrong_shape), r"\[2, 1, 48\]"),
], ids=["ids-shape", "chunk-0", "mask_fn-shape"])
def test_bad_mask_arguments_are_refused_by_decode(mesh, keywords, message):
    q, k, v = _qkv(seq=1)
    cache = _cache(mesh)
    with pytest.raises(ValueError, match=message):
        inference.decode(q, k, v, cache, **keywords)
    assert int(cache.length.max()) == 0  # nothing written


def test_bidirectional_ids_need_a_causal_mask_and_one_sequence(mesh):
    q, k, v = _qkv()
    ids = _ids()
    with pytest.raises(ValueError, match="is_causal=True"):
        jax_seqpar.dot_product_attention(q, k, v, bidirectional_ids=ids)
    with pytest.raises(ValueError, match="query length 64 and key/value length 32"):
        jax_seqpar.dot_product_attention(q, k[:, :32], v[:, :32], is_causal=True,
                                          bidirectional_ids=ids)
    with pytest.raises(ValueError, match="chunk_size=, bidirectional_ids= cannot combine with a bias, a dense mask"):
        jax_seqpar.dot_product_attention(q, k, v, is_causal=True, chunk_size=8,
                                          bidirectional_ids=ids,
                                          mask=jnp.ones((B, 1, S, S), bool))
    with pytest.raises(ValueError, match="causal=True"):
        inference.prefill(q, k, v, _cache(mesh, capacity=64), causal=False,
                          bidirectional_ids=ids)
    from jax_seqpar.flax import SelfAttention, make_attention_fn
    from flax import nnx

    with pytest.raises(ValueError, match="chunk_size=0"):
        make_attention_fn(mesh, causal=True, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size=-1"):
        SelfAttention(32, H, causal=True, chunk_size=-1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mask_fn must be a callable"):
        SelfAttention(32, H, causal=True, mask_fn=3, rngs=nnx.Rngs(0))


@pytest.mark.matrix
def test_generation_of_a_chunked_prefix_lm_matches_the_full_model():
    """generate(prefix_lengths=) prefills each row's prefix bidirectionally (PaliGemma)
    and decodes causally from the sharded cache, the local layers in chunks: the same
    greedy tokens as the full model over the whole sequence at every step."""
    from flax import nnx

    from jax_seqpar.examples import ModelConfig, Parallelism, TransformerLM, init_params
    from jax_seqpar.examples._generate import generate, generate_unsharded_reference

    config = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         mlp_hidden=64, chunk_size=8, global_every=2)
    params = init_params(config, 0)
    prompts = np.random.default_rng(0).integers(0, 256, (2, 20)).astype(np.int32)
    lengths, prefix = np.array([20, 9], np.int32), np.array([12, 5], np.int32)
    unsharded = TransformerLM(config, rngs=nnx.Rngs(0))
    nnx.update(unsharded, params)
    expected = generate_unsharded_reference(unsharded, prompts, lengths, num_tokens=8,
                                            prefix_lengths=prefix)
    model = TransformerLM(config, Parallelism(jax.make_mesh((8,), ("sp",)), "sp", "ring"),
                          rngs=nnx.Rngs(0))
    nnx.update(model, params)
    result = generate(model, prompts, lengths, num_tokens=8, prefix_lengths=prefix)
    np.testing.assert_array_equal(result.tokens, expected)
    with pytest.raises(ValueError, match="prefix_lengths must be int32"):
        generate(model, prompts, lengths, num_tokens=8, prefix_lengths=np.array([21, 0]))


# --- issue 40's audit: a predicate on the fields the call has; its constants; NaN that
# --- no query can see -----------------------------------------------------------------

def _args(seq=32, heads=H):
    return tuple(checks.normals([(B, seq, heads, D), (B, seq, HKV, D), (B, seq, HKV, D)]))


def _zero_bidirectional_ids(q, kv):
    """Every pair whose query carries bidirectional id 0: all of them when none are given
    (documented: read as zeros), so the call is plain causal."""
    return q.bidirectional_ids == 0


def _always(q, kv):
    return True


@pytest.mark.parametrize("mesh_or_not", ["local", "ring"])
@pytest.mark.parametrize("mask_fn, causal", [(_zero_bidirectional_ids, True),
                                             (_always, False)], ids=["bid0", "true"])
def test_mask_fn_sees_the_fields_the_call_has(mesh_or_not, mask_fn, causal, tolerances):
    """A predicate reading ``bidirectional_ids`` of a call given none reads zeros (it read
    ``None == 0``: False, every row zero), and one returning Python ``True`` keeps every
    pair (it crashed in the kernel): outputs and gradients equal the reference's."""
    args = _args()
    where = {} if mesh_or_not == "local" else dict(mesh=jax.make_mesh((8,), ("sp",)),
                                                   strategy="ring")
    checks.assert_matches(
        lambda q, k, v: jax_seqpar.sequence_parallel_attention(
            q, k, v, causal=causal, mask_fn=mask_fn, **where),
        lambda q, k, v: reference.attention(q, k, v, causal=causal), args, tolerances)


_TABLE = jnp.asarray(np.random.default_rng(0).random((32, 32)) < 0.6) | jnp.eye(32, dtype=bool)


def _table_mask(q, kv):
    """A mask from a constant table the predicate closes over."""
    return _TABLE[q.positions, kv.positions]


@pytest.mark.parametrize("mesh_or_not", ["local", "ring"])
@pytest.mark.parametrize("kernel", ["auto", "xla"])
def test_mask_fn_holding_a_table_works_with_every_kernel_choice(mesh_or_not, kernel,
                                                                tolerances):
    """A predicate closing over a ``jnp`` table: ``kernel="auto"`` runs it (it failed on
    CPU: ``pallas_call ... captures constants``, the Pallas branches being traced too),
    as ``"xla"`` does; outputs and gradients equal the reference's."""
    args = _args()
    where = {} if mesh_or_not == "local" else dict(mesh=jax.make_mesh((8,), ("sp",)),
                                                   strategy="ring")
    checks.assert_matches(
        lambda q, k, v: jax_seqpar.sequence_parallel_attention(
            q, k, v, causal=True, mask_fn=_table_mask, kernel=kernel, **where),
        lambda q, k, v: reference.attention(q, k, v, causal=True, mask_fn=_table_mask),
        args, tolerances)


_CALLS = {"local": None, "ring": dict(strategy="ring"), "ulysses": dict(strategy="ulysses"),
          "allgather": dict(strategy="allgather"),
          "hybrid": dict(strategy="hybrid", ulysses_size=2)}


@pytest.mark.parametrize("kernel", ["xla", pytest.param("pallas", marks=pytest.mark.interpret)])
@pytest.mark.parametrize("call", list(_CALLS))
def test_padding_values_never_reach_an_output(call, kernel, tolerances):
    """NaN in the q, k and v of padding tokens (segment id ``PAD_SEGMENT``), which no
    query sees: the real rows equal the reference's without them, the padding rows are
    zero, and every gradient is finite (padding's zero). NaN values made every real row
    NaN (``0 * NaN`` in ``P @ V``)."""
    seq, pad = 32, 6
    q, k, v = _args(seq, heads=8)  # Ulysses splits the heads over the 8 devices
    ids = np.zeros((B, seq), np.int32)
    ids[:, 14:] = 1
    ids[:, seq - pad:] = jax_seqpar.core.masks.PAD_SEGMENT
    ids = jnp.asarray(ids)
    poison = lambda x: x.at[:, seq - pad:].set(jnp.nan)  # noqa: E731
    where = {} if _CALLS[call] is None else dict(mesh=jax.make_mesh((8,), ("sp",)),
                                                 **_CALLS[call])

    def ours(q, k, v):
        return jax_seqpar.sequence_parallel_attention(
            poison(q), poison(k), poison(v), causal=True, segment_ids=ids, kernel=kernel,
            **where)

    def clean(q, k, v):  # the reference on the real tokens; padding rows zero
        out = reference.attention(q, k, v, causal=True, segment_ids=ids)
        return out.at[:, seq - pad:].set(0.0)

    out, grads = checks.assert_matches(ours, clean, (q, k, v), tolerances)
    np.testing.assert_array_equal(np.asarray(out[:, seq - pad:]), 0)
    for grad in grads:
        assert np.isfinite(np.asarray(grad)).all()


#: What a document's tokens hold in the test below: NaN or inf values, or inf keys and
#: NaN values.
_BAD = {"nan_values": dict(v=np.nan), "inf_values": dict(v=np.inf),
        "keys_and_values": dict(k=np.inf, v=np.nan)}


@pytest.mark.parametrize("kernel", ["xla", pytest.param("pallas", marks=pytest.mark.interpret)])
@pytest.mark.parametrize("bad", list(_BAD))
@pytest.mark.parametrize("call", list(_CALLS))
def test_a_document_s_non_finite_values_stay_in_its_rows(call, bad, kernel, tolerances):
    """Three packed documents, the middle one's values non-finite: the other documents'
    rows equal the reference's with those values at zero, and so do their gradients (q,
    k and v); the middle document's rows and gradients are NaN (a query that sees a
    non-finite value gets a NaN row). ``0 * NaN`` in ``P @ V`` (and in the backward's
    products) put NaN in 20-44 rows of the other documents."""
    seq = 32
    q, k, v = _args(seq, heads=8)  # Ulysses splits the heads over the 8 devices
    ids = np.zeros((B, seq), np.int32)
    ids[0, 9:20], ids[0, 20:] = 1, 2
    ids[1, 14:27], ids[1, 27:] = 1, 2
    doc = jnp.asarray(ids == 1)[:, :, None, None]
    ids = jnp.asarray(ids)
    where = {} if _CALLS[call] is None else dict(mesh=jax.make_mesh((8,), ("sp",)),
                                                 **_CALLS[call])

    def ours(q, k, v):
        # Added, not selected: the gradients of the poisoned tokens are the kernel's.
        poisoned = [x + jnp.where(doc, _BAD[bad].get(name, 0.0), 0.0)
                    for name, x in zip("qkv", (q, k, v))]
        return jax_seqpar.sequence_parallel_attention(*poisoned, causal=True, segment_ids=ids,
                                                      kernel=kernel, **where)

    def clean(q, k, v):
        return reference.attention(q, k, jnp.where(doc, 0.0, v), causal=True, segment_ids=ids)

    cotangent = checks.normal((B, seq, 8, D), seed=7)
    out, grads = checks.out_and_vjp(ours, (q, k, v), cotangent)
    expected, expected_grads = checks.out_and_vjp(clean, (q, k, v), cotangent)
    rows = np.asarray(doc[:, :, 0, 0])
    for got, want, kind in zip((out, *grads), (expected, *expected_grads),
                               ("out", "grad", "grad", "grad")):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got[~rows], want[~rows], **tolerances(q.dtype, kind))
        assert np.isnan(got[rows]).all()


def test_the_reference_keeps_non_finite_values_in_the_rows_that_see_them():
    """The oracle's contract: a query that sees a non-finite value gets a NaN row (its
    lse, of q and k, stays finite); the other rows equal those with the values at zero
    (``0 * NaN`` in its ``P @ V`` put NaN in every row of the batch row)."""
    q, k, v = _args()
    ids = jnp.asarray(np.repeat([[0] * 10 + [1] * 12 + [2] * 10], B, axis=0), jnp.int32)
    doc = (ids == 1)[:, :, None, None]
    out, lse = reference.attention(q, k, jnp.where(doc, np.nan, v), causal=True,
                                   segment_ids=ids, return_lse=True)
    clean, clean_lse = reference.attention(q, k, jnp.where(doc, 0.0, v), causal=True,
                                           segment_ids=ids, return_lse=True)
    rows = np.asarray(doc[:, :, 0, 0])
    np.testing.assert_array_equal(np.asarray(out)[~rows], np.asarray(clean)[~rows])
    assert np.isnan(np.asarray(out)[rows]).all()
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))
