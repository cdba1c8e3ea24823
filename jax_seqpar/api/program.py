"""The one compiled program of a global call: pad, place, ``shard_map``, and back.

:func:`attend` is the one path every entry point takes: it takes a call's global arrays
and its three descriptions, built and checked once by the entry point: what is computed
(:class:`~jax_seqpar.kernels.options.Options`), the per-token data
(:class:`~jax_seqpar.strategies.inputs.Metadata`) and where it runs (:class:`Placement`),
and runs the call's program, compiled once per call signature, sequence length and input
sharding. The program pads the sequence to what the layout needs, relayouts the tokens
inside the shards (or gathers them into the per-document order), runs the strategy's
per-shard function inside ``jax.shard_map`` (over the caller's mesh, or the hybrid's
split of it) and returns the result on the caller's mesh at the caller's length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar import kernels
from jax_seqpar.api import placement as _placement
from jax_seqpar.core import layout as layouts, packing
from jax_seqpar.core.meshes import split_axis
from jax_seqpar.strategies import registry
from jax_seqpar.kernels.options import KernelName, Options
from jax_seqpar.strategies.inputs import Metadata, empty_result, operands
from jax_seqpar.strategies.local import local_attention
from jax_seqpar.strategies.registry import StrategyName

__all__ = ["Placement", "attend", "axis_name_of", "can_check_vma"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a global call runs: the one description of it, built and checked once by the
    entry point (:func:`jax_seqpar.api.attention.placement`); hashable, part of the key
    of the call's compiled program. Read only by this layer (``api/``).

    Attributes:
      mesh: the caller's mesh; axes: its sequence axes (names).
      strategy: a registered strategy's name (``"auto"`` already resolved).
      ulysses_size: the hybrid's Ulysses group on a split of the axes, or None.
      layout: the token order (``"auto"`` resolved when the program is built, by the
        padded length), ``"contiguous"`` for tokens given with their positions.
      batch_entry, head_entry: the mesh axes the batch and the heads stay sharded over.
      out_spec: the output's sharding (the queries'), or None (Auto meshes: XLA's).
      overlap, pieces, head_groups: the pipelining the caller set (``"auto"``: the
        strategy's choice); only keywords of the strategy's ``pipelining``.
    """

    mesh: jax.sharding.Mesh
    axes: tuple[str, ...]
    strategy: StrategyName
    ulysses_size: Optional[int] = None
    layout: Literal["auto", layouts.LayoutName] = "auto"
    batch_entry: str | tuple[str, ...] | None = None
    head_entry: str | tuple[str, ...] | None = None
    out_spec: Optional[P] = None
    overlap: bool | Literal["auto"] = "auto"
    pieces: int | Literal["auto"] = "auto"
    head_groups: int | Literal["auto"] = "auto"

    def pipelining(self) -> dict:
        """The strategy's pipelining keywords the caller set (not ``"auto"``)."""
        return {name: getattr(self, name) for name in registry.get(self.strategy).pipelining
                if not (isinstance(getattr(self, name), str) and getattr(self, name) == "auto")}


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


