"""The mask families (chunked causal, prefix-LM, vision-language, a mask_fn) through every
strategy and the local path, outputs and gradients against ``core.reference``.

In the README's context: an Explicit mesh from ``jax.make_mesh((8,), ("sp",))``, under
``jax.set_mesh``, unsharded inputs, ``jax.jit`` of ``jax.value_and_grad`` of a loss. The
default tier runs each family through each strategy once at tiny shapes; the ``matrix``
tier crosses them with windows, sinks, softcap, GQA, odd lengths, layouts, an Auto mesh
and half precision. Also: ring steps whose shards share no visible pair run no kernel,
and bad mask arguments are refused by name at the global and per-shard entry points.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jax_seqpar as sp
from jax_seqpar.core import reference
from jax_seqpar.strategies.allgather import allgather_attention
from jax_seqpar.strategies.hybrid import hybrid_attention
from jax_seqpar.strategies.ring import ring_attention
from jax_seqpar.strategies.ulysses import ulysses_attention

import checks

#: The kernel the strategies run: the XLA kernel (the CPU's), named so that these tests
#: hold the strategies' part whatever the other platforms' kernels take.
KERNEL = "xla"
STRATEGIES = ("ring", "ulysses", "allgather", "hybrid", "local")
FAMILIES = ("chunked", "prefix_lm", "vlm", "mask_fn")


def _every_third_diagonal(q, kv):
    """A mask no family covers: keys at a distance of 1 mod 3 are hidden."""
    return (q.positions - kv.positions) % 3 != 1


def _family(name: str, batch: int, seq: int) -> dict:
    """The keywords of one mask family at ``[batch, seq]``: what the entry points and the
    reference both take (chunk sizes, documents and bidirectional spans that straddle
    the shards of 8 devices)."""
    if name == "chunked":  # Llama 4's local layers
        return dict(causal=True, chunk_size=max(3, seq // 5))
    if name == "prefix_lm":  # per document: its first tokens are the prompt, seen both ways
        documents = np.minimum(np.arange(seq) * 3 // seq, 2)
        start = np.searchsorted(documents, documents, side="left")
        bids = np.where(np.arange(seq) - start < max(2, seq // 8), documents + 1, 0)
        tile = lambda x: jnp.asarray(np.broadcast_to(x, (batch, seq)), jnp.int32)  # noqa: E731
        return dict(causal=True, segment_ids=tile(documents), bidirectional_ids=tile(bids))
    if name == "vlm":  # two images, one id each, in a causal text stream
        bids = np.zeros((batch, seq), np.int32)
        bids[:, seq // 8: seq // 8 + seq // 5] = 1
        bids[:, seq // 2: seq // 2 + seq // 4] = 7
        if batch > 1:
            bids[1] = np.roll(bids[1], 3)
        return dict(causal=True, bidirectional_ids=jnp.asarray(bids))
    assert name == "mask_fn"
    return dict(causal=True, mask_fn=_every_third_diagonal)


def _attention(strategy: str, mesh, **keywords):
    """``(q, k, v) -> out`` of ``strategy`` on ``mesh`` (``"local"``: no mesh; the hybrid
    over a one-axis mesh splits it with ``ulysses_size=2``, over two axes runs on both)."""
    if strategy == "local":
        return functools.partial(sp.sequence_parallel_attention, mesh=None, kernel=KERNEL,
                                 **keywords)
    extra = {}
    if strategy == "hybrid":
        extra = dict(ulysses_size=2) if len(mesh.axis_names) == 1 else dict(
            seq_axes=tuple(mesh.axis_names))
    return functools.partial(sp.sequence_parallel_attention, mesh=mesh, strategy=strategy,
                             kernel=KERNEL, **extra, **keywords)


def _check(strategy, keywords, tolerances, *, shape=(1, 32, 8, 2, 8), dtype=jnp.float32,
           mesh=None, sinks=False, softcap=None, layout=None, pipeline=None):
    """``strategy``'s output and the gradients of a loss w.r.t. q, k, v (and sinks)
    equal the reference's, under ``jax.set_mesh``, ``jit`` of ``value_and_grad``."""
    batch, seq, heads, kv_heads, dim = shape
    q, k, v = checks.normals([(batch, seq, heads, dim), (batch, seq, kv_heads, dim),
                              (batch, seq, kv_heads, dim)], dtype, seed=1)
    sink = jnp.linspace(-1.0, 1.0, heads, dtype=jnp.float32) if sinks else None
    extra = dict(softcap=softcap) if softcap is not None else {}
    ours_keywords = dict(keywords, **extra)
    if layout is not None:
        ours_keywords["layout"] = layout
    ours_keywords.update(pipeline or {})
    mesh = jax.make_mesh((8,), ("sp",)) if mesh is None else mesh
    attend = _attention(strategy, mesh, **ours_keywords)
    cotangent = checks.normal((batch, seq, heads, dim), jnp.float32, seed=3)

    def loss(function, q, k, v, sink):
        out = function(q, k, v, sinks=sink)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    with jax.set_mesh(mesh):
        (_, out), grads = jax.jit(jax.value_and_grad(functools.partial(loss, attend),
                                                     argnums, has_aux=True))(q, k, v, sink)
    upcast = checks.upcast((q, k, v))
    want_fn = functools.partial(reference.attention, **keywords, **extra)
    (_, want), want_grads = jax.jit(jax.value_and_grad(functools.partial(loss, want_fn),
                                                       argnums, has_aux=True))(*upcast, sink)
    args = (q, k, v, sink)
    checks.assert_close(out, grads, want, want_grads, tolerances, args=args, argnums=argnums)


