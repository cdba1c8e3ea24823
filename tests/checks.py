"""Inputs made on the host, the one comparison of a function against the reference, and
the test tiers' split of a parameter matrix (:func:`tiered`).

Inputs are drawn with numpy, not ``jax.random``: an eager JAX op compiles a program for
every new shape and dtype (about 0.2 s each on CPU), and the suite makes inputs of
hundreds of shapes. A function under test runs as one jitted program that returns its
output and its vector-Jacobian product (never a second program for the gradients), and
so does the reference, in float32.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def normals(shapes: Sequence[Sequence[int]], dtype=jnp.float32, seed: int = 0) -> list:
    """Standard-normal ``dtype`` arrays of ``shapes``, drawn on the host in turn."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(tuple(shape), np.float32).astype(jnp.dtype(dtype)))
            for shape in shapes]


def normal(shape: Sequence[int], dtype=jnp.float32, seed: int = 0) -> jax.Array:
    """Standard-normal ``dtype[shape]``, drawn on the host."""
    return normals([shape], dtype, seed)[0]


def segments(batch: int, seq: int, seed: int = 3, documents: int = 4) -> jax.Array:
    """``int32[batch, seq]`` packed documents: sorted random ids below ``documents``, a
    different packing per row."""
    ids = np.random.default_rng(seed).integers(0, documents, (batch, seq))
    return jnp.asarray(np.sort(ids, axis=1), jnp.int32)


def with_vjp(fn: Callable, argnums=(0, 1, 2)) -> Callable:
    """``(args, cotangent) -> (fn(*args), the vjp of cotangent w.r.t. args[argnums])``;
    ``cotangent=None``: no vjp (None). On Explicit meshes the cotangent (a tree like the
    output: ``(out, lse)`` too) is placed like the output."""

    def run(args, cotangent):
        def on(*diff):
            full = list(args)
            for i, x in zip(argnums, diff):
                full[i] = x
            return fn(*full)

        if cotangent is None:
            return on(*(args[i] for i in argnums)), None
        out, vjp = jax.vjp(on, *(args[i] for i in argnums))
        return out, vjp(jax.tree.map(_placed_like, cotangent, out))

    return run


def _placed_like(cotangent, out):
    """``cotangent`` placed like ``out``: an Explicit mesh's axes are in ``out``'s type, and
    the cotangent must carry them too."""
    sharding = jax.typeof(out).sharding
    if any(entry is not None for entry in getattr(sharding, "spec", ())):
        return jax.reshard(cotangent, sharding)
    return cotangent


def out_and_vjp(fn: Callable, args: tuple, cotangent, argnums=(0, 1, 2)):
    """``(fn(*args), its vjp of cotangent w.r.t. args[argnums])``, in one jitted program."""
    return jax.jit(with_vjp(fn, argnums))(tuple(args), cotangent)


def upcast(args: tuple) -> tuple:
    """``args`` with every floating array in float32 (what the reference is given)."""
    return tuple(x.astype(jnp.float32) if x is not None and jnp.issubdtype(x.dtype, jnp.floating)
                 else x for x in args)


def assert_close(out, grads, expected, expected_grads, tolerances, *, args, argnums=(0, 1, 2)):
    """Shapes and dtypes first (``out`` in ``args[0]``'s dtype, each gradient in its
    argument's), then values: ``out`` within the out tolerance of that dtype, each
    gradient divided by ``max(1, |expected|)`` within the gradient one. ``out`` may be
    ``(out, lse)`` (``return_lse=True``): the float32 lse within the out tolerance too."""
    dtype = args[0].dtype
    if isinstance(out, tuple):
        (out, lse), (expected, expected_lse) = out, expected
        assert lse.shape == expected_lse.shape and lse.dtype == jnp.float32, (
            lse.shape, lse.dtype, expected_lse.shape)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse, np.float32),
                                   **tolerances(dtype), err_msg="lse")
    assert out.shape == expected.shape and out.dtype == dtype, (
        out.shape, out.dtype, expected.shape, dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               **tolerances(dtype))
    assert len(grads) == len(expected_grads)
    for i, got, want in zip(argnums, grads, expected_grads):
        want = np.asarray(want, np.float32)
        assert got.shape == want.shape and got.dtype == args[i].dtype, (
            i, got.shape, got.dtype, want.shape, args[i].dtype)
        # a float32 argument (e.g. sinks) of a low-precision call: the inputs' tolerance
        coarser = min(got.dtype, dtype, key=lambda d: jnp.finfo(d).bits)
        assert_gradient_close(got, want, tolerances(coarser, "grad"), err_msg=f"gradient {i}")