def _geometry(options: Options, placement: Placement, seq_len: int) -> _Geometry:
    mesh, axes = placement.mesh, placement.axes
    if placement.ulysses_size is not None:  # hybrid on a (ring, ulysses) split of the devices
        mesh, axes = split_axis(mesh, axes, placement.ulysses_size)
    num_shards = math.prod(mesh.shape[name] for name in axes)
    layout = placement.layout
    if layout == "auto":
        layout = registry.default_layout(placement.strategy, options.spec, seq_len=seq_len,
                                         num_shards=num_shards)
    per_shard = {"contiguous": 1, "zigzag": 2, "striped": num_shards, "per_document": 1}[layout]
    return _Geometry(mesh, axes, layout, num_shards,
                     _placement.padded_length(seq_len, num_shards * per_shard))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, options: Options, metadata: Metadata,
           where: Optional[Placement]):
    """The one path of every entry point: self-attention of global ``q [B, S, H, Dqk]``,
    ``k, v [B, S, Hkv, .]`` as its three descriptions say, each built and checked once by
    the entry point: what is computed (``options``), the per-token data (``metadata``;
    both from :func:`~jax_seqpar.strategies.inputs.describe`) and where (``where``, from
    :func:`jax_seqpar.api.attention.placement`; None: on the caller's devices, unsplit).
    A split call runs its one compiled program (``_program``) on the global arrays.

    Returns what :func:`jax_seqpar.sequence_parallel_attention` returns.
    """
    if where is None:
        return local_attention(q, k, v, options, operands(metadata))
    if not (q.shape[0] and q.shape[1]):  # no token: jax.nn's empty result, no program
        return empty_result(q, v, options.return_lse, options.return_max_logit)
    arrays = _placement.onto(where.mesh, q, k, v, *(
        None if x is None else jnp.asarray(x) for x in metadata.arrays()))
    mesh, axes = where.mesh, where.axes
    divides = q.shape[1] % math.prod(mesh.shape[a] for a in axes) == 0
    in_shardings = _placement.boundary_shardings(
        arrays, mesh, where.batch_entry, axis_name_of(axes) if divides else None,
        where.head_entry)
    # Called eagerly (concrete arrays, or under an eager jax.grad / jax.vjp), an Auto
    # mesh's program leaves its outputs' shardings to its last constraint (the caller's
    # mesh): declared, an eager backward would need the caller's cotangent committed there.
    eager = not any(isinstance(_placement.concrete(x), jax.core.Tracer) for x in arrays)
    declare_out = where.out_spec is not None or not eager
    return _program(options, where, q.shape[1], in_shardings, declare_out)(*arrays)


@functools.lru_cache(maxsize=None)
def _program(options: Options, placement: Placement, seq_len: int, in_shardings: tuple,
             declare_out: bool = True):
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
    geometry = _geometry(options, placement, seq_len)
    seq_spec = P(placement.batch_entry, axis_name_of(placement.axes), placement.head_entry,
                 None)
    spec = _placement.result_spec(seq_spec, placement.out_spec,
                                  padded=geometry.length != seq_len)
    out_shardings = tuple(NamedSharding(placement.mesh, P(*spec[:ndim]))
                          for ndim in ((4, 3) if options.return_lse else (4,)))
    if options.return_max_logit:  # [H]: over the batch and the sequence
        out_shardings += (NamedSharding(placement.mesh, P(spec[2])),)
    return jax.jit(functools.partial(_attend, options=options, placement=placement,
                                     geometry=geometry, in_shardings=in_shardings),
                   in_shardings=in_shardings,
                   out_shardings=None if not declare_out else
                   out_shardings if len(out_shardings) > 1 else out_shardings[0])


