"""The pipelined exchanges (issue 22) against the reference: Ulysses and the hybrid
pipelined over every head-group count the heads allow, the all-gather over every chunk
count; outputs, log-sum-exps and the gradients of q, k, v and the sinks, with GQA,
causal / full masks, sliding windows, sinks and segment ids, on the contiguous split
and on zigzag positions. Tiny shapes on the 8 CPU devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import checks
import jax_seqpar as sp
from jax_seqpar.core import layout, reference
from jax_seqpar.strategies import heads as head_split

B, S, D, DV = 1, 64, 8, 16


def _mesh(strategy, outer=2):
    devices = np.array(jax.devices())
    if strategy == "hybrid":
        return Mesh(devices.reshape(outer, 8 // outer), ("dcn", "ici")), ("dcn", "ici")
    return Mesh(devices, ("sp",)), "sp"


def _check(strategy, tolerances, *, heads, kv_heads, order="contiguous", sinks=False,
           segments=False, return_lse=False, dtype=jnp.float32, outer=2, **options):
    """``strategy``'s per-shard function (``options``: its keywords and the mask) against
    the reference: out (and lse), d(q, k, v, sinks), in one program each (``outer``: the
    hybrid's ring devices, of 8)."""
    mesh, axes = _mesh(strategy, outer)
    fn = functools.partial(getattr(sp, f"{strategy}_attention"), seq_axes=axes, kernel="xla")
    kq, kk, kv, ks, kw = jax.random.split(jax.random.key(heads * 7 + kv_heads), 5)
    q = jax.random.normal(kq, (B, S, heads, D), dtype)
    k = jax.random.normal(kk, (B, S, kv_heads, D), dtype)
    v = jax.random.normal(kv, (B, S, kv_heads, DV), dtype)
    sink_logits = jax.random.normal(ks, (heads,), jnp.float32) if sinks else None
    positions = jnp.broadcast_to(layout.zigzag_positions(S, 8) if order == "zigzag"
                                 else jnp.arange(S, dtype=jnp.int32), (B, S))
    segment_ids = None
    if segments:
        ids = jnp.sort(jax.random.randint(jax.random.key(3), (B, S), 0, 3), axis=1)
        segment_ids = ids[:, positions[0]].astype(jnp.int32)
    mask = {key: options.pop(key) for key in ("causal", "window") if key in options}
    extras = {name: x for name, x in (("segment_ids", segment_ids),
              ("positions", positions if order != "contiguous" else None)) if x is not None}
    seq = P(None, axes)
    w_out, w_lse = (jax.random.normal(kw, shape) for shape in ((B, S, heads, DV),
                                                                (B, S, heads)))

    def ours(q, k, v, sink_logits):
        def body(q, k, v, sink_logits, extras):
            return fn(q, k, v, sinks=sink_logits, return_lse=return_lse, **extras, **mask,
                      **options)

        out_specs = (seq, seq) if return_lse else seq
        return jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, P(), seq),
                             out_specs=out_specs)(q, k, v, sink_logits, extras)

    def theirs(q, k, v, sink_logits):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        return reference.attention(q, k, v, positions=positions, segment_ids=segment_ids,
                                   sinks=sink_logits, return_lse=return_lse, **mask)

    def with_grads(f):
        def run(q, k, v, sink_logits):
            result, pullback = jax.vjp(f, q, k, v, sink_logits)
            if return_lse:
                cotangent = (w_out.astype(result[0].dtype), w_lse)
            else:
                cotangent = w_out.astype(result.dtype)
            return result, pullback(cotangent)
        return jax.jit(run)

    got, got_grads = with_grads(ours)(q, k, v, sink_logits)
    want, want_grads = with_grads(theirs)(*(x.astype(jnp.float32) for x in (q, k, v)),
                                          sink_logits)
    got, want = (got, want) if return_lse else ((got,), (want,))
    for name, a, b in zip(("out", "lse"), got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a.astype(jnp.float32), b, **tolerances(dtype), err_msg=name)
    assert got[0].dtype == dtype
    for name, a, b in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
        if b is None:
            continue
        scale = max(1.0, float(jnp.abs(b).max()))
        np.testing.assert_allclose(a.astype(jnp.float32) / scale, b / scale,
                                   **tolerances(dtype, "grad"), err_msg=f"d{name}")
    if sinks:
        assert float(jnp.abs(got_grads[3]).max()) > 1e-3


# (heads, kv heads) over 8 devices: K/V heads per group (MHA), one shared K/V head (GQA
# 4:1 and MQA-like), K/V replicated up to the devices (the 16 / 4), and two K/V
# heads for four query heads (whole K/V heads per group up to 2 groups, shared at 4).
ULYSSES_HEADS = [(16, 16), (32, 8), (16, 4), (32, 16)]
# Masks and extras, taken in turn by the (heads, groups) cases.
VARIANTS = [dict(causal=True), dict(causal=False, sinks=True, return_lse=True),
            dict(window=(9, 4), segments=True), dict(order="zigzag", causal=True, sinks=True),
            dict(causal=True, window=(12, 0), return_lse=True)]


