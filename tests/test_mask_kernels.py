"""The new mask families on every local kernel (``xla``, ``pallas`` and ``mosaic``, the last
two in the Pallas interpreter), forward and backward, against
:func:`jax_seqpar.core.reference.attention`; the tiles the kernels compute; the calls
:class:`jax_seqpar.kernels.options.Options` skips whole.

Families (``tests/kernel_cases.py`` builds their tokens): Llama 4's chunked attention with
a chunk that is not a multiple of the tile, a prefix-LM prompt per document (bidirectional
ids with segment ids), images inside a causal row (several bidirectional ids in one row),
a ``mask_fn`` predicate (one not symmetric in queries and keys: the Mosaic dk/dv kernel
works on transposed tiles), and their combinations with documents, a window, soft-capping,
GQA/MQA, ragged lengths and padding (``PAD_SEGMENT``). The default tier runs a few on the
XLA kernel and one each on the interpreted kernels (:data:`DEFAULT`); the rest is the
``interpret`` tier (the XLA kernel's share of it runs in seconds).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import kernel_cases as kc
from checks import record_xla_tiles
from jax_seqpar.core import blocks
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar import kernels
from jax_seqpar.kernels import make_options, tiling, xla
from jax_seqpar.kernels.gpu import _core as gpu_core
from jax_seqpar.kernels.tpu import _common as tpu_common
from kernel_cases import Case

FAMILIES = [
    pytest.param(Case(q_len=48, causal=True, chunk_size=11), id="chunked_causal"),
    # Whole tiles, no documents: only the static fields (spec.bounded) say "mask".
    pytest.param(Case(q_len=48, chunk_size=11), id="chunked_noncausal"),
    pytest.param(Case(q_len=48, causal=True, segments=True, bidirectional="prefix"),
                 id="prefix_lm_documents"),
    pytest.param(Case(q_len=48, causal=True, bidirectional="spans"), id="vlm_spans"),
    pytest.param(Case(q_len=48, mask_fn=kc.stripes), id="mask_fn"),
    pytest.param(Case(q_len=40, heads=4, kv_heads=2, causal=True, segments=True,
                      mask_fn=kc.skewed), id="mask_fn_skewed_gqa_documents"),
    pytest.param(Case(q_len=37, heads=4, kv_heads=1, causal=True, segments=True,
                      chunk_size=11, window=(13, 0), softcap=2.0),
                 id="chunked_window_documents_softcap_mqa_ragged"),
    pytest.param(Case(q_len=37, heads=4, kv_heads=2, causal=True, segments=True, pad=True,
                      bidirectional="prefix"), id="prefix_lm_padding_gqa_ragged"),
    pytest.param(Case(q_len=24, kv_len=40, causal=True, bidirectional="spans", chunk_size=20),
                 id="cross_spans_chunked"),
    pytest.param(Case(q_len=45, causal=True, bidirectional="spans", window=(9, 0), pad=True,
                      softcap=2.0, mask_fn=kc.stripes), id="spans_window_padding_softcap_mask_fn"),
]
#: What the default tier runs per kernel (the rest is the interpret tier).
DEFAULT = {
    "xla": {"vlm_spans", "mask_fn_skewed_gqa_documents"},
    "pallas": {"prefix_lm_padding_gqa_ragged"},
    "mosaic": {"chunked_window_documents_softcap_mqa_ragged"},
}


def _tier(kernel, case_id):
    return [] if case_id in DEFAULT[kernel] else [pytest.mark.interpret]


@pytest.mark.parametrize("kernel,case", kc.matrix(FAMILIES, marks=_tier))
def test_mask_families_match_reference(kernel, case, tolerances):
    """out, lse and the gradients of both (w.r.t. q, k, v) against the reference."""
    kc.check(kernel, kc.for_kernel(case, kernel), jnp.float32, tolerances)


# --- the tiles the kernels compute ----------------------------------------------------------

TILE_FAMILIES = [
    pytest.param(Case(batch=2, q_len=64, heads=1, kv_heads=1, causal=True, chunk_size=11),
                 id="chunked"),
    pytest.param(Case(batch=2, q_len=64, heads=1, kv_heads=1, causal=True, segments=True,
                      bidirectional="prefix"), id="prefix_lm_documents"),
    pytest.param(Case(batch=2, q_len=64, heads=1, kv_heads=1, causal=True,
                      bidirectional="spans"), id="vlm_spans"),
]


def _classes(case: Case):
    """``int8[B, nq, nk]`` tile classes of the case's forward at its tile."""
    q_tokens, kv_tokens = kc.tokens(case)
    tile = case.tile
    return np.asarray(blocks.classify(case.spec, blocks.summarize(q_tokens, tile, per_row=True),
                                     blocks.summarize(kv_tokens, tile, per_row=True)))


