"""The context product: every way a user calls the global entry points, as factors.

A cell is one level of each factor in :data:`FACTORS`: the mesh's axis type, whether the
call runs inside ``jax.set_mesh``, eagerly or under a compiling wrapper, the transform
(the forward, ``jax.grad`` of a scalar loss, ``jax.vjp``, a training step of an NNX
model), where the inputs live, and the entry point. :func:`run_cell` runs one cell on a
``(2, 4)`` mesh ``("data", "sp")`` (the sequence split over ``"sp"``, the batch over
``"data"`` for the batch-sharded inputs) at tiny shapes and compares its output and
gradients with :mod:`jax_seqpar.core.reference`. :func:`refusal` names the cells that
cannot work and the error they must raise instead (``docs/guide/contexts.md`` lists
them). :func:`covering` gives the tiers' covering subsets: the default tier's, where
every pair of levels of two factors meets in at least one cell, and the ``matrix``
tier's, where every four levels of four factors meet.

The training step is an NNX model (the entry point with a learned per-feature scale of
the queries, or :class:`~jax_seqpar.flax.SelfAttention` itself) whose loss is
differentiated with ``nnx.value_and_grad`` and updated by SGD: under ``nnx.jit`` in the
``jit`` cells, op by op in the ``eager`` ones.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_seqpar as sp
from jax_seqpar.api import inference
from jax_seqpar.core import reference
from jax_seqpar.flax import SelfAttention, make_attention_fn
from jax_seqpar.flax._rope import apply_rope

#: factor -> its levels, in the order cells name them.
FACTORS = {
    "axis_type": ("explicit", "auto"),
    "context": ("set_mesh", "none"),
    "mode": ("eager", "jit"),
    "transform": ("forward", "grad", "vjp", "train"),
    "inputs": ("numpy", "default", "replicated", "sequence", "batch"),
    "entry": ("ring", "ulysses", "allgather", "hybrid", "auto", "dot_product",
              "self_attention", "attention_fn", "prefill", "decode"),
}

B, S, H, HKV, D, E = 2, 16, 4, 2, 8, 16  # batch, tokens, heads, K/V heads, head dim, d_model
MESH_SHAPE, MESH_AXES = (2, 4), ("data", "sp")
TOLERANCE = dict(atol=2e-5, rtol=2e-5)
GRADIENTS = ("grad", "vjp", "train")

#: Messages of the refused cells (:func:`refusal`).
NEEDS_SET_MESH = "set_mesh"
FORWARD_ONLY = "decode is inference against a KV cache and has no gradient"
SHARDED_CONTRACTION = "Contracting dimensions are sharded"


def cells(factors: dict = FACTORS) -> list[dict]:
    """The whole product, as dicts factor -> level."""
    return [dict(zip(factors, levels)) for levels in itertools.product(*factors.values())]


def cell_id(cell: dict) -> str:
    return "-".join(cell[name] for name in FACTORS)


def _tuples(cell: dict, names: list, strength: int) -> set:
    """The ``strength``-tuples of ``(factor, level)`` that ``cell`` (possibly partial) holds."""
    return {tuple((a, cell[a]) for a in combo)
            for combo in itertools.combinations(names, strength) if all(a in cell for a in combo)}


def covering(factors: dict = FACTORS, strength: int = 2, start: tuple = ()) -> list[dict]:
    """A deterministic covering subset of ``factors``' product: every ``strength`` levels
    of ``strength`` different factors meet in at least one cell (2: every pair).

    Greedy: the rows ``start`` first; then each new cell starts from the first tuple not
    yet covered (factors and levels in their given order) and gives every other factor,
    in order, the level that covers the most uncovered tuples with the levels already
    chosen (the first such level on a tie), until no tuple is left. ``start`` rows come
    back first, unchanged.
    """
    names = list(factors)
    order = [tuple(zip(combo, levels)) for combo in itertools.combinations(names, strength)
             for levels in itertools.product(*(factors[a] for a in combo))]
    uncovered = set(order)
    rows = [dict(row) for row in start]
    for row in rows:
        uncovered -= _tuples(row, names, strength)
    while uncovered:
        cell = dict(next(tuple_ for tuple_ in order if tuple_ in uncovered))
        for name in names:
            if name in cell:
                continue
            cell[name] = max(factors[name], key=lambda level: (
                len(_tuples({**cell, name: level}, names, strength) & uncovered),
                -factors[name].index(level)))
        cell = {name: cell[name] for name in names}
        uncovered -= _tuples(cell, names, strength)
        rows.append(cell)
    return rows


def covered(rows: list[dict], factors: dict = FACTORS, strength: int = 2) -> set:
    """The ``strength``-tuples of levels the ``rows`` hold."""
    return set().union(*(_tuples(row, list(factors), strength) for row in rows))


def every_tuple(factors: dict = FACTORS, strength: int = 2) -> set:
    """Every ``strength``-tuple of levels of different factors."""
    return covered(cells(factors), factors, strength)


def refusal(cell: dict) -> Optional[str]:
    """The error (a regex of its message) a cell that cannot work raises, or None.

    * The gradient of a scalar loss (``jax.grad``, an eager training step's
      ``nnx.value_and_grad``) taken eagerly of a call on an Explicit mesh outside
      ``jax.set_mesh``: JAX itself refuses to seed the backward (a scalar typed on the
      mesh, no mesh in context) and asks for ``jax.set_mesh``. ``jax.vjp`` there works:
      the caller's cotangent is already an array on the mesh.
    * A gradient of ``decode``: decoding is forward only (inference against the KV
      cache), and its backward raises our ``ValueError`` saying so.
    * The training step of :class:`~jax_seqpar.flax.SelfAttention` under ``nnx.jit`` on an
      Explicit mesh outside ``jax.set_mesh`` with inputs sharded along the sequence or
      the batch: the projections' weight gradient contracts the sharded dimension and
      JAX asks for its ``out_sharding`` (a plain ``nnx.LinearGeneral`` fails the same).
    """
    if (cell["axis_type"] == "explicit" and cell["context"] == "none"
            and cell["mode"] == "eager" and cell["transform"] in ("grad", "train")):
        return NEEDS_SET_MESH  # JAX refuses before any backward runs (decode's too)
    if cell["transform"] in GRADIENTS and cell["entry"] == "decode":
        return FORWARD_ONLY
    if (cell["axis_type"] == "explicit" and cell["context"] == "none"
            and cell["entry"] == "self_attention" and cell["transform"] == "train"
            and cell["inputs"] in ("sequence", "batch")):
        return SHARDED_CONTRACTION
    return None


# --- the mesh, the inputs --------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def mesh(axis_type: str) -> jax.sharding.Mesh:
    kind = AxisType.Explicit if axis_type == "explicit" else AxisType.Auto
    return jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(kind,) * len(MESH_AXES))


@functools.lru_cache(maxsize=None)
def host_inputs(entry: str) -> tuple:
    """The entry point's inputs and the loss's cotangent, float32 numpy arrays."""
    rng = np.random.default_rng(0)
    if entry == "self_attention":
        shapes = [(B, S, E)]
        out = (B, S, E)
    else:
        shapes = [(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D)]
        out = (B, 1 if entry == "decode" else S, H, D)
    arrays = [rng.standard_normal(shape, np.float32) for shape in shapes]
    return tuple(arrays), rng.standard_normal(out, np.float32)


def place(x: np.ndarray, inputs: str, mesh: jax.sharding.Mesh):
    if inputs == "numpy":
        return x
    if inputs == "default":
        return jnp.asarray(x)
    spec = {"replicated": P(), "sequence": P(None, "sp"), "batch": P("data")}[inputs]
    return jax.device_put(x, NamedSharding(mesh, spec))


# --- the entry points as NNX models ------------------------------------------------------

class _Scaled(nnx.Module):
    """``entry(q * w, k, v)``: an entry point with a learned per-feature query scale."""

    def __init__(self, attend):
        self.w = nnx.Param(jnp.asarray(np.linspace(0.5, 1.5, D, dtype=np.float32)))
        self.attend = attend

    def __call__(self, q, k, v):
        return self.attend(q * self.w[...][None, None, None, :], k, v)  # [B, S, H, D]


def _new_token(q, k, v):
    """The token decode appends after the prompt: the prompt's mean (a reduction, which
    every input sharding allows; slicing a sequence-sharded array would not)."""
    return tuple(jnp.mean(x, axis=1, keepdims=True) for x in (q, k, v))  # [B, 1, heads, D]


def _cache(mesh):
    return inference.KVCache.create(mesh, batch=B, capacity=2 * S, num_kv_heads=HKV,
                                    head_dim=D, dtype=jnp.float32)


def _attend(entry: str, mesh):
    if entry in ("ring", "ulysses", "allgather", "hybrid", "auto"):
        extra = dict(ulysses_size=2) if entry == "hybrid" else {}
        return functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes="sp",
                                 strategy=entry, causal=True, **extra)
    if entry == "dot_product":
        return functools.partial(sp.dot_product_attention, mesh=mesh, seq_axes="sp",
                                 is_causal=True)
    if entry == "attention_fn":
        return make_attention_fn(mesh, seq_axes="sp", causal=True)
    if entry == "prefill":
        return lambda q, k, v: inference.prefill(q, k, v, _cache(mesh))[0]
    if entry == "decode":
        def decode(q, k, v):
            _, cache = inference.prefill(q, k, v, _cache(mesh))
            return inference.decode(*_new_token(q, k, v), cache)[0]
        return decode
    raise ValueError(entry)


def model(entry: str, mesh) -> nnx.Module:
    """The entry point on ``mesh`` (None: the reference) as an NNX model."""
    if entry == "self_attention":
        layer = SelfAttention(E, H, num_kv_heads=HKV, head_dim=D, causal=True,
                              mesh=mesh, rngs=nnx.Rngs(0))
        return layer if mesh is not None else _ReferenceLayer(layer)
    if mesh is None:
        def attend(q, k, v):
            if entry == "decode":  # the prompt and the new token, the new token's row
                q, k, v = (jnp.concatenate([x, new], 1)
                           for x, new in zip((q, k, v), _new_token(q, k, v)))
                return reference.attention(q, k, v, causal=True)[:, -1:]
            return reference.attention(q, k, v, causal=True)
        return _Scaled(attend)
    return _Scaled(_attend(entry, mesh))


@functools.lru_cache(maxsize=None)
def _model(entry: str, axis_type: str) -> nnx.Module:
    """:func:`model` on the axis type's mesh, kept for the cells that do not update it."""
    return model(entry, mesh(axis_type))


