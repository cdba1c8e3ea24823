"""The global-view entry point: one call shards the sequence over a mesh and attends.

``sequence_parallel_attention`` takes global ``[B, S, H, D]`` arrays, pads the
sequence to what the strategy and layout need, places the arrays sequence-sharded
on the mesh, runs the chosen strategy inside ``jax.shard_map`` and returns the
output at the caller's length, in the caller's token order, sharded like its
queries. Tokens either arrive in natural order and are relayouted inside the
shards (zigzag: two half-shard ``ppermute`` s; striped: one ``all_to_all``), or
arrive already laid out with their ``positions`` and are not moved. Explicit-axis
meshes (the ``jax.make_mesh`` default) and Auto meshes both work; batch and head
shardings (data and tensor parallelism) are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar import kernels
from jax_seqpar.api import placement as _placement
from jax_seqpar.core import checks, layout as layouts, masks, packing
from jax_seqpar.core.merge import check_sinks
from jax_seqpar.core.meshes import split_axis
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import plan as planning
from jax_seqpar.strategies import registry
from jax_seqpar.kernels.contract import check_softcap
from jax_seqpar.strategies.inputs import (check_ids, check_options, check_self_attention,
                                          empty_result)
from jax_seqpar.strategies.local import local_attention

#: What ``strategy=`` takes: a registered strategy that runs on the global view, or "auto".
STRATEGIES = ("auto",) + tuple(registry.STRATEGIES)
LAYOUTS = ("auto", "contiguous", "zigzag", "striped", "per_document")


def _keep(x, *, axis_name):
    return x


# Per-shard relayouts from the contiguous split into each token order and back.
_RELAYOUTS = {
    "contiguous": (_keep, _keep),
    "zigzag": (layouts.to_zigzag, layouts.from_zigzag),
    "striped": (layouts.to_striped, layouts.from_striped),
}


def axis_name_of(axes: tuple):
    """The ``axis_name`` collectives take for sequence ``axes``: one name or the tuple."""
    return axes[0] if len(axes) == 1 else axes


def can_check_vma(kernel: str) -> bool:
    """Whether ``shard_map`` may check varying axes around ``kernel``.

    The Pallas interpreter (``kernel="pallas"`` lowered for anything but CUDA,
    ``kernel="mosaic"`` for anything but TPU) loses the varying-axes types inside
    ``shard_map``; JAX's own error asks for ``check_vma=False`` there. The lowering
    platform is not known when ``shard_map`` traces, so a program that may interpret
    never checks.
    """
    return not kernels.may_interpret(kernel)


def per_shard_fn(strategy: str, axes: tuple):
    """The per-shard attention function for ``strategy`` over the sequence ``axes``."""
    entry = registry.get(strategy)
    if entry.seq_axes == 2 and len(axes) != 2:  # the others run over the axes flattened
        raise ValueError(f"strategy={strategy!r} runs over two sequence axes (outer, inner); "
                         f"got seq_axes={axes}. Pass ulysses_size= to split one axis in two.")
    return functools.partial(entry.attention, seq_axes=axis_name_of(axes))


def _choose_strategy(q, k, v, mesh, axes: tuple, causal: bool, window, batch_shards: int,
                     head_shards: int):
    """``(strategy, ulysses_size)`` for the batch rows and heads one sequence group really
    holds: a tuned plan, else the hardware model's choice."""
    batch, seq_len, heads, head_dim = q.shape
    # Planned at the length the call pads to (whole zigzag chunks on every device).
    seq_len = _placement.padded_length(seq_len, 2 * math.prod(mesh.shape[a] for a in axes))
    local = LayerShape(batch // batch_shards, seq_len, heads // head_shards,
                       k.shape[2] // head_shards, head_dim, v.shape[3], dtype=q.dtype,
                       causal=causal, window=window)
    return planning.auto_choice(local, mesh, axes)


