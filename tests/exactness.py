"""The exactness driver: one call of a strategy described as data (:class:`Case`), run from
a context users call from (tests/contexts.py) and compared with ``core.reference``.

A case names the entry point (the global :func:`jax_seqpar.sequence_parallel_attention`,
or a strategy's per-shard function inside ``jax.shard_map``), the strategy, the mesh, the
shape and dtype, the mask (static keywords, a mask family's per-token ids, documents),
the token order, sinks, softcap, the lse, the kernel and its tiles, and the pipeline
(``head_groups``, ``pieces``, ``overlap``). :func:`check` makes the inputs on the host and
asserts the output (and lse) and the gradients of q, k, v (and the sinks) equal the
reference's, computed in float32 from the same inputs (:meth:`contexts.Context.check`).
tests/test_exactness.py holds the cases.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import checks
import contexts
import jax_seqpar as sp
from jax_seqpar.core import reference
from jax_seqpar.strategies import registry

#: The per-token arrays a call takes besides q, k, v and the sinks, in argument order.
TOKEN_ARRAYS = ("segment_ids", "positions", "bidirectional_ids")
FAMILIES = ("chunked", "prefix_lm", "vlm", "mask_fn")


def every_third_diagonal(q, kv):
    """A ``mask_fn`` no family covers: keys at a distance of 1 mod 3 are hidden."""
    return (q.positions - kv.positions) % 3 != 1


def family(name: str, batch: int, seq: int) -> dict:
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
    assert name == "mask_fn", name
    return dict(causal=True, mask_fn=every_third_diagonal)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call against the reference.

    Attributes:
      strategy: a registered strategy (``"ring"``, ``"ulysses"``, ``"hybrid"``,
        ``"allgather"``, or one a test registers), or for the global entry ``"auto"`` or ``"local"`` (``mesh=None``,
        called inside the context's mesh).
      entry: ``"global"`` (``sequence_parallel_attention``) or ``"per_shard"`` (the
        strategy's function inside ``jax.shard_map``, the sequence split over the mesh).
      shape: ``(batch, seq, heads, kv_heads, head_dim, v_head_dim)``.
      dtype: of q, k and v (the sinks are float32).
      mask: keywords both the call and the reference take (``causal``, ``window``,
        ``chunk_size``, ``mask_fn``, ``scale``, ``softcap``); they override ``family``'s.
      family: a name of :data:`FAMILIES` (its keywords and per-token ids), or None.
      segments: ``(seed, documents)`` of :func:`checks.segments`, or None.
      order: the token order whose positions are passed (``"contiguous"``, ``"zigzag"``,
        ``"striped"``; documents follow their tokens), or None: no positions.
      layout: the global entry's ``layout`` keyword, or None (not passed).
      sinks: pass float32 sinks (and compare their gradient, which must not vanish).
      return_lse: compare the log-sum-exp too.
      kernel, block_sizes: the kernel and its tiles.
      pipeline: ``head_groups`` / ``pieces`` / ``overlap`` keywords.
      mesh: ``(shape, axis names)``; None: 8 devices as ``"sp"``, the hybrid's 2 x 4 as
        ``("dcn", "ici")``. The sequence is split over all its axes.
      ulysses_size: the global hybrid's split of a one-axis mesh, or None.
      context: a name of :data:`contexts.CONTEXTS` or :data:`contexts.JIT_CONTEXTS`.
      seed: of q, k, v (the sinks take ``seed + 1``).
      max_document_shards: ``D``: the tokens come in a random order (their positions)
        with documents each on at most ``D`` consecutive shards (:func:`home_documents`),
        and the call (not the reference) takes ``max_document_shards=D``.
    """

    strategy: str
    entry: str = "global"
    shape: tuple = (2, 64, 8, 8, 16, 16)
    dtype: object = jnp.float32
    mask: dict = dataclasses.field(default_factory=dict)
    family: Optional[str] = None
    segments: Optional[tuple] = None
    order: Optional[str] = None
    layout: Optional[str] = None
    sinks: bool = False
    return_lse: bool = False
    kernel: str = "auto"
    block_sizes: Optional[sp.BlockSizes] = None
    pipeline: dict = dataclasses.field(default_factory=dict)
    mesh: Optional[tuple] = None
    ulysses_size: Optional[int] = None
    context: str = "auto-jit"
    seed: int = 0
    max_document_shards: Optional[int] = None

    def mesh_axes(self) -> tuple:
        """``(mesh shape, axis names, seq_axes)``."""
        if self.mesh is not None:
            shape, names = self.mesh
        elif self.strategy == "hybrid" and self.ulysses_size is None:
            shape, names = (2, 4), ("dcn", "ici")
        else:
            shape, names = (8,), ("sp",)
        return shape, names, names[0] if len(names) == 1 else tuple(names)


def _order_positions(order: Optional[str], seq: int, shards: int):
    if order is None:
        return None
    return {"contiguous": sp.contiguous_positions(seq),
            "zigzag": sp.zigzag_positions(seq, shards),
            "striped": sp.striped_positions(seq, shards)}[order]