class _ReferenceLayer(nnx.Module):
    """:class:`SelfAttention`'s projections and RoPE around the reference attention."""

    def __init__(self, layer: SelfAttention):
        self.layer = layer

    def __call__(self, x):
        layer = self.layer
        positions = jnp.arange(x.shape[1], dtype=jnp.int32)
        q = apply_rope(layer.q_proj(x), positions, base=layer.rope_base)
        k = apply_rope(layer.k_proj(x), positions, base=layer.rope_base)
        return layer.o_proj(reference.attention(q, k, layer.v_proj(x), causal=True))


# --- the transforms ---------------------------------------------------------------------

def _loss(fn, cotangent):
    return lambda *args: jnp.sum(fn(*args) * cotangent)


def _vjp(fn, args, cotangent):
    out, pull = jax.vjp(fn, *args)
    return out, pull(_placed_like(cotangent, out))


def _placed_like(cotangent, out):
    sharding = jax.typeof(out).sharding
    if any(entry is not None for entry in getattr(sharding, "spec", ())):
        return jax.reshard(cotangent, sharding)
    return cotangent


def _train_step(module, args, cotangent):
    def loss(module):
        return jnp.sum(module(*args) * cotangent)

    value, grads = nnx.value_and_grad(loss)(module)
    nnx.update(module, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(module, nnx.Param),
                                    grads))
    return value, grads


