"""The global-view entry point: one call shards the sequence over a mesh and attends.

``sequence_parallel_attention`` takes global ``[B, S, H, D]`` arrays, places them
sequence-sharded on the mesh, relayouts the tokens inside the shards (zigzag for
balanced causal rings: two half-shard ``ppermute`` s; striped: one ``all_to_all``),
runs the chosen strategy inside
``jax.shard_map`` and returns the output in the caller's token order, sharded
like its queries. Explicit-axis meshes (the ``jax.make_mesh`` default) and Auto
meshes both work; batch and head shardings of explicit inputs (data and tensor
parallelism) are kept.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_seqpar import kernels, layout as layouts
from jax_seqpar._inputs import check_self_attention
from jax_seqpar.ring import ring_attention
from jax_seqpar.ulysses import ulysses_attention

STRATEGIES = ("auto", "ulysses", "ring", "hybrid", "allgather")
LAYOUTS = ("auto", "contiguous", "zigzag", "striped")
_ZIGZAG_BALANCES = ("ring", "hybrid", "allgather")


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


def default_layout(strategy: str, causal: bool) -> str:
    """``layout="auto"``: zigzag where it balances causal work, contiguous otherwise."""
    return "zigzag" if causal and strategy in _ZIGZAG_BALANCES else "contiguous"


def can_check_vma(kernel: str) -> bool:
    """Whether ``shard_map`` may check varying axes around ``kernel``.

    The Pallas interpreter (``kernel="pallas"`` lowered for anything but CUDA) loses
    the varying-axes types inside ``shard_map``; JAX's own error asks for
    ``check_vma=False`` there. The lowering platform is not known when ``shard_map``
    traces, so a program that may interpret never checks.
    """
    return not kernels.may_interpret(kernel)


def per_shard_fn(strategy: str, axes: tuple):
    """The per-shard attention function for ``strategy`` over the sequence ``axes``."""
    axis_name = axis_name_of(axes)
    if strategy == "ulysses":
        return functools.partial(ulysses_attention, axis_name=axis_name)
    if strategy == "ring":
        return functools.partial(ring_attention, axis_name=axis_name)
    if strategy == "allgather":
        from jax_seqpar.allgather import allgather_attention

        return functools.partial(allgather_attention, axis_name=axis_name)
    from jax_seqpar.hybrid import hybrid_attention

    if len(axes) != 2:
        raise ValueError(f'strategy="hybrid" needs seq_axes=(outer, inner). Got {axes}.')
    return functools.partial(hybrid_attention, ring_axis=axes[0], ulysses_axis=axes[1])


def _choose_strategy(q, k, v, axis_sizes: dict, causal: bool) -> str:
    from jax_seqpar import plan

    batch, seq_len, heads, head_dim = q.shape
    return plan.plan(seq_len, heads, k.shape[2], head_dim, axis_sizes, batch=batch,
                     v_head_dim=v.shape[3], dtype_bytes=q.dtype.itemsize,
                     causal=causal).strategy


def _spec_entry(x, dim: int, seq_axes: tuple):
    """The mesh axes an explicit input is sharded along in ``dim`` (None: replicated)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    entry = spec[dim] if spec is not None and dim < len(spec) else None
    names = entry if isinstance(entry, tuple) else (entry,)
    return None if entry is None or set(names) & set(seq_axes) else entry


def _kept_entries(q, k, v, seq_axes: tuple):
    """Batch and head shardings (data / tensor parallelism) to keep inside shard_map.

    The batch sharding of ``q`` is kept (k and v are resharded to it). The head
    sharding is kept only when q, k and v share it: a head split of q alone would
    pair local query heads with the wrong K/V heads, so q is resharded instead.
    """
    head = _spec_entry(q, 2, seq_axes)
    if any(_spec_entry(x, 2, seq_axes) != head for x in (k, v)):
        head = None
    return _spec_entry(q, 0, seq_axes), head


def _place(x, mesh, spec):
    """Put ``x`` in ``spec`` sharding: explicit meshes need it before ``shard_map``."""
    if any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return jax.reshard(x, NamedSharding(mesh, spec))
    return x


