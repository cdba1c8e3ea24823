"""The Pallas kernels compile for H100 (sm_90) and A100 (sm_80) with spills as errors.

Deviceless: a compile-only GPU from a target description and XLA:GPU's real
Triton -> PTX -> ptxas pipeline (``experiments/gpu_resources.py``), forward and
backward at the default tiles, in float32 (bf16 / fp16 at every head dim: the
compile gate). Skipped only where the CUDA plugin and ptxas are not installed
(``jax[cuda12]``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jax.numpy as jnp
import pytest

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "experiments", "gpu_resources.py")
_spec = importlib.util.spec_from_file_location("gpu_resources", _PATH)
gpu_resources = importlib.util.module_from_spec(_spec)
sys.modules["gpu_resources"] = gpu_resources  # dataclasses look their module up
_spec.loader.exec_module(gpu_resources)

pytestmark = pytest.mark.skipif(not gpu_resources.plugins_available(),
                                reason="needs the CUDA plugin and ptxas: jax[cuda12]")

# bf16 and fp16 at every head dim are compiled through the global API by the compile
# gate (tests/test_compile_gate.py); here the float32 policy (TF32x3 dots), up to head
# dim 128 (wider float32 still spills in the backward), with ptxas's own counts.
CASES = [(target, d, d, "float32") for target in ("h100", "a100") for d in (64, 128)]


@pytest.mark.parametrize("target,d_qk,d_v,dtype", CASES,
                         ids=[f"{t}-{a}_{b}-{d}" for t, a, b, d in CASES])
def test_compiles_without_spills(target, d_qk, d_v, dtype, tmp_path):
    _, found = gpu_resources.compile_kernels(target, d_qk, d_v, jnp.dtype(dtype), seq=512,
                                             spills_as_errors=True, dump_dir=str(tmp_path))
    assert set(found) == set(gpu_resources.KERNEL_NAMES)  # all three are Triton kernels
    for name, res in found.items():
        assert res.spill_stores == res.spill_loads == 0, (name, res)
