"""The pipelined exchanges (issue 22) beyond exactness (tests/test_exactness.py runs
Ulysses and the hybrid over every head-group count the heads allow, Ulysses, the
all-gather and the hybrid over every chunk count, against the reference): the counts
each shape allows and the defaults, and bad counts refused with the counts that work."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_seqpar as sp
from jax_seqpar.strategies import heads as head_split

B, S, D = 1, 64, 8


def _mesh(strategy, outer=2):
    devices = np.array(jax.devices())
    if strategy == "hybrid":
        return Mesh(devices.reshape(outer, 8 // outer), ("dcn", "ici")), ("dcn", "ici")
    return Mesh(devices, ("sp",)), "sp"


def test_ulysses_chunk_counts_and_default():
    assert head_split.piece_counts(8) == (1, 2, 3, 4)
    assert head_split.piece_sizes(2048, 5) == (128, 512, 512, 512, 256, 128)
    assert head_split.piece_sizes(8, 1) == (8,)
    # every count a length allows cuts it whole, L/4 whole or not (126: pieces of 63, 32, 31)
    for local_len in range(2, 400, 2):
        for pieces in head_split.piece_counts(local_len):
            sizes = head_split.piece_sizes(local_len, pieces)
            assert sum(sizes) == local_len and min(sizes) > 0, (local_len, pieces, sizes)
    # 2048 tokens a device: the most auto pieces; 8: none (a smallest chunk of 16 tokens)
    assert head_split.default_pieces(2048, 8) == head_split.MAX_AUTO_PIECES
    assert head_split.default_pieces(8, 8) == 1
    assert head_split.resolve_pieces(True, "auto", "auto", 16, 4, 8, 2048) == (5, 1)
    # the default pieces the sequence where the local length allows (no more memory
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


def test_chunk_counts_and_default():
    from jax_seqpar.strategies import gathered_pieces

    assert gathered_pieces.piece_counts(8) == (1, 2, 4, 8)
    assert gathered_pieces.default_pieces(16384 // 8) == gathered_pieces.MAX_AUTO_PIECES
    assert gathered_pieces.default_pieces(256) == 2 and gathered_pieces.default_pieces(100) == 1
    with pytest.raises(ValueError, match="pieces=3 must be a positive divisor of the 8"):
        gathered_pieces.resolve_gathered_pieces(3, 8)


@pytest.mark.parametrize("strategy, options, match", [
    ("ulysses", dict(head_groups=3),
     r"head_groups=3 does not split the 2 query heads and 1 K/V head\(s\) .*num_heads=16, "
     r"num_kv_heads=4 over 8 devices.* one of \(1, 2\) or 'auto'"),
    ("ulysses", dict(head_groups=0), r"head_groups=0 .* one of \(1, 2\)"),
    ("hybrid", dict(head_groups=8), r"head_groups=8 does not split the 4 query heads .* "
     r"over 4 devices.* one of \(1, 2, 4\)"),
    ("ulysses", dict(pieces=5), r"pieces=5 does not cut the 8 tokens a device holds .* "
     r"one of \(1, 2, 3, 4\) or 'auto'"),
    ("ulysses", dict(pieces=2, head_groups=2), r"pieces and head groups do not combine"),
    ("ulysses", dict(overlap=False, pieces=2), r"overlap=False sends each exchange whole"),
    ("allgather", dict(pieces=3),
     r"pieces=3 must be a positive divisor of the 8 tokens each device holds: one of "
     r"\(1, 2, 4, 8\)"),
    ("allgather", dict(pieces="8"), r"pieces='8' must be a positive divisor"),
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
