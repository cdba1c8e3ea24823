"""Splitting the sequence devices of a mesh into ring x Ulysses groups, moving no data.

A sequence sharded over the axes ``(a, b)`` of a mesh lives on its devices in
row-major order: shard ``i`` on the ``i``-th device of the flattened ``(a, b)``
block. Reshaping that block in place to ``(P / I, I)`` keeps every shard on its
device and every device at its place in the mesh's device order, so the same
arrays, resharded onto the new mesh, move no bytes (the compiled program has no
collective for it), and one program can use both meshes: JAX gives a program one
device order. The new inner axis groups ``I``
neighbouring devices (the fast links of a node) for Ulysses; the outer axis
runs the ring across the groups (USP, arXiv:2405.07719).
"""

from __future__ import annotations

import math

from jax.sharding import Mesh

__all__ = ["split_axis"]


def split_axis(mesh: Mesh, axes: tuple[str, ...],
               ulysses_size: int) -> tuple[Mesh, tuple[str, str]]:
    """A mesh whose sequence devices form ``(ring, ulysses)`` axes of ``P/I x I``.

    Args:
      mesh: the mesh the sequence is sharded on.
      axes: the sequence axis name, or the tuple of names it is sharded over
        (outer first), neighbouring axes of ``mesh`` in its order; the other axes
        (batch, heads) are kept where they are.
      ulysses_size: ``I``, devices per Ulysses group; must divide ``P``.

    Returns:
      ``(mesh2d, (ring_axis, ulysses_axis))``. When ``axes`` are two axes whose
      inner one already has ``I`` devices, ``mesh`` and ``axes`` themselves. New
      axis names join the old ones with ``"_"`` and end in ``_ring`` and
      ``_ulysses`` (``"sp"`` -> ``("sp_ring", "sp_ulysses")``); the axis types
      are the sequence axes'.

    >>> import jax
    >>> mesh2d, (ring, ulysses) = split_axis(jax.make_mesh((8,), ("sp",)), "sp", 4)
    >>> dict(mesh2d.shape)
    {'sp_ring': 2, 'sp_ulysses': 4}
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    names = tuple(mesh.axis_names)
    for name in axes:
        if name not in names:
            raise ValueError(f"seq axis {name!r} is not an axis of the mesh {dict(mesh.shape)}.")
    devices = math.prod(mesh.shape[name] for name in axes)
    if (isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int)
            or ulysses_size < 1 or devices % ulysses_size):
        raise ValueError(
            f"ulysses_size={ulysses_size!r} must be a positive divisor of the {devices} "
            f"sequence devices of axes {axes}; choose one of "
            f"{[d for d in range(1, devices + 1) if devices % d == 0]}.")
    if len(axes) == 2 and mesh.shape[axes[1]] == ulysses_size:
        return mesh, axes
    first = names.index(axes[0])
    if names[first:first + len(axes)] != axes:
        raise ValueError(
            f"seq_axes={axes} must be neighbouring axes of the mesh {dict(mesh.shape)}, in "
            f"its order, to be split into ring x Ulysses groups on the same devices: reorder "
            f"the mesh axes, or pass seq_axes=(outer, inner) whose inner axis has "
            f"ulysses_size={ulysses_size} devices.")
    stem = "_".join(axes)
    new_axes = (f"{stem}_ring", f"{stem}_ulysses")
    others = tuple(n for n in names if n not in axes)
    clash = set(new_axes) & set(others)
    if clash:
        raise ValueError(f"the mesh already has axes named {sorted(clash)}; rename them.")
    # The sequence axes replaced in place: a reshape, so the new mesh lists the same
    # devices in the same order (one device assignment for both meshes in one program).
    shape = mesh.devices.shape
    devices = mesh.devices.reshape(shape[:first] + (devices // ulysses_size, ulysses_size)
                                   + shape[first + len(axes):])
    new_names = names[:first] + new_axes + names[first + len(axes):]
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return Mesh(devices, new_names), new_axes
    seq_type = types[first]
    new_types = types[:first] + (seq_type, seq_type) + types[first + len(axes):]
    return Mesh(devices, new_names, axis_types=new_types), new_axes
