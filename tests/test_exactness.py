"""Every strategy against ``core.reference``: outputs (and lse) and gradients, through the
one driver (tests/exactness.py), strategy x mask x dtype x context x pipeline.

Each group below is one subject's matrix; :func:`checks.tiered` puts a covering subset of
each in the default tier and the rest in ``matrix`` (``interpret`` for the Pallas and
Mosaic kernels): every strategy, mask family, token order, pipeline and context is in
the default tier somewhere.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

import checks
import jax_seqpar as sp
import kernel_cases as kc
from exactness import FAMILIES, Case, check, every_third_diagonal

STRATEGIES = checks.STRATEGIES  # ring, ulysses, hybrid, allgather


def _params(cases, keep, tier=pytest.mark.matrix):
    """``[(id, Case)]`` as test parameters, those ``keep(i)`` rejects in ``tier``."""
    return checks.tiered([pytest.param(case, id=name) for name, case in cases], keep, tier)


# --- strategies x masks and heads: the global call, [2, 64, 8, 16] on an Auto mesh, jit ----

_HEADS_AND_MASKS = [
    ("mha-causal", dict(kv_heads=8), dict(causal=True), False),
    ("mha", dict(kv_heads=8), dict(causal=False), False),
    ("gqa-causal", dict(kv_heads=2), dict(causal=True), False),
    ("mqa", dict(kv_heads=1), dict(causal=False), False),
    ("gqa-causal-segments", dict(kv_heads=2), dict(causal=True), True),
    ("segments", dict(kv_heads=8), dict(causal=False), True),
    ("window", dict(kv_heads=2), dict(window=(9, 4)), False),
    ("causal-window", dict(kv_heads=2), dict(causal=True, window=12), False),
    ("dv-ne-dqk", dict(kv_heads=2, v_head_dim=8), dict(causal=True), False),
]


def _shape(batch=2, seq=64, heads=8, kv_heads=8, head_dim=16, v_head_dim=None):
    return (batch, seq, heads, kv_heads, head_dim, v_head_dim or head_dim)


# Every strategy on every case; the default tier: each strategy on every third case (each
# case on one or two strategies).
MASKS = _params(
    [(f"{name}-{strategy}", Case(strategy, shape=_shape(**heads), mask=mask,
                                 segments=(3, 4) if segments else None))
     for name, heads, mask, segments in _HEADS_AND_MASKS for strategy in STRATEGIES],
    lambda i: (i // len(STRATEGIES)) % 3 == (i % len(STRATEGIES)) % 3)

# The global call's layouts, causal GQA with documents: one layout each by default.
LAYOUTS = _params(
    [(f"{layout}-{strategy}", Case(strategy, shape=_shape(kv_heads=2), mask=dict(causal=True),
                                   segments=(5, 4), layout=layout, seed=1))
     for layout in ("contiguous", "zigzag", "striped") for strategy in STRATEGIES],
    lambda i: i % len(STRATEGIES) % 3 == i // len(STRATEGIES))

# bfloat16 through each strategy; small tiles (EMPTY skipping, accumulation across tiles
# and ring steps); "auto" (the planner's pick: Ulysses for MHA, the ring for MQA).
DTYPES_AND_TILES = _params(
    [(f"bf16-{strategy}", Case(strategy, shape=_shape(kv_heads=2), dtype=jnp.bfloat16,
                               mask=dict(causal=True), segments=(3, 4)))
     for strategy in STRATEGIES]
    + [(f"many-tiles-{strategy}", Case(
        strategy, shape=_shape(batch=1, seq=256, kv_heads=2), mask=dict(causal=True),
        segments=(13, 4), kernel="xla", block_sizes=sp.BlockSizes(16, 16, 8, 32), seed=12))
       for strategy in STRATEGIES]
    + [(f"auto-kv{kv_heads}", Case("auto", shape=_shape(batch=1, kv_heads=kv_heads,
                                                         v_head_dim=8 if kv_heads == 1 else None),
                                   mask=dict(causal=True, scale=0.3)))
       for kv_heads in (8, 1)],
    lambda i: True)

# Every strategy on the Pallas and the Mosaic kernel (the Pallas interpreter on CPU;
# Mosaic at 128-token tiles): causal GQA with documents. Default: each kernel once.
KERNELS = _params(
    [(f"{strategy}-{kernel}", Case(
        strategy, shape=_shape(batch=1, kv_heads=2), mask=dict(causal=True), segments=(3, 4),
        kernel=kernel, block_sizes=kc.block_sizes(kernel, 128) if kernel == "mosaic" else None,
        seed=11))
     for kernel in ("pallas", "mosaic") for strategy in STRATEGIES],
    lambda i: i in (0, 5), tier=pytest.mark.interpret)


@pytest.mark.parametrize("case", MASKS + LAYOUTS + DTYPES_AND_TILES + KERNELS)
def test_strategies(case, tolerances):
    check(case, tolerances)


# --- mask families x strategies: README's context (Explicit mesh, set_mesh, jit) --------

FAMILY_STRATEGIES = ("ring", "ulysses", "allgather", "hybrid", "local")


def _family_case(strategy, name, **changes) -> Case:
    """``name`` through ``strategy`` on ``[1, 32, 8, 2, 8]`` (the hybrid on the one axis
    split by ``ulysses_size=2``), the XLA kernel."""
    case = Case(strategy, shape=(1, 32, 8, 2, 8, 8), family=name, kernel="xla", seed=1,
                context="explicit-set-mesh-jit",
                ulysses_size=2 if strategy == "hybrid" else None)
    return dataclasses.replace(case, **changes)


# Each family through each strategy; default: a covering subset (each strategy and family).
FAMILY_PAIRS = _params(
    [(f"{s}-{f}", _family_case(s, f)) for s in FAMILY_STRATEGIES for f in FAMILIES],
    lambda i: i % len(FAMILIES) == (i // len(FAMILIES)) % len(FAMILIES))

#: Matrix variants of a family case: name -> its changes.
_VARIANTS = {
    "window": dict(mask=dict(window=(5, 3))),
    "sinks_softcap": dict(sinks=True, mask=dict(softcap=3.0)),
    "gqa_batch": dict(shape=(2, 32, 8, 1, 8, 8)),
    "odd_length": dict(shape=(1, 61, 8, 2, 8, 8)),
    "zigzag": dict(layout="zigzag"),
    "striped": dict(layout="striped"),
    "per_document": dict(layout="per_document"),
    "auto_mesh": dict(context="auto-set-mesh-jit"),
    "bfloat16": dict(dtype=jnp.bfloat16),
    # Ulysses' pipelines: head groups (2 heads a device), sequence pieces; the hybrid over
    # two mesh axes.
    "head_groups": dict(shape=(1, 32, 16, 4, 8, 8), pipeline=dict(head_groups=2)),
    "sequence_pieces": dict(shape=(1, 64, 8, 2, 8, 8), pipeline=dict(overlap=True, pieces=2)),
    "two_axes": dict(mesh=((2, 4), ("dcn", "ici")), ulysses_size=None),
    "float16": dict(dtype=jnp.float16),
}


def _applies(strategy: str, variant: str) -> bool:
    """Whether ``variant`` means something for ``strategy`` (the local path has no mesh,
    token order or pipeline; only Ulysses' exchange is pipelined, and only over one
    axis it pieces the sequence; only the hybrid runs over two axes)."""
    if strategy == "local" and variant in ("zigzag", "striped", "per_document", "auto_mesh",
                                           "head_groups", "sequence_pieces", "two_axes"):
        return False
    if variant == "head_groups":
        return strategy in ("ulysses", "hybrid")
    if variant == "sequence_pieces":
        return strategy == "ulysses"
    return variant != "two_axes" or strategy == "hybrid"


def _covering() -> list:
    """Each variant with each family once, the strategies taken in turn (shifted from one
    variant to the next, so every strategy meets every family and most variants): a
    quarter of the whole cross product, which the default tier's pairs complete."""
    cases = []
    for shift, variant in enumerate(sorted(_VARIANTS)):
        chosen = [s for s in FAMILY_STRATEGIES if _applies(s, variant)]
        for index, name in enumerate(FAMILIES):
            strategy = chosen[(index + shift) % len(chosen)]
            changes = dict(_VARIANTS[variant])
            if variant == "per_document" and name != "prefix_lm":  # documents to keep whole
                changes["segments"] = (3, 3)
            cases.append((f"{strategy}-{name}-{variant}",
                          _family_case(strategy, name, **changes)))
    return cases