def assert_gradient_close(got, want, tolerance: dict, err_msg: str = "") -> None:
    """``got`` within ``tolerance`` of ``want`` after both are divided by
    ``max(1, |want|)``: a gradient summed over many tokens (a weight's) is as precise as
    its largest entry, not entry by entry."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))  # initial: an empty batch
    np.testing.assert_allclose(got / scale, want / scale, **tolerance, err_msg=err_msg)


def assert_matches(ours: Callable, reference: Callable, args: tuple, tolerances, *,
                   argnums=(0, 1, 2), seed: int = 7):
    """``ours(*args)`` and its gradients (w.r.t. ``args[argnums]``, for a random cotangent)
    equal ``reference``'s on the float32-upcast arguments; ``out`` keeps ``args[0]``'s
    dtype and each gradient its argument's. Returns ``(out, grads)``."""
    cotangent = normal(jax.eval_shape(reference, *upcast(args)).shape, jnp.float32, seed)
    out, grads = out_and_vjp(ours, args, cotangent.astype(args[0].dtype), argnums)
    expected, expected_grads = out_and_vjp(reference, upcast(args), cotangent, argnums)
    assert_close(out, grads, expected, expected_grads, tolerances, args=args, argnums=argnums)
    return out, grads


def tiered(params, keep, tier=pytest.mark.matrix) -> list:
    """``params`` (``pytest.param`` s, or tuples of values) with every one whose index
    ``keep(i)`` rejects moved to the slow ``tier`` (the ``matrix`` tier; ``interpret``
    for kernels in the Pallas interpreter): the default tier runs the covering subset
    ``keep`` picks, CI every one."""
    out = []
    for i, param in enumerate(params):
        if not hasattr(param, "values"):
            param = pytest.param(*param) if isinstance(param, tuple) else pytest.param(param)
        marks = [*param.marks] + ([] if keep(i) else [tier])
        out.append(pytest.param(*param.values, id=param.id, marks=marks))
    return out


#: The global entry point's strategies, as the tests run them.
STRATEGIES = ("ring", "ulysses", "hybrid", "allgather")


def strategy_mesh(strategy: str):
    """``(mesh, seq_axes)`` a strategy runs on in the tests: the 8 devices as one ``"sp"``
    axis, the hybrid's as ``("dcn", "ici")`` 2 x 4 (Auto axes)."""
    devices = np.array(jax.devices())
    if strategy == "hybrid":
        return jax.sharding.Mesh(devices.reshape(2, 4), ("dcn", "ici")), ("dcn", "ici")
    return jax.sharding.Mesh(devices, ("sp",)), "sp"


def record_xla_tiles(monkeypatch, record: Callable) -> None:
    """Make the XLA kernel's forward report, when it runs, each call as
    ``record("call", -1, q_position, kv_position)`` and each tile it computes as
    ``record("tile", row, q_position, kv_position)`` (the first position of the call's or
    the tile's queries and keys, which name them), through ``jax.debug.callback``.
    Programs traced before (a cached ``jit``) report nothing: clear the caches first."""
    from jax_seqpar.kernels import contract, xla

    def report(kind, row, q_positions, kv_positions):
        jax.debug.callback(lambda *a: record(kind, *(int(x) for x in a)), row,
                           q_positions[0, 0], kv_positions[0, 0])

    schedule, tile_step = xla.schedule, xla._tile_step

    def scheduled(spec, tiling, q_tokens, kv_tokens):
        q_tokens, kv_tokens, classes = schedule(spec, tiling, q_tokens, kv_tokens)
        report("call", -1, q_tokens.positions, kv_tokens.positions)
        return q_tokens, kv_tokens, classes

    def reported(row, tile_class, spec, q_tile, kv_tile, update, carry):
        def counted(carry, mask):
            report("tile", row, q_tile.positions, kv_tile.positions)
            return update(carry, mask)
        return tile_step(row, tile_class, spec, q_tile, kv_tile, counted, carry)

    monkeypatch.setattr(xla, "schedule", scheduled)
    monkeypatch.setattr(xla, "_tile_step", reported)
    # The kernels are traced once per shapes (kernels.contract's cache): the reporting
    # kernel gets a cache of its own, dropped with the patch.
    traced_once = contract._traced_once.__wrapped__
    monkeypatch.setattr(contract, "_traced_once", jax.jit(
        lambda *a: traced_once(*a), static_argnums=(0, 1, 2)))