def _attend(*arrays, options: Options, placement: Placement, geometry: _Geometry,
            in_shardings: tuple):
    caller_mesh = placement.mesh
    q, k, v, *rest = _placement.bind(arrays, in_shardings, caller_mesh)
    metadata = Metadata(*rest)
    seq_len, length, num_shards = q.shape[1], geometry.length, geometry.num_shards
    mesh, axes, layout = geometry.mesh, geometry.axes, geometry.layout
    if length != seq_len:
        q, k, v, metadata = _placement.pad_inputs(length, q, k, v, metadata)
    inverse = None
    if layout == "per_document":  # a data-dependent order: gathered here, before shard_map
        q, k, v, metadata, inverse = _per_document(options, placement, num_shards, q, k, v,
                                                   metadata)
        layout = "contiguous"
    entry = registry.get(placement.strategy)  # placement checked its axes and its core
    axis_name = axis_name_of(axes)
    if entry.attend is None:  # api.attention.placement refuses it first
        raise ValueError(f"strategy={placement.strategy!r} has no attend core.")
    attend = functools.partial(entry.attend, seq_axes=axis_name, **placement.pipelining())
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
        result = attend(q, k, v, options, metadata)  # [B, L, H, Dv] (and lse [B, L, H])
        return jax.tree.map(lambda x: relayout_out(x, axis_name=axis_name), result)

    batch_entry, head_entry = placement.batch_entry, placement.head_entry
    qkv_spec = P(batch_entry, axis_name, head_entry, None)
    ids_spec = P(batch_entry, axis_name)
    id_fields = ("segment_ids", "kv_segment_ids", "positions", "bidirectional_ids")
    specs = Metadata(**{name: P() if getattr(metadata, name) is None else ids_spec
                        for name in id_fields}, sinks=P(head_entry))
    rows_spec = P(batch_entry, axis_name, head_entry)  # the lse, the row max logits
    out_specs: P | tuple[P, ...] = qkv_spec
    if options.return_lse or options.return_max_logit:
        out_specs = (qkv_spec,) + (rows_spec,) * (options.return_lse + options.return_max_logit)
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(qkv_spec,) * 3 + (specs,), out_specs=out_specs,
        check_vma=can_check_vma(options.kernel))
    with _placement.on_mesh(mesh, caller_mesh):  # a split mesh is the context of its shard_map
        q, k, v = (_placement.place(x, mesh, qkv_spec) for x in (q, k, v))
        metadata = Metadata(*(None if x is None else _placement.place(x, mesh, spec)
                              for x, spec in zip(metadata.arrays(), specs.arrays())))
        result = mapped(q, k, v, metadata)
    if inverse is not None:  # back to natural order
        result = jax.tree.map(lambda x: _gather_seq(x, inverse, placement), result)
    # Back on the caller's mesh (a split mesh has the same devices: no data moves there)
    # at the caller's length, sharded like q.
    seq_spec = P(batch_entry, axis_name_of(placement.axes), head_entry, None)
    out_spec = placement.out_spec
    result = jax.tree.map(
        lambda x: _placement.finish(x, caller_mesh, seq_len, P(*seq_spec[:x.ndim]),
                                    None if out_spec is None else P(*out_spec[:x.ndim])),
        result)
    if not options.return_max_logit:
        return result
    # The row max logits [B, S, H] (padding cut) -> [H]: the largest over every row.
    high = jnp.max(jax.lax.stop_gradient(result[-1]), axis=(0, 1), initial=-jnp.inf)
    return (*result[:-1], high)


def _gather_seq(x, order, placement: Placement):
    """``x [B, S, ...]`` reordered along the sequence by ``order int32[B, S]``, on the
    caller's mesh with the sequence whole (an Explicit type cannot gather a sharded dim)."""
    spec = P(placement.batch_entry, None, placement.head_entry, None)[:x.ndim]
    x = _placement.place(x, placement.mesh, P(*spec))
    index = order.reshape(order.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def _per_document(options: Options, placement: Placement, num_shards: int, q, k, v,
                  metadata: Metadata):
    """``(q, k, v, metadata, inverse)``: the call's arrays in the per-document order of
    its segment ids, with the ``positions`` of that order, and the order's inverse
    (:mod:`jax_seqpar.core.packing`, traced)."""
    if metadata.segment_ids is None:  # sequence_parallel_attention refuses this first
        raise ValueError('layout="per_document" orders the tokens by their documents: pass '
                         "segment_ids= (int32[B, S]).")
    ids = _placement.place(metadata.segment_ids, placement.mesh, P(placement.batch_entry, None))
    block = getattr(options.block_sizes, "block_q", None) or packing.DEFAULT_BLOCK
    positions = packing.per_document_positions(ids, num_shards, block)  # [B, S]

    def moved(x):
        return None if x is None else _gather_seq(x, positions, placement)

    metadata = dataclasses.replace(metadata, positions=positions, **{
        name: moved(getattr(metadata, name))
        for name in ("segment_ids", "kv_segment_ids", "bidirectional_ids")})
    q, k, v = (moved(x) for x in (q, k, v))
    return q, k, v, metadata, jnp.argsort(positions, axis=1).astype(jnp.int32)