def _ulysses_cases(strategy, heads_list, shards):
    cases, turn = [], 0
    for heads, kv_heads in heads_list:
        for groups in head_split.head_group_counts(heads, kv_heads, shards):
            variant = VARIANTS[turn % len(VARIANTS)]
            turn += 1
            cases.append(pytest.param(heads, kv_heads, groups, variant,
                                      id=f"{strategy}-h{heads}-kv{kv_heads}-g{groups}-"
                                         + "-".join(f"{k}{v}" for k, v in variant.items())))
    return cases


@pytest.mark.parametrize("heads, kv_heads, groups, variant", checks.tiered([
    *_ulysses_cases("ulysses", ULYSSES_HEADS, 8),
    # bf16: a shared K/V head's gradients summed over 4 groups, kept in the input dtype
    pytest.param(32, 8, 4, dict(causal=True, dtype=jnp.bfloat16),
                 id="ulysses-h32-kv8-g4-causal-bf16")], lambda i: i in (4, 6, 8)))
def test_ulysses_head_groups(heads, kv_heads, groups, variant, tolerances):
    _check("ulysses", tolerances, heads=heads, kv_heads=kv_heads, head_groups=groups,
           **variant)


@pytest.mark.parametrize("heads, kv_heads, groups, variant", checks.tiered(
    _ulysses_cases("hybrid", [(16, 8), (8, 2)], 4), lambda i: i == 1))
def test_hybrid_head_groups(heads, kv_heads, groups, variant, tolerances):
    _check("hybrid", tolerances, heads=heads, kv_heads=kv_heads, head_groups=groups, **variant)


# (heads, kv heads, chunks, variant): every chunk count of the 8 local tokens (query
# pieces of 4 2 2, 2 2 2 2 or 1 2 2 2 1 rows a device, K/V pieces of the first's rows),
# each with a mask and an extra.
ULYSSES_CHUNK_CASES = [
    (16, 4, 2, dict(order="zigzag", causal=True, sinks=True, return_lse=True)),
    (16, 4, 3, dict(window=(9, 4), segments=True)),
    (16, 4, 4, dict(order="zigzag", causal=True)),
    (32, 8, 4, dict(causal=False, sinks=True, return_lse=True)),
    (16, 16, 3, dict(causal=True, window=(12, 0), return_lse=True)),
    (16, 4, 4, dict(order="zigzag", causal=True, segments=True, sinks=True)),
    (8, 8, 2, dict(causal=True, dtype=jnp.bfloat16)),
]


def _chunk_id(case):
    heads, kv_heads, chunks, variant = case
    return (f"h{heads}-kv{kv_heads}-c{chunks}-"
            + "-".join(f"{k}{v}" for k, v in variant.items() if k != "dtype")
            + ("-bf16" if "dtype" in variant else ""))


@pytest.mark.parametrize("heads, kv_heads, chunks, variant", checks.tiered([
    pytest.param(*case, id=_chunk_id(case)) for case in ULYSSES_CHUNK_CASES],
    lambda i: i in (0, 1, 2)))
def test_ulysses_chunks(heads, kv_heads, chunks, variant, tolerances):
    """Ulysses pipelined along the sequence: every chunk count the 8 local tokens allow."""
    _check("ulysses", tolerances, heads=heads, kv_heads=kv_heads, chunks=chunks, **variant)


def test_ulysses_chunk_counts_and_default():
    assert head_split.chunk_counts(8) == (1, 2, 3, 4)
    assert head_split.chunk_sizes(2048, 5) == (128, 512, 512, 512, 256, 128)
    assert head_split.chunk_sizes(8, 1) == (8,)
    # every count a length allows cuts it whole, L/4 whole or not (126: pieces of 63, 32, 31)
    for local_len in range(2, 400, 2):
        for chunks in head_split.chunk_counts(local_len):
            sizes = head_split.chunk_sizes(local_len, chunks)
            assert sum(sizes) == local_len and min(sizes) > 0, (local_len, chunks, sizes)
    # 2048 tokens a device: the most auto chunks; 8: none (a smallest chunk of 16 tokens)
    assert head_split.default_chunks(2048, 8) == head_split.MAX_AUTO_CHUNKS
    assert head_split.default_chunks(8, 8) == 1
    assert head_split.resolve_pieces(True, "auto", "auto", 16, 4, 8, 2048) == (5, 1)
    # the default chunks the sequence where the local length allows (no more memory
    # than the unpipelined exchange), else pipelines head groups
    assert head_split.resolve_pieces("auto", "auto", "auto", 16, 4, 8, 2048) == (5, 1)
    assert head_split.resolve_pieces("auto", "auto", "auto", 16, 4, 8, 8) == (1, 2)
    assert head_split.resolve_pieces("auto", "auto", 2, 16, 4, 8, 2048) == (1, 2)
    assert head_split.resolve_pieces(False, "auto", "auto", 16, 4, 8, 2048) == (1, 1)
    assert head_split.resolve_pieces(True, 3, "auto", 16, 4, 8, 8) == (3, 1)