#: Every (strategy, family); the default tier runs a covering subset (each strategy and
#: each family at least once, at ~2 s a compile), the matrix tier the rest.
_PAIRS = checks.tiered([(s, f) for s in STRATEGIES for f in FAMILIES],
                       keep=lambda i: i % len(FAMILIES) == (i // len(FAMILIES)) % len(FAMILIES))


@pytest.mark.parametrize("strategy,family", _PAIRS)
def test_mask_family_through_strategy(strategy, family, tolerances):
    """Each family through each strategy: out and gradients equal the reference's."""
    _check(strategy, _family(family, 1, 32), tolerances)


#: Matrix variants: (name, _check keywords, family keyword changes).
_VARIANTS = {
    "window": (dict(), dict(window=(5, 3))),
    "sinks_softcap": (dict(sinks=True, softcap=3.0), dict()),
    "gqa_batch": (dict(shape=(2, 32, 8, 1, 8)), dict()),
    "odd_length": (dict(shape=(1, 61, 8, 2, 8)), dict()),
    "zigzag": (dict(layout="zigzag"), dict()),
    "striped": (dict(layout="striped"), dict()),
    "per_document": (dict(layout="per_document"), dict()),
    "auto_mesh": (dict(mesh="auto"), dict()),
    "bfloat16": (dict(dtype=jnp.bfloat16), dict()),
    # Ulysses' pipelines: head groups (2 heads a device), sequence chunks; the hybrid over
    # two mesh axes.
    "head_groups": (dict(shape=(1, 32, 16, 4, 8), pipeline=dict(head_groups=2)), dict()),
    "sequence_chunks": (dict(shape=(1, 64, 8, 2, 8), pipeline=dict(overlap=True, chunks=2)),
                        dict()),
    "two_axes": (dict(mesh="two_axes"), dict()),
    "float16": (dict(dtype=jnp.float16), dict()),
}


def _applies(strategy: str, variant: str) -> bool:
    """Whether ``variant`` means something for ``strategy`` (the local path has no mesh,
    token order or pipeline; only Ulysses' exchange is pipelined, and only over one
    axis it chunks the sequence; only the hybrid runs over two axes)."""
    if strategy == "local" and variant in ("zigzag", "striped", "per_document", "auto_mesh",
                                           "head_groups", "sequence_chunks", "two_axes"):
        return False
    if variant == "head_groups":
        return strategy in ("ulysses", "hybrid")
    if variant == "sequence_chunks":
        return strategy == "ulysses"
    return variant != "two_axes" or strategy == "hybrid"


def _covering() -> list:
    """Each variant with each family once, the strategies taken in turn (shifted from one
    variant to the next, so every strategy meets every family and most variants): a
    quarter of the whole cross product, which the default tier's pairs complete."""
    triples = []
    for shift, variant in enumerate(sorted(_VARIANTS)):
        chosen = [s for s in STRATEGIES if _applies(s, variant)]
        for index, family in enumerate(FAMILIES):
            triples.append((chosen[(index + shift) % len(chosen)], family, variant))
    return triples


@pytest.mark.matrix
@pytest.mark.parametrize("strategy,family,variant", _covering())
def test_mask_family_matrix(strategy, family, variant, tolerances):
    """Each family through the strategies, crossed with one more feature each."""
    options, changes = _VARIANTS[variant]
    options = dict(options)
    shape = options.get("shape", (1, 32, 8, 2, 8))
    keywords = dict(_family(family, shape[0], shape[1]), **changes)
    if variant == "per_document" and "segment_ids" not in keywords:
        keywords["segment_ids"] = checks.segments(shape[0], shape[1], documents=3)
    if options.get("mesh") == "auto":
        options["mesh"] = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
    elif options.get("mesh") == "two_axes":
        options["mesh"] = jax.make_mesh((2, 4), ("dcn", "ici"))
    _check(strategy, keywords, tolerances, **options)


@pytest.mark.parametrize("strategy,family", checks.tiered(
    [("ring", "vlm"), ("allgather", "prefix_lm"), ("ring", "prefix_lm"), ("allgather", "vlm")],
    keep=lambda i: i < 1))
def test_causal_window_halo_fetches_the_right_side_with_bidirectional_ids(strategy, family,
                                                                          tolerances):
    """A causal window on the contiguous split exchanges a halo; with bidirectional ids a
    query sees later keys of its id (up to the window's right side), so the halo must
    bring the right neighbours' keys too (a causal halo of left keys only was wrong)."""
    keywords = dict(_family(family, 1, 64), window=(6, 6))
    _check(strategy, keywords, tolerances, shape=(1, 64, 8, 2, 8), layout="contiguous")


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


def test_per_shard_functions_take_the_mask_keywords(tolerances):
    """Inside ``shard_map``, each per-shard function takes ``chunk_size``,
    ``bidirectional_ids`` (sharded with the tokens) and ``mask_fn`` on the contiguous
    split: out and gradients equal the reference's."""
    batch, seq = 1, 32
    ids = _family("vlm", batch, seq)["bidirectional_ids"]
    keywords = dict(causal=True, chunk_size=11, mask_fn=_every_third_diagonal)
    q, k, v = checks.normals([(batch, seq, 8, 8), (batch, seq, 2, 8), (batch, seq, 2, 8)],
                             seed=5)
    cotangent = checks.normal((batch, seq, 8, 8), seed=6)
    expected, vjp = jax.vjp(lambda q, k, v: reference.attention(
        q, k, v, bidirectional_ids=ids, **keywords), q, k, v)
    want_grads = vjp(cotangent)
    one, two = jax.make_mesh((8,), ("sp",)), jax.make_mesh((2, 4), ("dcn", "ici"))
    for function, mesh, axes in ((ring_attention, one, "sp"), (ulysses_attention, one, "sp"),
                                 (allgather_attention, one, "sp"),
                                 (hybrid_attention, two, ("dcn", "ici"))):
        seq_spec = P(None, axes)

        def body(q, k, v, ids, function=function, axes=axes):
            return function(q, k, v, seq_axes=axes, bidirectional_ids=ids, kernel=KERNEL,
                            **keywords)

        mapped = jax.shard_map(body, mesh=mesh, in_specs=(seq_spec,) * 4, out_specs=seq_spec)

        def out_and_grads(q, k, v, mapped=mapped, seq_spec=seq_spec):
            q, k, v, placed = (jax.reshard(x, seq_spec) for x in (q, k, v, ids))
            out, vjp_ours = jax.vjp(lambda q, k, v: mapped(q, k, v, placed), q, k, v)
            return out, vjp_ours(jax.reshard(cotangent, seq_spec))

        with jax.set_mesh(mesh):
            out, grads = jax.jit(out_and_grads)(q, k, v)
        checks.assert_close(out, grads, expected, want_grads, tolerances, args=(q, k, v))


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