def sequence_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    seq_axes: Union[str, tuple] = "sp",
    strategy: str = "auto",
    causal: bool = False,
    segment_ids: Optional[jax.Array] = None,
    window=None,
    scale: Optional[float] = None,
    layout: str = "auto",
    kernel: str = "auto",
    block_sizes=None,
) -> jax.Array:
    """Exact attention with the sequence split over ``seq_axes`` of ``mesh``.

    Args:
      q: ``[B, S, H, Dqk]`` global queries.
      k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` (``H % Hkv == 0``).
      mesh: the device mesh (Explicit or Auto axis types).
      seq_axes: the mesh axis splitting the sequence, or ``(outer, inner)``:
        ``"hybrid"`` runs Ulysses over ``inner`` and the ring over ``outer``.
      strategy: ``"ulysses"``, ``"ring"``, ``"hybrid"``, ``"allgather"`` or
        ``"auto"`` (:func:`jax_seqpar.plan.plan` decides).
      causal, window: the mask on true token positions (see ``MaskSpec``).
      segment_ids: ``int32[B, S]`` packed documents attend within themselves.
      scale: defaults to ``1/sqrt(Dqk)``.
      layout: ``"zigzag"``, ``"striped"``, ``"contiguous"`` or ``"auto"`` (zigzag
        where it balances causal work: ring, hybrid and all-gather with ``causal=True``).
      kernel: ``"auto"`` (Pallas on GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``.
      block_sizes: the kernel's tile sizes (its ``BlockSizes``), or None.

    Returns:
      ``[B, S, H, Dv]`` in ``q.dtype``, in the caller's token order.

    Raises:
      ValueError: bad shapes, unknown axes/strategy/layout, a sequence length the
        shards do not divide (pad it and mask the padding with ``segment_ids``),
        or heads a Ulysses axis does not divide.

    >>> mesh = jax.make_mesh((8,), ("sp",))
    >>> out = sequence_parallel_attention(q, k, v, mesh=mesh, strategy="ring", causal=True)
    """
    check_self_attention(q, k, v, segment_ids)
    batch, seq_len = q.shape[:2]
    axes = (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes)
    for name in axes:
        if name not in mesh.shape:
            raise ValueError(f"seq_axes names {name!r}, which is not an axis of the mesh "
                             f"{dict(mesh.shape)}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}.")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}.")
    axis_sizes = {name: mesh.shape[name] for name in axes}
    if strategy == "auto":
        strategy = _choose_strategy(q, k, v, axis_sizes, causal)
    if layout == "auto":
        layout = default_layout(strategy, causal)
    num_shards = 1
    for size in axis_sizes.values():
        num_shards *= size
    per_shard = {"contiguous": 1, "zigzag": 2, "striped": num_shards}[layout]
    chunks = num_shards * per_shard
    if seq_len % chunks:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {chunks} ({num_shards} shards"
            f"{f' x {per_shard} {layout} pieces' if per_shard > 1 else ''}); pad it to a "
            f"multiple of {chunks} and mask the padding with segment_ids.")
    attend = per_shard_fn(strategy, axes)
    axis_name = axis_name_of(axes)

    relayout_in, relayout_out = _RELAYOUTS[layout]

    def body(q, k, v, segment_ids):
        q, k, v, segment_ids = (None if x is None else relayout_in(x, axis_name=axis_name)
                                for x in (q, k, v, segment_ids))
        positions = layouts.shard_positions(layout, q.shape[1], axis_name=axis_name)
        positions = jax.numpy.broadcast_to(positions, q.shape[:2])
        out = attend(q, k, v, causal=causal, window=window, segment_ids=segment_ids,
                     positions=positions, scale=scale, kernel=kernel, block_sizes=block_sizes)
        return relayout_out(out, axis_name=axis_name)

    batch_entry, head_entry = _kept_entries(q, k, v, axes)
    qkv_spec = P(batch_entry, axis_name, head_entry, None)
    ids_spec = P(batch_entry, axis_name)
    q, k, v = (_place(x, mesh, qkv_spec) for x in (q, k, v))
    if segment_ids is not None:
        segment_ids = _place(segment_ids, mesh, ids_spec)
    mapped = jax.shard_map(body, mesh=mesh,
                           in_specs=(qkv_spec,) * 3 + (P() if segment_ids is None else ids_spec,),
                           out_specs=qkv_spec, check_vma=can_check_vma(kernel))
    return mapped(q, k, v, segment_ids)