def test_head_group_counts_and_default():
    assert head_split.head_group_counts(16, 4, 8) == (1, 2)
    assert head_split.head_group_counts(64, 8, 8) == (1, 2, 4, 8)
    # 6 query and 2 K/V heads per device: 3 groups would split a K/V head between two
    assert head_split.head_group_counts(48, 16, 8) == (1, 2, 6)
    assert head_split.default_head_groups(16, 4, 8) == 2
    assert head_split.default_head_groups(64, 8, 8) == head_split.MAX_AUTO_HEAD_GROUPS
    # The hybrid takes only counts that give each group its own K/V heads.
    assert head_split.default_head_groups(16, 4, 4, shared_kv=False) == 1
    assert head_split.default_head_groups(16, 8, 4, shared_kv=False) == 2
    with pytest.raises(ValueError, match=r"head_groups=3 .* one of \(1, 2\)"):
        head_split.resolve_head_groups(3, 16, 4, 8)


# (heads, kv heads, chunks, variant): every chunk count of the 8 local tokens.
ALLGATHER_CASES = [
    (4, 2, 1, dict(causal=True)),
    (4, 2, 2, dict(order="zigzag", causal=True, sinks=True, return_lse=True)),
    (4, 1, 4, dict(causal=False, segments=True, sinks=True)),
    (4, 4, 8, dict(order="zigzag", causal=True, window=(20, 0))),
    (8, 2, 8, dict(order="zigzag", window=(9, 30), segments=True, return_lse=True)),
    (4, 2, 4, dict(order="zigzag", causal=True, dtype=jnp.bfloat16)),
]


@pytest.mark.parametrize("heads, kv_heads, chunks, variant", checks.tiered([
    pytest.param(*case, id=f"h{case[0]}-kv{case[1]}-c{case[2]}-"
                 + "-".join(f"{k}{v}" for k, v in case[3].items() if k != "dtype")
                 + ("-bf16" if "dtype" in case[3] else ""))
    for case in ALLGATHER_CASES], lambda i: i in (1, 4)))
def test_allgather_chunks(heads, kv_heads, chunks, variant, tolerances):
    _check("allgather", tolerances, heads=heads, kv_heads=kv_heads, chunks=chunks, **variant)


def test_chunk_counts_and_default():
    from jax_seqpar.strategies import allgather

    assert allgather.chunk_counts(8) == (1, 2, 4, 8)
    assert allgather.default_chunks(16384 // 8) == allgather.MAX_AUTO_CHUNKS
    assert allgather.default_chunks(256) == 2 and allgather.default_chunks(100) == 1
    with pytest.raises(ValueError, match="chunks=3 must be a positive divisor of the 8"):
        allgather.resolve_chunks(3, 8)


@pytest.mark.parametrize("strategy, options, match", [
    ("ulysses", dict(head_groups=3),
     r"head_groups=3 does not split the 2 query heads and 1 K/V head\(s\) .*num_heads=16, "
     r"num_kv_heads=4 over 8 devices.* one of \(1, 2\) or 'auto'"),
    ("ulysses", dict(head_groups=0), r"head_groups=0 .* one of \(1, 2\)"),
    ("hybrid", dict(head_groups=8), r"head_groups=8 does not split the 4 query heads .* "
     r"over 4 devices.* one of \(1, 2, 4\)"),
    ("ulysses", dict(chunks=5), r"chunks=5 does not cut the 8 tokens a device holds .* "
     r"one of \(1, 2, 3, 4\) or 'auto'"),
    ("ulysses", dict(chunks=2, head_groups=2), r"chunks and head groups do not combine"),
    ("hybrid", dict(chunks=2, window=(4, 0)), r"chunks=2 does not cut .* one of \(1,\) "
     r"or 'auto' \(a window makes the hybrid's ring a halo exchange here: not chunked\)"),
    ("ulysses", dict(overlap=False, chunks=2), r"overlap=False sends each exchange whole"),
    ("allgather", dict(chunks=3),
     r"chunks=3 must be a positive divisor of the 8 tokens each device holds: one of "
     r"\(1, 2, 4, 8\)"),
    ("allgather", dict(chunks="8"), r"chunks='8' must be a positive divisor"),
])
def test_bad_pipeline_arguments_name_the_numbers(strategy, options, match):
    """Traced only (no compile): a count the heads or tokens do not allow is refused in
    the per-shard call, with the counts that work."""
    mesh, axes = _mesh(strategy)
    fn = functools.partial(getattr(sp, f"{strategy}_attention"), seq_axes=axes,
                           kernel="xla", causal=True, **options)
    q = jax.ShapeDtypeStruct((B, S, 16, D), jnp.float32)
    k = v = jax.ShapeDtypeStruct((B, S, 4, D), jnp.float32)
    seq = P(None, axes)
    f = jax.shard_map(fn, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(f, q, k, v)
