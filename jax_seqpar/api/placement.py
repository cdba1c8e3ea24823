"""How the global entry point places arrays on a mesh: kept shardings and padding.

Two decisions the global view makes before ``shard_map``:

* which batch and head shardings (data and tensor parallelism) stay in place,
  read from the arrays' types on Explicit meshes, from concrete arrays'
  shardings or ``batch_axes=`` on Auto meshes;
* how far the sequence is padded so that every shard holds whole layout pieces,
  with the padding masked out by a reserved segment id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_seqpar.core import packing
from jax_seqpar.core.masks import PAD_SEGMENT
from jax_seqpar.core.reach import documents_bound_reach
from jax_seqpar.strategies.inputs import spread_message
from jax_seqpar.kernels.tiling import pad_seq

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.strategies.inputs import Metadata

__all__ = ["bind", "boundary_shardings", "caller_spec", "concrete", "entry_size", "finish",
           "kept_entries", "on_mesh", "onto", "pad_inputs", "padded_length", "place",
           "result_spec"]


def is_explicit(mesh) -> bool:
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def place(x: jax.Array, mesh: jax.sharding.Mesh, spec: P):
    """Put ``x`` in ``spec`` sharding: explicit meshes need it before ``shard_map``."""
    if is_explicit(mesh):
        return jax.reshard(x, NamedSharding(mesh, spec))
    return x


def entry_size(mesh: jax.sharding.Mesh, entry: str | tuple[str, ...] | None) -> int:
    """Number of devices a PartitionSpec entry (None, a name or a tuple) spans."""
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[name] for name in names)


def concrete(x: jax.Array | None) -> jax.Array | None:
    """``x``, or the concrete array under an eager transformation's tracer (``jax.grad``,
    ``jax.vjp``, ``nnx.value_and_grad`` outside ``jit``), which is what the call's program
    receives: its sharding is known and, committed, ``jit`` will not reshard it."""
    if isinstance(x, jax.core.Tracer):
        value = x.to_concrete_value()
        return x if value is None else value
    return x


def check_documents_home(bound: Optional[int], mesh: jax.sharding.Mesh, seq_axes: tuple,
                         *segment_ids: jax.Array | None) -> None:
    """An eager call's ``max_document_shards=bound`` checked on the host before the
    program runs: a ``ValueError`` naming the widest span, raised in the call. (Traced
    ids, ids spread over processes, or a length the shards do not divide are checked
    inside the program: :func:`jax_seqpar.strategies.inputs.documents_within`.)"""
    shards = math.prod(mesh.shape[name] for name in seq_axes)
    for ids in segment_ids:
        ids = concrete(ids)
        if (not documents_bound_reach(bound, shards) or ids is None
                or isinstance(ids, jax.core.Tracer)
                or not getattr(ids, "is_fully_addressable", True)
                or (getattr(ids, "ndim", 0) == 2 and ids.shape[1] % shards)):
            continue
        span, document = packing.widest_documents(np.asarray(ids), shards)  # [B]
        row = int(np.argmax(span))
        if span[row] > bound:
            raise ValueError(spread_message(bound, shards)(row, document[row], span[row]))


def _known_spec(x):
    """The PartitionSpec ``x`` is known to have: its type's (Explicit meshes) or, for a
    concrete array (or an eager tracer's, :func:`concrete`), its NamedSharding's; None
    when unknown (a traced array on an Auto mesh)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is not None and any(e is not None for e in spec):
        return spec
    x = concrete(x)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.spec
    return spec


def _entry(spec, dim: int, seq_axes: tuple):
    """The mesh axes ``spec`` shards ``dim`` over, unless they include a sequence axis."""
    entry = spec[dim] if spec is not None and dim < len(spec) else None
    names = entry if isinstance(entry, tuple) else (entry,)
    return None if entry is None or set(names) & set(seq_axes) else entry


def kept_entries(q: jax.Array, k: jax.Array, v: jax.Array, mesh: jax.sharding.Mesh, seq_axes: tuple,
                 batch_axes: str | tuple[str, ...] | None = None):
    """``(batch_entry, head_entry)``: the batch and head shardings to keep in ``shard_map``.

    The batch sharding comes from ``batch_axes`` when given, else from ``q``'s known
    sharding, else (a traced array on an Auto mesh, whose sharding is unknown) from
    the mesh axes outside the sequence, taken in order while their product divides
    the batch: data parallelism is kept rather than replicating the compute. The head
    sharding is kept only when q, k and v share it: a head split of q alone would
    pair local query heads with the wrong K/V heads, so q is resharded instead.

    Raises:
      ValueError: ``batch_axes`` naming an unknown or sequence axis, or not dividing
        the batch.
    """
    specs = [_known_spec(x) for x in (q, k, v)]
    head = _entry(specs[0], 2, seq_axes)
    if any(_entry(spec, 2, seq_axes) != head for spec in specs[1:]):
        head = None
    batch_size = q.shape[0]
    if batch_axes is not None:
        names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        for name in names:
            if name not in mesh.shape or name in seq_axes:
                raise ValueError(f"batch_axes names {name!r}, which is not a mesh axis outside "
                                 f"the sequence axes {seq_axes} of the mesh {dict(mesh.shape)}.")
        batch = names[0] if len(names) == 1 else (names or None)
        if batch_size % entry_size(mesh, batch):
            raise ValueError(f"batch {batch_size} is not divisible by the {entry_size(mesh, batch)} "
                             f"devices of batch_axes={batch_axes!r}; pick axes whose sizes "
                             "divide the batch.")
    elif specs[0] is not None and any(e is not None for e in specs[0]) or is_explicit(mesh):
        batch = _entry(specs[0], 0, seq_axes)
    else:
        dividing: list[str] = []
        size = 1
        for name in mesh.axis_names:
            if name in seq_axes or (head is not None and name in _names(head)):
                continue
            if batch_size % (size * mesh.shape[name]) == 0:
                dividing.append(name)
                size *= mesh.shape[name]
        batch = (None if not dividing else dividing[0] if len(dividing) == 1
                 else tuple(dividing))
    return batch, head


def _names(entry) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)


