"""The one compiled program of a global call: pad, place, ``shard_map``, and back.

:func:`run` takes a call's global arrays and its static description (:class:`~jax_seqpar.strategies.inputs.Call`, built
by :func:`jax_seqpar.api.attention.sequence_parallel_attention` from its keywords) and
runs the call's program, compiled once per call signature, sequence length and input
sharding. The program pads the sequence to what the layout needs, relayouts the tokens
inside the shards (or gathers them into the per-document order), runs the strategy's
per-shard function inside ``jax.shard_map`` (over the caller's mesh, or the hybrid's
split of it) and returns the result on the caller's mesh at the caller's length.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar import kernels
from jax_seqpar.api import placement as _placement
from jax_seqpar.core import layout as layouts, packing
from jax_seqpar.core.meshes import split_axis
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.inputs import Call, Metadata
from jax_seqpar.kernels import KernelName
from jax_seqpar.strategies.registry import StrategyName

__all__ = ["axis_name_of", "can_check_vma", "per_shard_fn", "run"]


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


def can_check_vma(kernel: KernelName) -> bool:
    """Whether ``shard_map`` may check varying axes around ``kernel``.

    The Pallas interpreter (``kernel="pallas"`` lowered for anything but CUDA,
    ``kernel="mosaic"`` for anything but TPU) loses the varying-axes types inside
    ``shard_map``; JAX's own error asks for ``check_vma=False`` there. The lowering
    platform is not known when ``shard_map`` traces, so a program that may interpret
    never checks.
    """
    return not kernels.may_interpret(kernel)


def per_shard_fn(strategy: StrategyName, axes: tuple, *, core: bool = False):
    """The per-shard attention function for ``strategy`` over the sequence ``axes``
    (``core``: its core, ``f(q, k, v, call, metadata, **pipeline)``, which the global
    view calls with the call's :class:`~jax_seqpar.strategies.inputs.Call`)."""
    entry = registry.get(strategy)
    if entry.num_seq_axes == 2 and len(axes) != 2:  # the others run over the axes flattened
        raise ValueError(f"strategy={strategy!r} runs over two sequence axes (outer, inner); "
                         f"got seq_axes={axes}. Pass ulysses_size= to split one axis in two.")
    # per_shard sets the function attribute `core`, which Callable does not declare.
    function = entry.attention.core if core else entry.attention  # type: ignore[attr-defined]
    return functools.partial(function, seq_axes=axis_name_of(axes))


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Where one call's ``shard_map`` runs: ``mesh`` (the caller's, or for a hybrid with
    ``ulysses_size`` its ``(ring, ulysses)`` split, :func:`~jax_seqpar.core.meshes.split_axis`)
    and its sequence ``axes``; the ``layout`` (``"auto"`` resolved), ``num_shards`` along
    the axes and the padded sequence ``length``."""

    mesh: jax.sharding.Mesh
    axes: tuple
    layout: layouts.LayoutName
    num_shards: int
    length: int


def _global(call: Call) -> tuple[jax.sharding.Mesh, StrategyName]:
    """The mesh and the strategy of a global call (the entry point sets both)."""
    if call.mesh is None or call.strategy is None:
        raise ValueError(f"a global call runs on a mesh with a strategy. Got "
                         f"mesh={call.mesh!r}, strategy={call.strategy!r}.")
    return call.mesh, call.strategy


def _geometry(call: Call, seq_len: int) -> _Geometry:
    mesh, strategy = _global(call)
    axes = call.axes
    if call.ulysses_size is not None:  # hybrid on a (ring, ulysses) split of the same devices
        mesh, axes = split_axis(mesh, axes, call.ulysses_size)
    num_shards = math.prod(mesh.shape[name] for name in axes)
    layout = call.layout
    if layout == "auto":
        layout = registry.default_layout(strategy, call.spec, seq_len=seq_len,
                                         num_shards=num_shards)
    per_shard = {"contiguous": 1, "zigzag": 2, "striped": num_shards, "per_document": 1}[layout]
    return _Geometry(mesh, axes, layout, num_shards,
                     _placement.padded_length(seq_len, num_shards * per_shard))


def run(q: jax.Array, k: jax.Array, v: jax.Array, metadata: Metadata, *, call: Call):
    """``call`` run on its global arrays (``metadata``: the ids and sinks beside q, k, v)
    by its one compiled program."""
    arrays = (q, k, v, *metadata.arrays())
    mesh, _ = _global(call)
    divides = q.shape[1] % math.prod(mesh.shape[a] for a in call.axes) == 0
    in_shardings = _placement.boundary_shardings(
        arrays, mesh, call.batch_entry, axis_name_of(call.axes) if divides else None,
        call.head_entry)
    return _program(call, q.shape[1], in_shardings)(*arrays)


@functools.lru_cache(maxsize=None)
def _program(call: Call, seq_len: int, in_shardings: tuple):
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
    out_shardings = tuple(NamedSharding(_global(call)[0], P(*spec[:ndim]))
                          for ndim in ((4, 3) if call.return_lse else (4,)))
    return jax.jit(functools.partial(_attend, call=call, geometry=geometry,
                                     in_shardings=in_shardings),
                   in_shardings=in_shardings,
                   out_shardings=out_shardings if call.return_lse else out_shardings[0])


def _attend(*arrays, call: Call, geometry: _Geometry, in_shardings: tuple):
    caller_mesh, strategy = _global(call)
    q, k, v, *rest = _placement.bind(arrays, in_shardings, caller_mesh)
    metadata = Metadata(*rest)
    seq_len, length, num_shards = q.shape[1], geometry.length, geometry.num_shards
    mesh, axes, layout = geometry.mesh, geometry.axes, geometry.layout
    if length != seq_len:
        q, k, v, metadata = _placement.pad_inputs(length, q, k, v, metadata)
    inverse = None
    if layout == "per_document":  # a data-dependent order: gathered here, before shard_map
        q, k, v, metadata, inverse = _per_document(call, num_shards, q, k, v, metadata)
        layout = "contiguous"
    attend = per_shard_fn(strategy, axes, core=True)
    axis_name = axis_name_of(axes)
    relayout_in, relayout_out = _RELAYOUTS[layout]

    def body(q, k, v, metadata):
        def relayout(x):
            return None if x is None else relayout_in(x, axis_name=axis_name)

        q, k, v = (relayout(x) for x in (q, k, v))  # [B, L, heads, D]
        metadata = dataclasses.replace(metadata, **{  # the token ids travel with the tokens
            name: relayout(getattr(metadata, name))
            for name in ("segment_ids", "kv_segment_ids", "bidirectional_ids")})  # [B, L]
        # Left out (None) only for the plain contiguous split, the order strategies know:
        # a window turns it into a halo exchange.
        if metadata.positions is None and layout != "contiguous":
            positions = layouts.shard_positions(layout, q.shape[1], axis_name=axis_name)
            metadata.positions = jnp.broadcast_to(positions, q.shape[:2])  # [B, L]
        result = attend(q, k, v, call, metadata,
                        **dict(call.pipeline))  # [B, L, H, Dv] (and lse [B, L, H])
        return jax.tree.map(lambda x: relayout_out(x, axis_name=axis_name), result)

    batch_entry, head_entry = call.batch_entry, call.head_entry
    qkv_spec = P(batch_entry, axis_name, head_entry, None)
    ids_spec = P(batch_entry, axis_name)
    id_fields = ("segment_ids", "kv_segment_ids", "positions", "bidirectional_ids")
    specs = Metadata(**{name: P() if getattr(metadata, name) is None else ids_spec
                        for name in id_fields}, sinks=P(head_entry))
    out_specs: P | tuple[P, P] = qkv_spec
    if call.return_lse:
        out_specs = (qkv_spec, P(batch_entry, axis_name, head_entry))
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(qkv_spec,) * 3 + (specs,), out_specs=out_specs,
        check_vma=can_check_vma(call.kernel))
    with _placement.on_mesh(mesh, caller_mesh):  # a split mesh is the context of its shard_map
        q, k, v = (_placement.place(x, mesh, qkv_spec) for x in (q, k, v))
        metadata = Metadata(*(None if x is None else _placement.place(x, mesh, spec)
                              for x, spec in zip(metadata.arrays(), specs.arrays())))
        result = mapped(q, k, v, metadata)
    if inverse is not None:  # back to natural order
        result = jax.tree.map(lambda x: _gather_seq(x, inverse, call), result)
    # Back on the caller's mesh (a split mesh has the same devices: no data moves there)
    # at the caller's length, sharded like q.
    seq_spec = P(batch_entry, axis_name_of(call.axes), head_entry, None)
    out_spec = call.out_spec
    return jax.tree.map(
        lambda x: _placement.finish(x, caller_mesh, seq_len, P(*seq_spec[:x.ndim]),
                                    None if out_spec is None else P(*out_spec[:x.ndim])),
        result)


def _gather_seq(x, order, call: Call):
    """``x [B, S, ...]`` reordered along the sequence by ``order int32[B, S]``, on the
    caller's mesh with the sequence whole (an Explicit type cannot gather a sharded dim)."""
    spec = P(call.batch_entry, None, call.head_entry, None)[:x.ndim]
    x = _placement.place(x, _global(call)[0], P(*spec))
    index = order.reshape(order.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def _per_document(call: Call, num_shards: int, q, k, v, metadata: Metadata):
    """``(q, k, v, metadata, inverse)``: the call's arrays in the per-document order of
    its segment ids, with the ``positions`` of that order, and the order's inverse
    (:mod:`jax_seqpar.core.packing`, traced)."""
    if metadata.segment_ids is None:  # sequence_parallel_attention refuses this first
        raise ValueError('layout="per_document" orders the tokens by their documents: pass '
                         "segment_ids= (int32[B, S]).")
    ids = _placement.place(metadata.segment_ids, _global(call)[0], P(call.batch_entry, None))
    block = getattr(call.block_sizes, "block_q", None) or packing.DEFAULT_BLOCK
    positions = packing.per_document_positions(ids, num_shards, block)  # [B, S]

    def moved(x):
        return None if x is None else _gather_seq(x, positions, call)

    metadata = dataclasses.replace(metadata, positions=positions, **{
        name: moved(getattr(metadata, name))
        for name in ("segment_ids", "kv_segment_ids", "bidirectional_ids")})
    q, k, v = (moved(x) for x in (q, k, v))
    return q, k, v, metadata, jnp.argsort(positions, axis=1).astype(jnp.int32)