FAMILY_MATRIX = _params(_covering(), lambda i: False)

# A causal window on the contiguous split exchanges a halo; with bidirectional ids a
# query sees later keys of its id (up to the window's right side), so the halo must bring
# the right neighbours' keys too (a causal halo of left keys only was wrong).
HALO = _params(
    [(f"halo-{s}-{f}", _family_case(s, f, shape=(1, 64, 8, 2, 8, 8), mask=dict(window=(6, 6)),
                                    layout="contiguous"))
     for s, f in [("ring", "vlm"), ("allgather", "prefix_lm"), ("ring", "prefix_lm"),
                  ("allgather", "vlm")]],
    lambda i: i < 1)

# Each per-shard function takes chunk_size, bidirectional_ids (sharded with the tokens)
# and mask_fn on the contiguous split.
PER_SHARD_MASKS = _params(
    [(f"per-shard-{s}", Case(s, entry="per_shard", shape=(1, 32, 8, 2, 8, 8), family="vlm",
                             mask=dict(chunk_size=11, mask_fn=every_third_diagonal),
                             kernel="xla", context="jit-sharded", seed=5))
     for s in STRATEGIES],
    lambda i: True)


@pytest.mark.parametrize("case", FAMILY_PAIRS + FAMILY_MATRIX + HALO + PER_SHARD_MASKS)
def test_mask_families(case, tolerances):
    check(case, tolerances)