def padded_length(seq_len: int, pieces: int) -> int:
    """The smallest multiple of ``pieces`` that holds ``seq_len`` tokens."""
    return -(-seq_len // pieces) * pieces


def pad_inputs(length: int, q: jax.Array, k: jax.Array, v: jax.Array, metadata: Metadata):
    """Pad q, k, v and the token ids of ``metadata`` (a
    :class:`~jax_seqpar.strategies.inputs.Metadata`) along the sequence to ``length``.

    The padding gets segment :data:`~jax_seqpar.core.masks.PAD_SEGMENT` (in ``segment_ids``, made when absent,
    and ``kv_segment_ids``), so no real token sees it (padded queries see only padding;
    their rows are sliced off), positions after the last real one, so causal tile
    skipping is unaffected, and bidirectional id 0 (none).

    Returns:
      ``(q, k, v, metadata)`` at ``length`` (``int32[B, length]`` ids).
    """
    batch, seq_len = q.shape[:2]
    q, k, v = (pad_seq(x, length) for x in (q, k, v))  # [B, length, heads, D]
    segment_ids = metadata.segment_ids
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, seq_len), jnp.int32)

    def padded(x, value):
        return None if x is None else pad_seq(x.astype(jnp.int32), length, value)

    positions = metadata.positions
    if positions is not None:
        after = jnp.max(positions) + 1 + jnp.arange(length - seq_len, dtype=jnp.int32)
        positions = jnp.concatenate(
            [positions.astype(jnp.int32), jnp.broadcast_to(after, (batch, after.shape[0]))], 1)
    return q, k, v, dataclasses.replace(
        metadata, segment_ids=padded(segment_ids, PAD_SEGMENT), positions=positions,
        kv_segment_ids=padded(metadata.kv_segment_ids, PAD_SEGMENT),
        bidirectional_ids=padded(metadata.bidirectional_ids, 0))


def unpad(x, seq_len: int, axis: int = 1):
    """The first ``seq_len`` tokens of ``x`` (a slice, valid on sharded arrays)."""
    return x if x.shape[axis] == seq_len else jax.lax.slice_in_dim(x, 0, seq_len, axis=axis)


def onto(mesh: jax.sharding.Mesh, *arrays: jax.Array | None):
    """``arrays`` (None kept), with each concrete array that lives on devices outside
    ``mesh`` copied onto it, replicated: one program cannot take inputs from another
    device set (a shape-only or traced array is left to its caller)."""
    devices = set(mesh.devices.flat)

    def moved(x):
        if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                and x.sharding.device_set != devices):
            return jax.device_put(x, NamedSharding(mesh, P()))
        return x

    return tuple(None if x is None else moved(x) for x in arrays)


def boundary_shardings(arrays: tuple, mesh: jax.sharding.Mesh,
                       batch_entry: str | tuple[str, ...] | None,
                       seq_entry: str | tuple[str, ...] | None,
                       head_entry: str | tuple[str, ...] | None) -> tuple:
    """The shardings on ``mesh`` a call's program declares for its inputs ``(q, k, v,
    segment_ids, kv_segment_ids, positions, bidirectional_ids, sinks)`` (None: undeclared): on Explicit
    meshes their types' (of a traced array, only a type that shards the sequence); a
    committed array's own; else (a traced array on an Auto mesh, an array on no mesh)
    where the program places it, ``P(batch_entry, seq_entry, ...)``
    (``seq_entry`` None where the devices do not divide the length: a program's
    boundary cannot split it).

    Declared, they name the program's gradients (a backward's outputs are its
    forward's inputs), which would otherwise be named after the first mesh JAX meets
    among the backward's inputs: residuals, on a mesh the call built inside.
    """
    wanted = ((P(batch_entry, seq_entry, head_entry, None),) * 3
              + (P(batch_entry, seq_entry),) * 4 + (P(head_entry),))
    return tuple(None if x is None else _boundary_sharding(x, mesh, spec)
                 for x, spec in zip(arrays, wanted))