def sequence_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Optional[jax.sharding.Mesh],
    seq_axes: Union[str, tuple] = "sp",
    strategy: str = "auto",
    causal: bool = False,
    segment_ids: Optional[jax.Array] = None,
    positions: Optional[jax.Array] = None,
    kv_segment_ids: Optional[jax.Array] = None,
    window=None,
    scale: Optional[float] = None,
    layout: str = "auto",
    kernel: str = "auto",
    block_sizes=None,
    batch_axes=None,
    softcap: Optional[float] = None,
    sinks: Optional[jax.Array] = None,
    return_lse: bool = False,
    ulysses_size: Optional[int] = None,
    overlap: Union[bool, str] = "auto",
    chunks: Union[int, str] = "auto",
    head_groups: Union[int, str] = "auto",
):
    """Exact attention with the sequence split over ``seq_axes`` of ``mesh``.

    Two ways to order the tokens. Without ``positions``, ``q, k, v`` are in natural
    order and the call relayouts them inside the shards (``layout``) and back: a
    convenience for one-off calls that pays the relayout's traffic every call.
    With ``positions``, the tokens are already in the order the model keeps them in
    (put a whole batch into a layout once with :func:`jax_seqpar.permute_batch`)
    and no relayout happens: a layer then sends exactly ``jax_seqpar.comm_bytes``.

    Any sequence length works: the call pads to what the strategy and layout need,
    masks the padding and returns the caller's length.

    Args:
      q: ``[B, S, H, Dqk]`` global queries.
      k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` (``H % Hkv == 0``).
      mesh: the device mesh (Explicit or Auto axis types), or None: attend on the
        caller's devices without splitting the sequence (the same kernels and masks;
        ``seq_axes``, ``strategy``, ``layout``, ``batch_axes`` and ``ulysses_size``
        must then keep their defaults: a ``ValueError`` otherwise).
      seq_axes: the mesh axis splitting the sequence, or ``(outer, inner)``:
        ``"hybrid"`` runs Ulysses over ``inner`` and the ring over ``outer``.
      strategy: ``"ulysses"``, ``"ring"``, ``"hybrid"``, ``"allgather"`` or
        ``"auto"`` (a plan tuned on this mesh, else :func:`jax_seqpar.planning.plan.plan` for
        the devices' hardware preset, counting the batch rows and heads each sequence
        group holds: :func:`jax_seqpar.planning.plan.auto_choice`).
      causal, window: the mask on true token positions (see ``MaskSpec``): ``causal``
        a bool, ``window`` one int or ``(left, right)`` of non-negative ints.
      segment_ids: ``int32[B, S]`` packed documents attend within themselves
        (``-2**31`` is reserved for padding). Ids, positions: any integer dtype
        whose values fit int32 (:mod:`jax_seqpar.core.checks`).
      positions: ``int32[B, S]`` global positions of the tokens in the order given,
        or None (natural order, relayouted by ``layout``).
      kv_segment_ids: ``int32[B, S]`` the keys' own segment ids where they differ from
        the queries' (e.g. padded keys of ragged rows), or None: ``segment_ids``.
      scale: a finite number; defaults to ``1/sqrt(Dqk)``.
      layout: ``"zigzag"``, ``"striped"``, ``"contiguous"``, ``"per_document"`` or
        ``"auto"`` (zigzag where it balances causal work: ring, hybrid and
        all-gather with ``causal=True`` and no window; contiguous with a window,
        whose ring and all-gather then exchange only the halo the window reaches);
        must be ``"auto"`` or ``"contiguous"`` with ``positions``.
        ``"per_document"`` (needs ``segment_ids``) balances causal work within packed
        documents (:mod:`jax_seqpar.core.packing`): the call computes the order from
        the segment ids and gathers the whole sequence into it and back, every call;
        a model applies it once per batch instead (:func:`jax_seqpar.permute_batch`).
      kernel: ``"auto"`` (Triton on GPU, Mosaic on TPU, XLA elsewhere: chosen by the
        platform the program is lowered for; :func:`jax_seqpar.kernels.get`), ``"xla"``,
        ``"pallas"`` or ``"mosaic"``.
      block_sizes: tile sizes (:class:`jax_seqpar.kernels.BlockSizes`, one class for every
        kernel; a size left None is the running kernel's default), or None.
      batch_axes: mesh axes the batch is sharded over (data parallelism), or None:
        read from the inputs' sharding, and on Auto meshes under ``jit`` the mesh
        axes outside ``seq_axes`` that divide the batch.
      softcap: logits become ``softcap * tanh(s / softcap)`` before masking (Gemma 2);
        a positive number, ``inf`` meaning no cap (the limit).
      sinks: ``[H]`` float logits of a zero-valued virtual key per head (gpt-oss:
        ``p_j = exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k))``), differentiable.
      return_lse: also return the float32 ``[B, S, H]`` log-sum-exp of every row
        (sinks included), for callers that merge partial results.
      ulysses_size: with ``strategy="hybrid"`` (or ``"auto"``, which it then makes the
        hybrid), Ulysses over groups of this many neighbouring sequence devices and the
        ring across the groups, on the same devices
        (:func:`jax_seqpar.core.meshes.split_axis`: one axis works too).
      overlap, chunks, head_groups: how Ulysses' exchange (``"ulysses"``, the hybrid's
        inner one) is pipelined behind the kernel: ``"auto"`` (head groups, the
        planner's rule: :func:`jax_seqpar.strategies.heads.resolve_pieces`),
        ``overlap=True`` (Ulysses also along the sequence, in doubling chunks: about
        90 % of the bytes hidden in a compiled training step, at 1.8-2.9x the temp
        memory of ``overlap=False``), ``overlap=False`` (each exchange whole, one kernel
        call), or forced counts for experiments (``chunks`` also sets the all-gather's
        pieces); a strategy without the keyword refuses a value other than ``"auto"``.

    Returns:
      ``[B, S, H, Dv]`` in ``q.dtype``, in the caller's token order, sharded like
      ``q`` on Explicit meshes (its type's batch, sequence and head entries; an
      unsharded ``q`` gives an unsharded output, as ``jax.nn`` would); with
      ``return_lse``, ``(out, lse)``. A batch or sequence of length 0 gives an empty
      result.

    Raises:
      ValueError: bad shapes, unknown axes/strategy/layout, a layout with
        ``positions``, heads a Ulysses axis does not divide, ids or positions that
        are not integers fitting int32 (or use the padding id), options of the wrong
        type or range, or mesh-only arguments with ``mesh=None``.

    >>> mesh = jax.make_mesh((8,), ("sp",))
    >>> out = sequence_parallel_attention(q, k, v, mesh=mesh, strategy="ring", causal=True)
    """
    segment_ids = check_self_attention(q, k, v, segment_ids)
    batch, seq_len = q.shape[:2]
    positions = check_ids("positions", positions, batch, seq_len)
    kv_segment_ids = check_ids("kv_segment_ids", kv_segment_ids, batch, seq_len, segments=True)
    check_options(causal=causal, window=window, scale=scale, softcap=softcap)
    return_lse = checks.flag("return_lse", return_lse)
    sinks = check_sinks(sinks, q.shape[2])
    if mesh is None:
        checks.mesh_only(seq_axes=(seq_axes, "sp"), strategy=(strategy, "auto"),
                         layout=(layout, "auto"), batch_axes=(batch_axes, None),
                         ulysses_size=(ulysses_size, None))
        return local_attention(
            q, k, v, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
            positions=positions, kv_positions=positions, window=window, scale=scale,
            kernel=kernel, block_sizes=block_sizes, softcap=softcap, sinks=sinks,
            return_lse=return_lse)
    axes = (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes)
    for name in axes:
        if name not in mesh.shape:
            raise ValueError(f"seq_axes names {name!r}, which is not an axis of the mesh "
                             f"{dict(mesh.shape)}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}.")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}.")
    if positions is not None and layout not in ("auto", "contiguous"):
        raise ValueError(f"positions= says the tokens are already in the order to keep; "
                         f"layout={layout!r} would relayout them again. Put the batch into "
                         "the layout once (jax_seqpar.permute_batch) and drop layout=.")
    if layout == "per_document" and segment_ids is None:
        raise ValueError('layout="per_document" orders the tokens by their documents: pass '
                         "segment_ids= (int32[B, S]); without documents use "
                         'layout="zigzag".')
    if not (batch and seq_len):  # no token: jax.nn's empty result, no program to shard
        return empty_result(q, v, return_lse)
    batch_entry, head_entry = _placement.kept_entries(q, k, v, mesh, axes, batch_axes)
    if ulysses_size is not None:  # the hybrid's split, named: nothing left to choose
        if strategy not in ("auto", "hybrid"):
            raise ValueError(f'ulysses_size={ulysses_size} needs strategy="hybrid" (or '
                             f'"auto"). Got strategy={strategy!r}.')
        strategy = "hybrid"
        split_axis(mesh, axes, ulysses_size)  # refuses a size the devices do not divide
    elif strategy == "auto":
        strategy, ulysses_size = _choose_strategy(
            q, k, v, mesh, axes, causal, window, _placement.entry_size(mesh, batch_entry),
            _placement.entry_size(mesh, head_entry))
    pipeline = _pipeline_keywords(strategy, overlap=overlap, chunks=chunks,
                                  head_groups=head_groups)
    call = _Call(mesh=mesh, axes=axes, strategy=strategy, ulysses_size=ulysses_size,
                 layout="contiguous" if positions is not None else layout, causal=bool(causal),
                 window=masks.normalize_window(window), scale=checks.scale(scale),
                 kernel=kernel, block_sizes=block_sizes, softcap=check_softcap(softcap),
                 return_lse=return_lse,
                 batch_entry=batch_entry, head_entry=head_entry,
                 out_spec=_placement.caller_spec(q, mesh), pipeline=pipeline)
    arrays = _placement.onto(mesh, q, k, v, segment_ids, kv_segment_ids, positions,
                             None if sinks is None else jnp.asarray(sinks))
    return _on_mesh(*arrays, call=call)