# --- windows (halo exchange), sinks, softcap: per-shard, [1, 128, 8, 16], Dv 8 ------------

def _window_case(strategy, kv_heads=2, sinks=True, dtype=jnp.float32, order=None,
                 segments=False, block_sizes=None, **mask) -> Case:
    return Case(strategy, entry="per_shard", shape=(1, 128, 8, kv_heads, 16, 8), dtype=dtype,
                mask=mask, segments=(3, 3) if segments else None, order=order, sinks=sinks,
                kernel="xla", block_sizes=block_sizes)


# On the contiguous split with default positions (None) a window turns the ring and the
# all-gather into a halo exchange (one and several hops each way); given positions
# (contiguous, zigzag, striped) run the full ring.
WINDOWS = _params([
    ("ring-mqa-causal-window-2hops", _window_case("ring", causal=True, window=(20, 3),
                                                  kv_heads=1)),
    ("ring-window-segments-softcap-tiles", _window_case(
        "ring", window=(7, 33), softcap=2.0, segments=True,
        block_sizes=sp.BlockSizes(8, 8, 8, 8))),
    ("ring-right-only", _window_case("ring", window=(0, 5), sinks=False)),
    ("ring-causal-window-bf16", _window_case("ring", causal=True, window=(24, 0),
                                             dtype=jnp.bfloat16, segments=True)),
    ("ring-wide-window-full-ring", _window_case("ring", window=(3, 200))),
    ("ring-explicit-contiguous-positions", _window_case("ring", causal=True, window=(20, 0),
                                                        order="contiguous")),
    ("ring-zigzag-window-segments-softcap", _window_case(
        "ring", order="zigzag", window=(12, 30), segments=True, softcap=3.0)),
    ("ring-striped-causal-window", _window_case("ring", order="striped", causal=True,
                                                window=(9, 0))),
    ("hybrid-causal-window-segments-softcap", _window_case(
        "hybrid", causal=True, window=(20, 0), segments=True, softcap=2.5)),
    ("hybrid-zigzag-window", _window_case("hybrid", order="zigzag", window=(5, 70))),
    ("allgather-window-segments", _window_case("allgather", window=(7, 33), segments=True)),
    ("allgather-causal-window-3hops-softcap", _window_case(
        "allgather", causal=True, window=(40, 0), softcap=2.0)),
    ("allgather-striped-causal-softcap", _window_case("allgather", order="striped",
                                                      causal=True, softcap=2.0)),
    ("ulysses-window-segments-softcap", _window_case("ulysses", window=(9, 4), segments=True,
                                                     softcap=2.0)),
    ("ulysses-zigzag-mqa", _window_case("ulysses", order="zigzag", causal=True, kv_heads=1)),
], lambda i: i % 2 == 0)


@pytest.mark.parametrize("case", WINDOWS)
def test_windows_sinks_softcap(case, tolerances):
    check(case, tolerances)


# --- pipelines: per-shard, [1, 64, heads, 8], Dv 16, on the contiguous split or zigzag ---