def _boundary_sharding(x, mesh, wanted: P):
    x = concrete(x)  # an eager tracer: declared as the array jit receives (it is committed)
    is_concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    if is_explicit(mesh):
        spec = P(*(getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()))
        # A traced input typed whole along the sequence is left undeclared where the
        # devices divide the length: declared, its gradient would be gathered whole where
        # the caller's program can sum it sharded. Where they do not, it is declared: XLA
        # would otherwise leave on the gradient the sharding of the padded sequence (a
        # split mesh's outer axis), which the caller's mesh cannot name.
        if is_concrete or (len(spec) > 1 and spec[1] is not None) or (
                len(wanted) > 1 and wanted[1] is None):
            return NamedSharding(mesh, spec)
        return None
    if is_concrete and x.committed:
        return x.sharding
    return NamedSharding(mesh, wanted)


def bind(arrays: tuple, shardings: tuple, mesh: jax.sharding.Mesh) -> tuple:
    """``arrays`` (None kept) constrained to ``shardings`` on an Auto ``mesh``, so their
    gradients (the constraints' transposes) are typed on it too, not on a mesh the call
    built inside; on Explicit meshes their types already say so."""
    if is_explicit(mesh):
        return arrays
    return tuple(x if x is None or sharding is None
                 else jax.lax.with_sharding_constraint(x, sharding)
                 for x, sharding in zip(arrays, shardings))


def caller_spec(q: jax.Array, mesh: jax.sharding.Mesh) -> Optional[P]:
    """The sharding the caller's ``q [B, S, H, D]`` has on an Explicit ``mesh`` (its type's
    batch, sequence and head entries; None for the head dim), which the output keeps;
    None on Auto meshes, where XLA propagates shardings."""
    if not is_explicit(mesh):
        return None
    spec = tuple(getattr(getattr(jax.typeof(q), "sharding", None), "spec", None) or ())
    spec = (spec + (None,) * 4)[:3]
    return P(*spec, None)


def on_mesh(mesh: jax.sharding.Mesh, user_mesh: jax.sharding.Mesh):
    """The context for placing arrays on, and ``shard_map`` over, ``mesh``: the caller's
    context as it is, or, for a mesh split from the caller's (same devices, other axes),
    that mesh as the abstract context, which ``shard_map`` and explicit shardings need."""
    if mesh is user_mesh:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def finish(x: jax.Array, mesh: jax.sharding.Mesh, seq_len: int, seq_spec: P, out_spec: Optional[P]):
    """A result ``[B, L, ...]`` of ``shard_map`` back on the caller's ``mesh`` at the
    caller's length ``seq_len <= L``.

    Explicit meshes (``out_spec`` given): sharded ``out_spec``, like the caller's
    queries; a padded result is first gathered along the sequence (an Explicit type
    cannot slice a sharded dimension to a length its devices do not divide). Auto
    meshes (``out_spec`` None): constrained to ``seq_spec`` on ``mesh`` (the result
    may come from a mesh split from it) and sliced, the slice whole along the sequence
    (left to the partitioner, it may get a sharding no mesh spec can name).
    """
    whole = NamedSharding(mesh, _whole_along_sequence(seq_spec if out_spec is None
                                                      else out_spec))
    if out_spec is None:
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, seq_spec))
        if x.shape[1] == seq_len:
            return x
        return jax.lax.with_sharding_constraint(unpad(x, seq_len), whole)
    if x.shape[1] != seq_len:
        x = unpad(jax.reshard(x, whole), seq_len)
    return jax.reshard(x, NamedSharding(mesh, out_spec))


def result_spec(seq_spec: P, out_spec: Optional[P], padded: bool) -> P:
    """The sharding :func:`finish` gives a result ``[B, S, H, D]`` on the caller's mesh:
    ``out_spec`` (Explicit meshes), else ``seq_spec``, whole along the sequence where
    the result was padded."""
    if out_spec is not None:
        return out_spec
    return _whole_along_sequence(seq_spec) if padded else seq_spec


def _whole_along_sequence(spec: P) -> P:
    """``spec`` of a ``[B, S, ...]`` array with the sequence dimension unsharded."""
    return P(*tuple(spec)[:1], None, *tuple(spec)[2:])
