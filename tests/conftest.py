"""Test setup: 8 emulated CPU devices, strict numpy semantics, shared fixtures.

The environment is set before anything imports JAX (pytest loads this file before
the test modules), because the device count is fixed when the backend starts.
"""

import os

# LLVM at its lowest effort, and XLA:CPU's classic loop emitters instead of its MLIR
# fusion emitters: the suite compiles hundreds of small CPU programs and runs each once
# or twice, so code generation, not execution, is its cost (the fusion emitters alone
# take half of a kernel's compile time here). Programs compiled for GPU / TPU
# (jax_seqpar.tools.aot) pin XLA's production options instead.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false"]))
os.environ["JAX_PLATFORMS"] = "cpu"
# strategy="auto" reads tuned plans only when asked (jax_seqpar.planning.tuned): never here.
os.environ.pop("JAX_SEQPAR_TUNED_PLANS", None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import checks  # noqa: E402  (tests/checks.py: host-made inputs, the comparison)
import contexts  # noqa: E402  (tests/contexts.py: the ways a user calls the entry points)

jax.config.update("jax_numpy_rank_promotion", "raise")

NUM_DEVICES = 8

# (atol, rtol) against jax_seqpar.core.reference, which computes in float32; bf16 results
# are upcast before comparing. Gradients accumulate over the whole sequence, so their
# bf16 tolerance is looser than the output's.
_TOLERANCES = {
    np.dtype(jnp.float32): {"out": (2e-5, 2e-5), "grad": (2e-5, 2e-5)},
    np.dtype(jnp.bfloat16): {"out": (2e-2, 2e-2), "grad": (5e-2, 5e-2)},
    # jax.nn.dot_product_attention's own test tolerances for float16.
    np.dtype(jnp.float16): {"out": (1e-2, 1e-2), "grad": (2e-2, 2e-2)},
}


def pytest_configure(config):
    if jax.device_count() != NUM_DEVICES:
        raise pytest.UsageError(
            f"tests need {NUM_DEVICES} devices, got {jax.device_count()}: JAX was "
            "initialized before tests/conftest.py could set XLA_FLAGS.")


#: The slow tiers (``pyproject.toml`` describes each): a test marked with one of them is
#: also marked ``slow``, which the default run (``addopts``: ``-m "not slow"``) leaves out.
SLOW_TIERS = ("interpret", "compile_gate", "experiments", "multiprocess", "matrix")


#: Tiers whose tests take longest (a notebook, two processes, a GPU / TPU compile: 15 to
#: 90 s each), run first: pytest-xdist hands tests out in this order, so the run ends on
#: short tests instead of one worker finishing a notebook while the other waits.
LONGEST_FIRST = ("experiments", "multiprocess", "compile_gate")


@pytest.hookimpl(tryfirst=True)  # before pytest selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.get_closest_marker(tier) for tier in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: next((i for i, tier in enumerate(LONGEST_FIRST)
                                      if item.get_closest_marker(tier)), len(LONGEST_FIRST)))


@pytest.fixture(autouse=True)
def _kernels_traced_afresh():
    """Each test traces the kernels afresh (``kernels.contract`` traces a kernel once per
    shapes and options): a test that patches a kernel's internals (a constant, a
    recorder) sees its own patch, not a trace another test left."""
    from jax_seqpar.kernels import contract

    contract._traced_once.clear_cache()


@pytest.fixture
def tolerances():
    """``tolerances(dtype, kind="out") -> {"atol": float, "rtol": float}``.

    ``kind`` is ``"out"`` or ``"grad"``; use as
    ``np.testing.assert_allclose(actual, expected, **tolerances(q.dtype))``.
    """

    def lookup(dtype, kind="out"):
        atol, rtol = _TOLERANCES[np.dtype(dtype)][kind]
        return {"atol": atol, "rtol": rtol}

    return lookup


@pytest.fixture
def make_qkv():
    """``make_qkv(batch=2, seq=64, heads=4, kv_heads=None, head_dim=16, v_head_dim=None,
    dtype=jnp.float32, seed=0) -> (q, k, v)``, standard-normal (drawn on the host:
    :func:`checks.normals`), ``[B, S, H, D]``.

    ``kv_heads`` defaults to ``heads`` (MHA), ``v_head_dim`` to ``head_dim``.
    """

    def make(batch=2, seq=64, heads=4, kv_heads=None, head_dim=16, v_head_dim=None,
             dtype=jnp.float32, seed=0):
        kv_heads = heads if kv_heads is None else kv_heads
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        return tuple(checks.normals([(batch, seq, heads, head_dim),
                                     (batch, seq, kv_heads, head_dim),
                                     (batch, seq, kv_heads, v_head_dim)], dtype, seed))

    return make


@pytest.fixture(params=contexts.tiered(0))
def context(request):
    """A :class:`contexts.Context`: each global-API test runs once per way of calling
    (Explicit mesh inside ``jax.set_mesh``, Explicit without a context, Auto mesh, ``jit``
    with replicated inputs, ``jit`` with sequence-sharded inputs and ``out_shardings``).
    A test picks the context its default-tier run takes with
    ``@pytest.mark.parametrize("context", contexts.tiered(i), indirect=True)``."""
    return contexts.Context(request.param)