def _pipeline_case(strategy, heads, kv_heads, *, order=None, sinks=False, segments=False,
                   return_lse=False, dtype=jnp.float32, outer=2, **keywords) -> Case:
    """``keywords``: the mask (``causal``, ``window``) and the pipeline (``head_groups``,
    ``pieces``); ``outer``: the hybrid's ring devices, of 8."""
    mask = {key: keywords.pop(key) for key in ("causal", "window") if key in keywords}
    return Case(strategy, entry="per_shard", shape=(1, 64, heads, kv_heads, 8, 16),
                dtype=dtype, mask=mask, segments=(3, 3) if segments else None,
                order="zigzag" if order == "zigzag" else None, sinks=sinks,
                return_lse=return_lse, kernel="xla", pipeline=keywords,
                mesh=((outer, 8 // outer), ("dcn", "ici")) if strategy == "hybrid" else None,
                seed=heads * 7 + kv_heads)


def _pipeline_id(strategy, heads, kv_heads, variant, **counts):
    return "-".join([strategy, f"h{heads}", f"kv{kv_heads}",
                     *(f"{key}{value}" for key, value in counts.items())]
                    + [f"{k}{v}" for k, v in variant.items() if k != "dtype"]
                    + ([jnp.dtype(variant["dtype"]).name] if "dtype" in variant else []))


# Masks and extras, taken in turn by the (heads, groups) cases.
_TURNS = [dict(causal=True), dict(causal=False, sinks=True, return_lse=True),
          dict(window=(9, 4), segments=True), dict(order="zigzag", causal=True, sinks=True),
          dict(causal=True, window=(12, 0), return_lse=True)]


def _head_group_cases(strategy, heads_and_counts):
    """``(heads, kv heads, the head-group counts they allow)`` with the variants in turn."""
    cases, turn = [], 0
    for heads, kv_heads, counts in heads_and_counts:
        for groups in counts:
            variant = _TURNS[turn % len(_TURNS)]
            turn += 1
            cases.append((_pipeline_id(strategy, heads, kv_heads, variant, g=groups),
                          _pipeline_case(strategy, heads, kv_heads, head_groups=groups,
                                         **variant)))
    return cases


# (heads, kv heads) over 8 devices: K/V heads per group (MHA), one shared K/V head (GQA
# 4:1 and MQA-like), K/V replicated up to the devices, and two K/V heads for four query
# heads (whole K/V heads per group up to 2 groups, shared at 4); with every head-group
# count each allows (strategies.heads.head_group_counts). bf16: a shared K/V head's
# gradients summed over 4 groups, kept in the input dtype.
ULYSSES_HEAD_GROUPS = _params(
    _head_group_cases("ulysses", [(16, 16, (1, 2)), (32, 8, (1, 2, 4)), (16, 4, (1, 2)),
                                  (32, 16, (1, 2, 4))])
    + [("ulysses-h32-kv8-g4-causalTrue-bfloat16",
        _pipeline_case("ulysses", 32, 8, head_groups=4, causal=True, dtype=jnp.bfloat16))],
    lambda i: i in (4, 6, 8))
# The hybrid's inner Ulysses over 4 devices.
HYBRID_HEAD_GROUPS = _params(
    _head_group_cases("hybrid", [(16, 8, (1, 2, 4)), (8, 2, (1, 2))]), lambda i: i == 1)

# Ulysses pipelined along the sequence: every chunk count of the 8 local tokens (query
# pieces of 4 2 2, 2 2 2 2 or 1 2 2 2 1 rows a device, K/V pieces of the first's rows).
_ULYSSES_CHUNKS = [
    (16, 4, 2, dict(order="zigzag", causal=True, sinks=True, return_lse=True)),
    (16, 4, 3, dict(window=(9, 4), segments=True)),
    (16, 4, 4, dict(order="zigzag", causal=True)),
    (32, 8, 4, dict(causal=False, sinks=True, return_lse=True)),
    (16, 16, 3, dict(causal=True, window=(12, 0), return_lse=True)),
    (16, 4, 4, dict(order="zigzag", causal=True, segments=True, sinks=True)),
    (8, 8, 2, dict(causal=True, dtype=jnp.bfloat16)),
]
# The all-gather over every chunk count of the 8 local tokens.
_ALLGATHER_CHUNKS = [
    (4, 2, 1, dict(causal=True)),
    (4, 2, 2, dict(order="zigzag", causal=True, sinks=True, return_lse=True)),
    (4, 1, 4, dict(causal=False, segments=True, sinks=True)),
    (4, 4, 8, dict(order="zigzag", causal=True, window=(20, 0))),
    (8, 2, 8, dict(order="zigzag", window=(9, 30), segments=True, return_lse=True)),
    (4, 2, 4, dict(order="zigzag", causal=True, dtype=jnp.bfloat16)),
]
# The hybrid's inner exchange pipelined along the sequence around its ring, on rings of
# 2 and 4 devices (no middle step; two) and of one (Ulysses' pipeline over the inner
# axis); (heads, kv heads, outer, pieces, variant). K/V replicated in the bf16 case.
_HYBRID_CHUNKS = [
    (16, 4, 2, 4, dict(order="zigzag", causal=True, sinks=True, return_lse=True)),
    (8, 2, 4, 3, dict(order="zigzag", causal=True, segments=True)),
    (16, 8, 4, 2, dict(causal=False, sinks=True, return_lse=True)),
    (8, 8, 2, 3, dict(order="zigzag", window=(9, 4), segments=True)),
    (16, 2, 4, 4, dict(causal=True, dtype=jnp.bfloat16)),
    (8, 4, 2, 2, dict(order="zigzag", causal=True, sinks=True, dtype=jnp.float16)),
    (16, 4, 1, 3, dict(causal=True, return_lse=True)),
]
# Its ring a halo exchange (a window on the contiguous split, default positions), cut into
# pieces alike: one hop left on a ring of 2 (32 tokens a group); on a ring of 4 (16
# tokens) two hops left (16 + 4) and one right, with segments, sinks and the lse; bf16.
_HYBRID_HALO_CHUNKS = [
    (8, 2, 2, 3, dict(causal=True, window=(12, 0))),
    (16, 4, 4, 2, dict(window=(20, 3), segments=True, sinks=True, return_lse=True)),
    (8, 8, 4, 4, dict(causal=True, window=(5, 0), segments=True, dtype=jnp.bfloat16)),
]
CHUNKS = (
    _params([(_pipeline_id("ulysses", h, kv, variant, c=c),
              _pipeline_case("ulysses", h, kv, pieces=c, **variant))
             for h, kv, c, variant in _ULYSSES_CHUNKS], lambda i: i in (0, 1, 2))
    + _params([(_pipeline_id("allgather", h, kv, variant, c=c),
                _pipeline_case("allgather", h, kv, pieces=c, **variant))
               for h, kv, c, variant in _ALLGATHER_CHUNKS], lambda i: i in (1, 4))
    + _params([(_pipeline_id("hybrid", h, kv, variant, o=outer, c=c),
                _pipeline_case("hybrid", h, kv, outer=outer, pieces=c, **variant))
               for h, kv, outer, c, variant in _HYBRID_CHUNKS], lambda i: i in (0, 1))
    + _params([(_pipeline_id("hybrid", h, kv, variant, o=outer, c=c, halo=""),
                _pipeline_case("hybrid", h, kv, outer=outer, pieces=c, **variant))
               for h, kv, outer, c, variant in _HYBRID_HALO_CHUNKS], lambda i: True))


@pytest.mark.parametrize("case", ULYSSES_HEAD_GROUPS + HYBRID_HEAD_GROUPS + CHUNKS)
def test_pipelines(case, tolerances):
    check(case, tolerances)


# --- contexts: the chunked hybrid through the global call -----------------------------

# The README's context first (an Explicit mesh from jax.make_mesh, jax.set_mesh, jit, the
# gradient), then an Auto mesh; 60 tokens: padded to whole shards (8 a device).
CONTEXTS = [
    pytest.param(Case("hybrid", shape=(1, seq, 8, 2, 8, 8), dtype=dtype, mask=dict(causal=True),
                      pipeline=dict(pieces=2), context=context),
                 id=f"hybrid-pieces-{context}-s{seq}-{jnp.dtype(dtype).name}", marks=marks)
    for context, seq, dtype, marks in [
        ("jit-replicated", 64, jnp.float32, ()),
        ("explicit-set-mesh", 60, jnp.bfloat16, pytest.mark.matrix),
        ("auto", 64, jnp.float16, pytest.mark.matrix)]]


@pytest.mark.parametrize("case", CONTEXTS)
def test_contexts(case, tolerances):
    check(case, tolerances)