_jit_train_step = nnx.jit(_train_step)


def _apply(transform: str, mode: str, module, args, cotangent):
    """What the cell computes: ``out`` (forward), the gradients of the inputs (grad),
    ``(out, gradients)`` (vjp), ``(loss, parameter gradients, updated parameters)``
    (train)."""
    if transform == "train":
        step = _jit_train_step if mode == "jit" else _train_step
        loss, grads = step(module, args, cotangent)
        return loss, grads, nnx.state(module, nnx.Param)
    argnums = tuple(range(len(args)))
    if transform == "forward":
        fn = module
    elif transform == "grad":
        fn = jax.grad(lambda *a: _loss(module, a[-1])(*a[:-1]), argnums=argnums)
    else:
        fn = lambda *a: _vjp(module, a[:-1], a[-1])  # noqa: E731
    if transform != "forward":
        args = (*args, cotangent)
    if mode == "jit":
        fn = _jitted(fn, transform, module)
    return fn(*args)


_JITTED: dict = {}


def _jitted(fn, transform, module):
    """``jax.jit(fn)``, one per module and transform: cells that differ only in context and
    inputs reuse its compilations (jit's cache keys on the inputs' shardings)."""
    key = (id(module), transform)
    if key not in _JITTED:
        _JITTED[key] = (module, jax.jit(fn))
    return _JITTED[key][1]