def home_documents(batch: int, seq: int, shards: int, bound: int, seed: int = 5):
    """``(segment_ids, positions)`` ``int32[B, S]`` in a laid-out order: every document on
    at most ``bound`` consecutive shards (cut at random inside windows of ``bound`` shards,
    the windows shifted by one shard on odd rows), the positions a random permutation
    (so within a document's span they are not monotone)."""
    rng = np.random.default_rng(seed)
    local = seq // shards
    ids = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        shift = (b % 2) * local if bound > 1 else 0
        edges = np.arange(-shift, seq, bound * local)
        cuts = np.concatenate([[e, e + rng.integers(1, bound * local)] for e in edges])
        cuts = np.unique(np.clip(cuts, 0, seq))
        ids[b] = np.searchsorted(cuts, np.arange(seq), side="right") - 1
    positions = np.stack([rng.permutation(seq) for _ in range(batch)]).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(positions)


def inputs(case: Case, shards: int):
    """``(args, keywords)``: ``(q, k, v, sinks, segment_ids, positions, bidirectional_ids)``
    (None where the case has none) and the static keywords both sides take."""
    batch, seq, heads, kv_heads, head_dim, v_head_dim = case.shape
    q, k, v = checks.normals([(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim),
                              (batch, seq, kv_heads, v_head_dim)], case.dtype, case.seed)
    sinks = checks.normal((heads,), jnp.float32, case.seed + 1) if case.sinks else None
    keywords = dict(family(case.family, batch, seq)) if case.family else {}
    keywords.update(case.mask)
    arrays = {name: keywords.pop(name, None) for name in TOKEN_ARRAYS}
    order = _order_positions(case.order, seq, shards)
    if order is not None:
        arrays["positions"] = jnp.broadcast_to(order, (batch, seq))
    if case.max_document_shards is not None:
        arrays["segment_ids"], arrays["positions"] = home_documents(
            batch, seq, shards, case.max_document_shards)
    if case.segments is not None:
        assert arrays["segment_ids"] is None, "the family has its documents"
        seed, documents = case.segments
        ids = checks.segments(batch, seq, seed=seed, documents=documents)
        arrays["segment_ids"] = ids if order is None else ids[:, order]
    return (q, k, v, sinks, *(arrays[name] for name in TOKEN_ARRAYS)), keywords


def _global(case: Case, keywords: dict, seq_axes):
    static = dict(keywords, kernel=case.kernel, return_lse=case.return_lse, **case.pipeline)
    if case.block_sizes is not None:
        static["block_sizes"] = case.block_sizes
    if case.layout is not None:
        static["layout"] = case.layout
    if case.ulysses_size is not None:
        static["ulysses_size"] = case.ulysses_size
    if case.max_document_shards is not None:
        static["max_document_shards"] = case.max_document_shards

    def build(mesh):
        if case.strategy == "local":
            where = dict(mesh=None)
        else:
            where = dict(mesh=mesh, seq_axes=seq_axes, strategy=case.strategy)

        def attend(q, k, v, sinks, *arrays):
            return sp.sequence_parallel_attention(q, k, v, sinks=sinks, **where, **static,
                                                  **dict(zip(TOKEN_ARRAYS, arrays)))
        return attend

    return build


def _per_shard(case: Case, keywords: dict, seq_axes):
    function = registry.get(case.strategy).attention  # a registered one too
    # Only what the case sets: a registered strategy may take no more than its mask.
    static = dict(keywords, seq_axes=seq_axes, **case.pipeline)
    if case.kernel != "auto":
        static["kernel"] = case.kernel
    if case.block_sizes is not None:
        static["block_sizes"] = case.block_sizes
    if case.return_lse:
        static["return_lse"] = True
    if case.max_document_shards is not None:
        static["max_document_shards"] = case.max_document_shards
    seq = P(None, seq_axes)

    def body(q, k, v, sinks, *arrays):
        given = {name: x for name, x in zip(TOKEN_ARRAYS + ("sinks",), (*arrays, sinks))
                 if x is not None}
        return function(q, k, v, **given, **static)

    def build(mesh):
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, P()) + (seq,) * 3,
                               out_specs=(seq, seq) if case.return_lse else seq)
        explicit = mesh.axis_types[0] == AxisType.Explicit

        def attend(*args):
            if explicit:  # shard_map takes arrays typed as its in_specs
                args = tuple(None if x is None else jax.reshard(
                    x, NamedSharding(mesh, seq if x.ndim > 1 else P())) for x in args)
            return mapped(*args)
        return attend

    return build


def check(case: Case, tolerances) -> None:
    """Assert ``case``'s output (and lse) and the gradients of q, k, v (and the sinks)
    equal the reference's, within ``tolerances`` of ``case.dtype``."""
    shape, names, seq_axes = case.mesh_axes()
    args, keywords = inputs(case, shards=math.prod(shape))
    argnums = (0, 1, 2, 3) if case.sinks else (0, 1, 2)
    build = (_per_shard if case.entry == "per_shard" else _global)(case, keywords, seq_axes)

    def theirs(q, k, v, sinks, *arrays):
        return reference.attention(q, k, v, sinks=sinks, return_lse=case.return_lse,
                                   **keywords, **dict(zip(TOKEN_ARRAYS, arrays)))

    context = contexts.Context(case.context)
    _, grads = context.check(build, args, theirs, tolerances, mesh=context.mesh(shape, names),
                             seq_axes=seq_axes, argnums=argnums)
    if case.sinks:  # the sinks really are used
        assert np.abs(np.asarray(grads[3], np.float32)).max() > 1e-3
