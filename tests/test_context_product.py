"""The context product (tests/context_product.py): every way of calling every entry point.

Factors: the mesh's axis type {Explicit, Auto} x {inside ``jax.set_mesh``, no context} x
{eager, ``jax.jit``} x {forward, ``jax.grad`` of a scalar loss, ``jax.vjp``, a training
step (``nnx.jit`` under jit)} x inputs {numpy, default device, replicated on the mesh,
sequence-sharded, batch-sharded over the mesh's other axis} x entry points
(``sequence_parallel_attention`` with each strategy and ``"auto"``,
``dot_product_attention``, ``SelfAttention``, ``make_attention_fn``, ``prefill``,
``decode``): 1600 cells. The default tier runs a covering subset where every pair of
levels of two factors meets at least once (:func:`context_product.covering`); the
``matrix`` tier extends it to every four levels of four factors (about 450 cells: a
defect that needs four factors to show, as Auto + ``set_mesh`` + eager + ``jax.grad``
did, is met). ``JAX_SEQPAR_CONTEXT_PRODUCT=full`` runs the whole product in the
``matrix`` tier. Each cell is compared with the reference (outputs and gradients), or,
where it cannot work (:func:`context_product.refusal`, listed in
``docs/guide/contexts.md``), must raise the error named there."""

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import context_product as product
import jax_seqpar as sp
from jax_seqpar.core import reference

_DEFAULT = product.covering(strength=2)
_MATRIX = (product.cells() if os.environ.get("JAX_SEQPAR_CONTEXT_PRODUCT") == "full"
           else product.covering(strength=4, start=_DEFAULT))
_DEFAULT_IDS = {product.cell_id(cell) for cell in _DEFAULT}


def _params():
    for cell in _MATRIX:
        name = product.cell_id(cell)
        yield pytest.param(cell, id=name,
                           marks=() if name in _DEFAULT_IDS else pytest.mark.matrix)


def test_the_tiers_cover_every_pair_and_every_four():
    assert product.covered(_DEFAULT) == product.every_tuple()
    assert product.covering(strength=2) == _DEFAULT  # deterministic: the same cells every run
    assert len(_DEFAULT) <= 60, len(_DEFAULT)  # 50 = 10 entries x 5 inputs at best
    assert product.covered(_MATRIX, strength=4) == product.every_tuple(strength=4)
    assert _DEFAULT_IDS <= {product.cell_id(cell) for cell in _MATRIX}
    assert len(_MATRIX) in (len(product.cells()), len(product.covering(strength=4,
                                                                       start=_DEFAULT)))


@pytest.mark.parametrize("strength", [2, 3])
@pytest.mark.parametrize("factors", [
    {"a": (0, 1), "b": (0, 1), "c": (0, 1)},
    {"a": tuple(range(4)), "b": tuple(range(3)), "c": (0, 1), "d": (0, 1, 2), "e": (0,)},
])
def test_covering_covers_every_tuple_of_any_factors(factors, strength):
    rows = product.covering(factors, strength)
    assert product.covered(rows, factors, strength) == product.every_tuple(factors, strength)
    if strength < len(factors):
        assert len(rows) < np.prod([len(levels) for levels in factors.values()])
    start = rows[:2]
    assert product.covering(factors, strength, start=start)[:2] == start


def test_the_refused_cells_are_the_documented_ones():
    """Every refused cell is listed in the guide's contexts page, by its reason."""
    refused = [cell for cell in product.cells() if product.refusal(cell)]
    # an Explicit mesh's eager scalar-loss gradients outside set_mesh: 2 transforms x 5
    # inputs x 10 entries; decode's other gradients: 3 transforms x 2 x 2 x 2 x 5 inputs
    # less those 2 x 5;
    # SelfAttention's nnx.jit step there, sequence- or batch-sharded inputs: 2
    assert len(refused) == 2 * 5 * 10 + (3 * 2 * 2 * 2 * 5 - 2 * 5) + 2
    page = os.path.join(os.path.dirname(__file__), "..", "docs", "guide", "contexts.md")
    with open(page) as file:
        page = file.read()
    assert "## Refused cells" in page
    for reason in ("jax.set_mesh", "decode", "forward only", "out_sharding"):
        assert reason in page


@pytest.mark.parametrize("cell", list(_params()))
def test_cell(cell):
    product.run_cell(cell)


# --- the cells of issue 40's report, on its one-axis mesh ------------------------------

def _auto_mesh():
    return jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))


_ENTRIES = {
    "sequence_parallel_attention": functools.partial(sp.sequence_parallel_attention,
                                                     causal=True),
    "dot_product_attention": lambda q, k, v, mesh: sp.dot_product_attention(
        q, k, v, is_causal=True, mesh=mesh),
}


@pytest.mark.parametrize("entry", sorted(_ENTRIES))
@pytest.mark.parametrize("set_mesh", [True, False], ids=["set-mesh", "no-context"])
def test_eager_grad_on_an_auto_mesh_with_replicated_inputs(entry, set_mesh, seq=64):
    """``jax.grad`` eagerly, an Auto mesh, inputs replicated on it (made inside
    ``jax.set_mesh``, which places them so, or put there): the program declared the
    sequence-sharded input and output shardings ``jit`` will not reshard a committed
    array to ("Sharding passed to jit does not match the sharding on the respective
    arg")."""
    mesh = _auto_mesh()
    attend = functools.partial(_ENTRIES[entry], mesh=mesh)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((1, seq, 8, 8), np.float32) for _ in range(3)]
    target = rng.standard_normal((1, seq, 8, 8), np.float32)

    def loss(attention, q, k, v, target):
        return jnp.sum(attention(q, k, v) * target)

    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        if set_mesh:  # made inside the context: JAX places them replicated on the mesh
            q, k, v, t = (jnp.asarray(x) for x in (*host, target))
        else:
            q, k, v, t = (jax.device_put(x, NamedSharding(mesh, P())) for x in (*host, target))
        assert q.sharding.is_fully_replicated and q.sharding.mesh.shape == mesh.shape
        grads = jax.grad(functools.partial(loss, attend), argnums=(1, 2, 3))(q, k, v, t)
    want = jax.grad(functools.partial(loss, functools.partial(reference.attention,
                                                              causal=True)),
                    argnums=(1, 2, 3))(*map(jnp.asarray, (*host, target)))
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)