@dataclasses.dataclass(frozen=True)
class _Call:
    """Everything static about one global call (hashable: the key of its compiled program)."""

    mesh: jax.sharding.Mesh
    axes: tuple
    strategy: str
    ulysses_size: Optional[int]
    layout: str
    causal: bool
    window: Optional[tuple]
    scale: Optional[float]
    kernel: str
    block_sizes: object
    softcap: Optional[float]
    return_lse: bool
    batch_entry: object
    head_entry: object
    out_spec: Optional[P]
    pipeline: tuple = ()


def _pipeline_keywords(strategy: str, **keywords) -> tuple:
    """The pipelining keywords set (not ``"auto"``) as ``(name, value)`` pairs, refused by
    name where ``strategy``'s per-shard function does not take them."""
    taken = inspect.signature(registry.get(strategy).attention).parameters
    chosen = tuple((name, value) for name, value in keywords.items()
                   if not (isinstance(value, str) and value == "auto"))
    for name, value in chosen:
        if name not in taken:
            raise ValueError(f"{name}={value!r} does not apply to strategy={strategy!r}, "
                             "which does not pipeline that way; drop it.")
    return chosen


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Where one call's ``shard_map`` runs: ``mesh`` (the caller's, or for a hybrid with
    ``ulysses_size`` its ``(ring, ulysses)`` split, :func:`~jax_seqpar.core.meshes.split_axis`)
    and its sequence ``axes``; the ``layout`` (``"auto"`` resolved), ``num_shards`` along
    the axes and the padded sequence ``length``."""

    mesh: jax.sharding.Mesh
    axes: tuple
    layout: str
    num_shards: int
    length: int


def _geometry(call: _Call, seq_len: int) -> _Geometry:
    mesh, axes = call.mesh, call.axes
    if call.ulysses_size is not None:  # hybrid on a (ring, ulysses) split of the same devices
        mesh, axes = split_axis(mesh, axes, call.ulysses_size)
    num_shards = math.prod(mesh.shape[name] for name in axes)
    layout = call.layout
    if layout == "auto":
        layout = registry.default_layout(call.strategy, call.causal, call.window, seq_len=seq_len,
                                num_shards=num_shards)
    per_shard = {"contiguous": 1, "zigzag": 2, "striped": num_shards, "per_document": 1}[layout]
    return _Geometry(mesh, axes, layout, num_shards,
                     _placement.padded_length(seq_len, num_shards * per_shard))


def _on_mesh(q, k, v, segment_ids, kv_segment_ids, positions, sinks, *, call: _Call):
    """``call`` run on its global arrays by its one compiled program."""
    arrays = (q, k, v, segment_ids, kv_segment_ids, positions, sinks)
    divides = q.shape[1] % math.prod(call.mesh.shape[a] for a in call.axes) == 0
    in_shardings = _placement.boundary_shardings(
        arrays, call.mesh, call.batch_entry, axis_name_of(call.axes) if divides else None,
        call.head_entry)
    return _program(call, q.shape[1], in_shardings)(*arrays)


@functools.lru_cache(maxsize=None)
def _program(call: _Call, seq_len: int, in_shardings: tuple):
    """The jitted program of one call signature at one sequence length and input sharding
    (:func:`~jax_seqpar.api.placement.boundary_shardings`).

    Padding, placement, ``shard_map`` and the way back are staged together (eager
    op-by-op execution cannot transpose a reshard of a padded array whose length the
    devices do not divide), and eager callers run one program. Both its ends are
    declared on the caller's mesh, so no mesh the call builds inside escapes: JAX names
    each output of a program that has no sharding of its own (arrays typed unsharded,
    every array on an Auto mesh) after the first concrete mesh among the program's
    input shardings, then the shardings inside it, a jit's boundary before its body.
    Left to the ``shard_map`` over a split mesh, the caller's weights came back typed
    on that mesh and the next step failed.
    """
    geometry = _geometry(call, seq_len)
    seq_spec = P(call.batch_entry, axis_name_of(call.axes), call.head_entry, None)
    spec = _placement.result_spec(seq_spec, call.out_spec, padded=geometry.length != seq_len)
    out_shardings = tuple(NamedSharding(call.mesh, P(*spec[:ndim]))
                          for ndim in ((4, 3) if call.return_lse else (4,)))
    return jax.jit(functools.partial(_attend, call=call, geometry=geometry,
                                     in_shardings=in_shardings),
                   in_shardings=in_shardings,
                   out_shardings=out_shardings if call.return_lse else out_shardings[0])


def _attend(q, k, v, segment_ids, kv_segment_ids, positions, sinks, *, call: _Call,
            geometry: _Geometry, in_shardings: tuple):
    q, k, v, segment_ids, kv_segment_ids, positions, sinks = _placement.bind(
        (q, k, v, segment_ids, kv_segment_ids, positions, sinks), in_shardings, call.mesh)
    seq_len, length, num_shards = q.shape[1], geometry.length, geometry.num_shards
    mesh, axes, layout = geometry.mesh, geometry.axes, geometry.layout
    if length != seq_len:
        q, k, v, segment_ids, kv_segment_ids, positions = _placement.pad_inputs(
            length, q, k, v, segment_ids, kv_segment_ids, positions)
    inverse = None
    if layout == "per_document":  # a data-dependent order: gathered here, before shard_map
        q, k, v, segment_ids, kv_segment_ids, positions, inverse = _per_document(
            call, num_shards, q, k, v, segment_ids, kv_segment_ids)
        layout = "contiguous"
    attend = per_shard_fn(call.strategy, axes)
    axis_name = axis_name_of(axes)
    relayout_in, relayout_out = _RELAYOUTS[layout]

    def body(q, k, v, segment_ids, kv_segment_ids, positions, sinks):
        q, k, v, segment_ids, kv_segment_ids = (
            None if x is None else relayout_in(x, axis_name=axis_name)
            for x in (q, k, v, segment_ids, kv_segment_ids))  # [B, L, heads, D]
        # Left out (None) only for the plain contiguous split, the order strategies know:
        # a window turns it into a halo exchange.
        if positions is None and layout != "contiguous":
            positions = layouts.shard_positions(layout, q.shape[1], axis_name=axis_name)
            positions = jnp.broadcast_to(positions, q.shape[:2])  # [B, L]
        result = attend(q, k, v, causal=call.causal, window=call.window,
                        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                        positions=positions, scale=call.scale, kernel=call.kernel,
                        block_sizes=call.block_sizes, softcap=call.softcap, sinks=sinks,
                        return_lse=call.return_lse,
                        **dict(call.pipeline))  # [B, L, H, Dv] (and lse [B, L, H])
        return jax.tree.map(lambda x: relayout_out(x, axis_name=axis_name), result)

    batch_entry, head_entry = call.batch_entry, call.head_entry
    qkv_spec = P(batch_entry, axis_name, head_entry, None)
    ids_spec = P(batch_entry, axis_name)
    ids = (segment_ids, kv_segment_ids, positions)
    out_specs = qkv_spec
    if call.return_lse:
        out_specs = (qkv_spec, P(batch_entry, axis_name, head_entry))
    mapped = jax.shard_map(
        body, mesh=mesh,
        in_specs=(qkv_spec,) * 3 + tuple(P() if x is None else ids_spec for x in ids)
        + (P(head_entry),), out_specs=out_specs, check_vma=can_check_vma(call.kernel))
    with _placement.on_mesh(mesh, call.mesh):  # a split mesh is the context of its shard_map
        q, k, v = (_placement.place(x, mesh, qkv_spec) for x in (q, k, v))
        ids = [None if x is None else _placement.place(x, mesh, ids_spec) for x in ids]
        if sinks is not None:
            sinks = _placement.place(sinks, mesh, P(head_entry))
        result = mapped(q, k, v, *ids, sinks)
    if inverse is not None:  # back to natural order
        result = jax.tree.map(lambda x: _gather_seq(x, inverse, call), result)
    # Back on the caller's mesh (a split mesh has the same devices: no data moves there)
    # at the caller's length, sharded like q.
    seq_spec = P(batch_entry, axis_name_of(call.axes), head_entry, None)
    out_spec = call.out_spec
    return jax.tree.map(
        lambda x: _placement.finish(x, call.mesh, seq_len, P(*seq_spec[:x.ndim]),
                                    None if out_spec is None else P(*out_spec[:x.ndim])),
        result)


def _gather_seq(x, order, call: _Call):
    """``x [B, S, ...]`` reordered along the sequence by ``order int32[B, S]``, on the
    caller's mesh with the sequence whole (an Explicit type cannot gather a sharded dim)."""
    spec = P(call.batch_entry, None, call.head_entry, None)[:x.ndim]
    x = _placement.place(x, call.mesh, P(*spec))
    index = order.reshape(order.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def _per_document(call: _Call, num_shards: int, q, k, v, segment_ids, kv_segment_ids):
    """The call's arrays in the per-document order of its segment ids, the ``positions``
    of that order and its inverse (:mod:`jax_seqpar.core.packing`, traced)."""
    ids = _placement.place(segment_ids, call.mesh, P(call.batch_entry, None))
    block = getattr(call.block_sizes, "block_q", None) or packing.DEFAULT_BLOCK
    positions = packing.per_document_positions(ids, num_shards, block)  # [B, S]
    moved = [None if x is None else _gather_seq(x, positions, call)
             for x in (q, k, v, segment_ids, kv_segment_ids)]
    return (*moved, positions, jnp.argsort(positions, axis=1).astype(jnp.int32))