@functools.lru_cache(maxsize=None)
def expected(entry: str, transform: str):
    """The reference's result of the cell's computation (host float32)."""
    args, cotangent = host_inputs(entry)
    result = _apply(transform, "eager", model(entry, None), tuple(map(jnp.asarray, args)),
                    jnp.asarray(cotangent))
    return jax.tree.map(np.asarray, result)


_RUN = [0]
#: Cells one process runs before it lets go of its compiled programs: XLA:CPU maps each
#: executable's code, and a process that keeps those of the whole product runs out.
RELEASE_EVERY = 50


def _release():
    _JITTED.clear()
    _model.cache_clear()
    jax.clear_caches()


def run_cell(cell: dict):
    """Run ``cell`` and compare it with the reference; the cells :func:`refusal` names must
    raise its error instead (returns the error then)."""
    _RUN[0] += 1
    if _RUN[0] % RELEASE_EVERY == 0:
        _release()
    the_mesh = mesh(cell["axis_type"])
    args, cotangent = host_inputs(cell["entry"])
    context = (jax.set_mesh(the_mesh) if cell["context"] == "set_mesh"
               else contextlib.nullcontext())
    refused = refusal(cell)
    with context:
        placed = tuple(place(x, cell["inputs"], the_mesh) for x in args)
        # the loss's target: on the mesh like the inputs (replicated for host-made ones);
        # decode's one new token cannot be split along the sequence
        where = "replicated" if cell["inputs"] in ("numpy", "default") else cell["inputs"]
        ct = (jnp.asarray(cotangent) if cell["entry"] == "decode"
              else place(cotangent, where, the_mesh))
        module = (model(cell["entry"], the_mesh) if cell["transform"] == "train"
                  else _model(cell["entry"], cell["axis_type"]))
        try:
            got = _apply(cell["transform"], cell["mode"], module, placed, ct)
            got = jax.tree.map(np.asarray, got)
        except Exception as error:  # noqa: BLE001 - compared with the expected refusal
            if refused is None:
                raise
            assert re.search(refused, str(error)), (cell_id(cell), refused, error)
            return error
    assert refused is None, f"{cell_id(cell)} was expected to be refused ({refused}) but ran"
    want = expected(cell["entry"], cell["transform"])
    # The reference layer holds SelfAttention as .layer: same leaves, one more key.
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert [x.shape for x in got_leaves] == [x.shape for x in want_leaves], cell_id(cell)
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(g, w, err_msg=cell_id(cell), **TOLERANCE)
    return got
