"""The contexts a user calls the global entry points in, as one test helper.

Every global-API test runs its function under each context (the ``context`` fixture of
``conftest.py``), so the README's usage (an Explicit mesh from ``jax.make_mesh`` inside
``jax.set_mesh``, inputs made without a sharding) is tested beside Auto meshes, ``jit``
with replicated inputs and ``jit`` with sequence-sharded inputs and ``out_shardings``.

A test builds its function from a mesh, because the mesh's axis types depend on the
context: ``context.check(build, args, expected, ...)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import pytest

import checks

#: Each context: (mesh axis type, under jax.set_mesh, under jit, inputs placed).
CONTEXTS = {
    "explicit-set-mesh": (AxisType.Explicit, True, False, None),
    "explicit": (AxisType.Explicit, False, False, None),
    "auto": (AxisType.Auto, False, False, None),
    "jit-replicated": (AxisType.Explicit, True, True, "replicated"),
    "jit-sharded": (AxisType.Explicit, True, True, "sequence"),
}


NAMES = sorted(CONTEXTS)

#: Contexts outside the tiered five, which the exactness driver (tests/exactness.py) also
#: calls from: ``jit`` of inputs made without a sharding, on an Auto mesh (with and
#: without ``jax.set_mesh``) and on an Explicit one under ``jax.set_mesh``.
JIT_CONTEXTS = {
    "auto-jit": (AxisType.Auto, False, True, None),
    "auto-set-mesh-jit": (AxisType.Auto, True, True, None),
    "explicit-set-mesh-jit": (AxisType.Explicit, True, True, None),
}

_ALL = {**CONTEXTS, **JIT_CONTEXTS}


def tiered(default: int) -> list:
    """Every context as a test parameter; all but ``NAMES[default % 5]`` are in the
    ``matrix`` tier (CI), so the default tier runs each test in one context, and tests
    that pass different ``default`` s cover every context between them."""
    keep = NAMES[default % len(NAMES)]
    return [pytest.param(name, id=name, marks=() if name == keep else pytest.mark.matrix)
            for name in NAMES]


def make_mesh(shape: tuple, names: tuple, axis_type=AxisType.Explicit) -> Mesh:
    """A mesh over the first ``prod(shape)`` devices, every axis of ``axis_type``."""
    devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(axis_type,) * len(names))


def assert_on_mesh(tree, mesh: Mesh, what: str = "") -> None:
    """Every array in ``tree`` lives on ``mesh`` (or on one device, as the caller made it)
    and its type names no other mesh: nothing of a mesh a call builds inside (a split
    axis) escapes it."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    assert leaves, what
    for path, x in leaves:
        where = f"{what}{jax.tree_util.keystr(path)}"
        if isinstance(x.sharding, NamedSharding):
            assert x.sharding.mesh == mesh, (where, x.sharding)
        typed = jax.typeof(x).sharding.mesh
        assert typed.empty or typed == mesh.abstract_mesh, (where, jax.typeof(x))


@dataclasses.dataclass(frozen=True)
class Context:
    """One way of calling: ``run(build, args, seq_axes)`` returns what ``build(mesh)(*args)``
    returns there, and its gradients.

    Attributes:
      name: a key of :data:`CONTEXTS` or :data:`JIT_CONTEXTS`.
    """

    name: str

    @property
    def axis_type(self):
        return _ALL[self.name][0]

    def mesh(self, shape=(8,), names=("sp",)) -> Mesh:
        """The mesh this context calls with."""
        return make_mesh(shape, names, self.axis_type)

    def _place(self, mesh, x, seq_axes):
        placed = _ALL[self.name][3]
        if placed is None or x is None:
            return x
        entry = seq_axes if isinstance(seq_axes, str) else tuple(seq_axes)
        devices = int(np.prod([mesh.shape[a] for a in (entry if isinstance(entry, tuple)
                                                       else (entry,))]))
        shard = placed == "sequence" and x.ndim >= 2 and x.shape[1] % devices == 0
        spec = P(None, entry) if shard else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    def run(self, build: Callable, args: tuple, *, mesh: Mesh, seq_axes="sp",
            cotangent=None, argnums=(0, 1, 2)):
        """``(out, grads)``: ``build(mesh)(*args)`` and the vjp of ``cotangent`` (or None:
        no gradients) with respect to ``args[i]`` for ``i`` in ``argnums``, computed in
        one program under ``jit`` contexts."""
        _, under_mesh, under_jit, placed = _ALL[self.name]
        out_and_grads = checks.with_vjp(build(mesh), argnums)
        args = tuple(self._place(mesh, x, seq_axes) for x in args)
        cotangent = jax.tree.map(lambda x: self._place(mesh, x, seq_axes), cotangent)

        with jax.set_mesh(mesh) if under_mesh else contextlib.nullcontext():
            if under_jit:
                out_shardings = None
                if placed == "sequence":  # the caller states where out goes
                    out_sharding = jax.typeof(args[0]).sharding
                    out_shardings = (out_sharding if cotangent is None else
                                     jax.tree.map(lambda _: out_sharding, cotangent),
                                     tuple(jax.typeof(args[i]).sharding for i in argnums)
                                     if cotangent is not None else None)
                return jax.jit(out_and_grads, out_shardings=out_shardings)(args, cotangent)
            return out_and_grads(args, cotangent)

    def check(self, build: Callable, args: tuple, reference: Callable, tolerances, *,
              mesh: Mesh, seq_axes="sp", argnums=(0, 1, 2), grads: bool = True):
        """Assert ``build(mesh)(*args)`` and its gradients equal ``reference(*args)``'s
        (computed in float32 from the same inputs) within ``tolerances`` of the inputs'
        dtype; the output keeps the shape and dtype of the reference's and, on Explicit
        meshes, the sharding of ``args[0]``; the output, and under ``jit`` the gradients,
        are on ``mesh`` (:func:`assert_on_mesh`; an eager ``vjp`` of a split hybrid on an
        Explicit mesh still names its gradients after the split mesh). A reference that
        returns ``(out, lse)`` gets a float32 cotangent for the lse, compared too.
        Returns ``(out, grads)``."""
        upcast = checks.upcast(args)
        shapes = jax.eval_shape(reference, *upcast)
        cotangent = None
        if grads and isinstance(shapes, tuple):
            cotangent = (checks.normal(shapes[0].shape, args[0].dtype, seed=7),
                         checks.normal(shapes[1].shape, jnp.float32, seed=8))
        elif grads:
            cotangent = checks.normal(shapes.shape, args[0].dtype, seed=7)
        out, got = self.run(build, args, mesh=mesh, seq_axes=seq_axes, cotangent=cotangent,
                            argnums=argnums)
        assert_on_mesh((out, got) if _ALL[self.name][2] else out, mesh)
        if self.axis_type == AxisType.Explicit:
            q_spec = jax.typeof(self._place(mesh, args[0], seq_axes)).sharding.spec
            first = out[0] if isinstance(out, tuple) else out
            assert tuple(jax.typeof(first).sharding.spec)[:3] == tuple(q_spec)[:3], (
                jax.typeof(first), q_spec)
        if grads:
            expected, want = checks.out_and_vjp(
                reference, upcast, jax.tree.map(lambda x: x.astype(jnp.float32), cotangent),
                argnums)
        else:
            expected, want, got = jax.jit(reference)(*upcast), (), ()
        checks.assert_close(out, got, expected, want, tolerances, args=args, argnums=argnums)
        return out, got