def _computed_tiles(kernel: str, case: Case, monkeypatch) -> list:
    """``(batch row, q tile, k tile)`` of every tile the forward computes, reported as it
    runs: the XLA kernel's tile hook; the Pallas and Mosaic kernels' per-tile step,
    wrapped to report through ``jax.debug.callback`` (one head: one program per tile row)."""
    seen = []
    q_tokens, kv_tokens = kc.tokens(case)
    (q, k, v), _ = kc.inputs(case, jnp.float32)
    options = kc.options(kernel, case)
    tile = case.tile
    if kernel == "xla":
        def record(kind, row, q_position, kv_position):
            if kind == "tile":
                seen.append((row, q_position // tile, kv_position // tile))
        record_xla_tiles(monkeypatch, record)
        jax.block_until_ready(jax.jit(functools.partial(kernels.forward, options))(q, k, v, q_tokens, kv_tokens))
        return seen

    def report(*index):
        jax.debug.callback(lambda *i: seen.append(tuple(int(x) for x in i)), *index)

    if kernel == "pallas":
        run_tiles = gpu_core.run_tiles

        def counting(bounds_ref, step, carry, *, has_mask):
            row, batch = pl.program_id(0), pl.program_id(1)  # grid (q tile, batch, head)

            def counted(j, carry, masked):
                report(batch, row, j)
                return step(j, carry, masked=masked)
            return run_tiles(bounds_ref, counted, carry, has_mask=has_mask)
        monkeypatch.setattr(gpu_core, "run_tiles", counting)
    else:
        run_tile = tpu_common.run_tile

        def counting(plan_ref, batch, row, col, tile_fn):
            def counted(is_partial):
                report(batch, row, col)
                tile_fn(is_partial)
            run_tile(plan_ref, batch, row, col, counted)
        monkeypatch.setattr(tpu_common, "run_tile", counting)
    jax.block_until_ready(jax.jit(functools.partial(kernels.forward, options))(q, k, v, q_tokens, kv_tokens))
    return seen


def _check_tile_count(kernel, case, monkeypatch):
    case = kc.for_kernel(case, kernel)
    classes = _classes(case)
    computed = _computed_tiles(kernel, case, monkeypatch)
    nonempty = {tuple(int(x) for x in i) for i in np.argwhere(classes != blocks.EMPTY)}
    assert len(computed) == len(set(computed))  # each tile once
    assert set(computed) == nonempty
    # Skipping holds the count down: below every tile (and chunks below causality alone).
    assert len(computed) < classes.size
    if case.chunk_size is not None:
        causal_only = _classes(case._replace(chunk_size=None))
        assert len(computed) < int((causal_only != blocks.EMPTY).sum())


#: What the default tier counts (the rest is the interpret tier).
DEFAULT_TILE_COUNTS = {("xla", "chunked"), ("pallas", "vlm_spans")}


@pytest.mark.parametrize("kernel,case", kc.matrix(
    TILE_FAMILIES, ["xla", "pallas"],
    marks=lambda kernel, case_id: [] if (kernel, case_id) in DEFAULT_TILE_COUNTS
    else [pytest.mark.interpret]))
def test_kernels_compute_exactly_the_non_empty_tiles(kernel, case, monkeypatch):
    """The tiles the XLA and Pallas forwards compute are the non-EMPTY tiles of
    :func:`blocks.classify` for chunks, prefix-LM documents and image spans: EMPTY tiles
    are skipped (fewer than the causal mask alone would compute)."""
    _check_tile_count(kernel, case, monkeypatch)


@pytest.mark.interpret
@pytest.mark.parametrize("case", TILE_FAMILIES)
def test_mosaic_computes_exactly_the_non_empty_tiles(case, monkeypatch):
    """The same count for the Mosaic forward (its scalar-prefetched plan, interpreted)."""
    _check_tile_count("mosaic", case, monkeypatch)


def test_mosaic_plan_runs_the_non_empty_tiles():
    """The plan the Mosaic kernel prefetches runs (class bits) exactly the non-EMPTY tiles
    of a chunked mask and fetches no block for the others (default tier, no interpreter)."""
    case = kc.for_kernel(TILE_FAMILIES[0].values[0], "mosaic")
    classes = _classes(case)
    plan = np.asarray(tpu_common.plan(jnp.asarray(classes)))
    np.testing.assert_array_equal(plan & 3, classes)
    assert (plan & 3 != blocks.EMPTY).sum() < classes.size
    fetched = np.take_along_axis(classes, plan >> 2, axis=-1)  # the class of each fetch
    assert np.all(fetched != blocks.EMPTY)  # every row sees a tile: no step fetches an EMPTY one


# --- whole calls skipped by Options --------------------------------------------------------

def _calls(options, q, k, v, q_tokens, kv_tokens, accumulate, monkeypatch):
    """``(result, kernel calls run)`` of ``options.forward`` with ``accumulate``."""
    events = []
    record_xla_tiles(monkeypatch, lambda kind, *_: events.append(kind))
    result = jax.block_until_ready(jax.jit(functools.partial(kernels.forward, options))(q, k, v, q_tokens, kv_tokens,
                                                            accumulate))
    monkeypatch.undo()
    return result, events.count("call")


@pytest.mark.parametrize("family", ["chunks", "bidirectional"])
def test_options_skip_calls_with_no_visible_pair(family, monkeypatch):
    """A ring step whose keys share no chunk with its queries (or, causal, lie after them
    with no shared bidirectional id) costs no kernel call and keeps ``accumulate``
    exactly; one whose keys share a chunk (an id) runs and changes it."""
    (q, k, v), _ = kc.inputs(Case(batch=1, q_len=16), jnp.float32)
    accumulate = (jnp.ones(q.shape, jnp.float32), jnp.zeros(q.shape[:3], jnp.float32))
    positions = jnp.arange(16, dtype=jnp.int32)[None]
    if family == "chunks":  # queries in chunk 0, keys in chunk 1 (or 0)
        spec = MaskSpec.make(chunk_size=20)
        q_tokens = Tokens(positions)
        apart, near = Tokens(positions + 20), Tokens(positions + 4)
    else:  # causal, keys after the queries: visible only through a shared id
        spec = MaskSpec.make(causal=True)
        ids = jnp.where(positions < 4, 1, 0).astype(jnp.int32)
        q_tokens = Tokens(positions, bidirectional_ids=ids)
        apart = Tokens(positions + 16, bidirectional_ids=2 * ids)
        near = Tokens(positions + 16, bidirectional_ids=ids)
    options = make_options(q, spec, kernel="xla", block_sizes=xla.BlockSizes(8, 8, 8, 8))
    skipped, calls = _calls(options, q, k, v, q_tokens, apart, accumulate, monkeypatch)
    assert calls == 0
    for got, given in zip(skipped, accumulate):
        np.testing.assert_array_equal(got, given)
    assert not bool(tiling.any_visible(spec, q_tokens, apart))
    ran, calls = _calls(options, q, k, v, q_tokens, near, accumulate, monkeypatch)
    assert calls == 1
    assert not np.allclose(ran[0], accumulate[0])


# --- lowering --------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", [pytest.param("pallas", marks=pytest.mark.matrix), "mosaic"])
def test_new_masks_lower_for_the_accelerator(kernel):
    """Forward and both backward kernels with documents and bidirectional ids (Triton:
    chunks and a mask_fn too) lower to Triton (CUDA) and Mosaic (TPU) without the
    device: the extra metadata rides in BlockSpecs the lowerings take. (Mosaic lowers
    integer floor division and remainder by the TPU generation, which a CPU host
    without a TPU topology lacks; chunks and mask_fn run interpreted above.)"""
    seq, platform = (200, "cuda") if kernel == "pallas" else (256, "tpu")
    q = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    spec = (MaskSpec.make(True, chunk_size=100, mask_fn=kc.skewed) if kernel == "pallas"
            else MaskSpec.make(True, window=(100, 0)))

    def grads(q, k, v, positions, segments, bidirectional):
        tokens = Tokens(positions, segments, bidirectional)
        options = make_options(q, spec, kernel=kernel)

        def loss(q, k, v):
            out, lse = kernels.attention(options, q, k, v, tokens, tokens)
            return out.astype(jnp.float32).sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    if kernel == "pallas":
        text = jax.export.export(jax.jit(grads), platforms=[platform], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            q, kv, kv, ids, ids, ids).mlir_module()
        call = "__gpu$xla.gpu.triton"
    else:  # as test_mosaic.py: lowered for TPU from the CPU host
        text = jax.jit(grads).trace(q, kv, kv, ids, ids, ids).lower(
            lowering_platforms=(platform,)).as_text()
        call = "tpu_custom_call"
    assert text.count(call) >= 3, text.count(call)
