"""The Mosaic kernel compiled for TPU pods by libtpu, with no TPU (compile-only devices).

Skipped only when libtpu is not installed (``pip install "jax[tpu]==<jax version>"``).
Each case compiles forward+backward and asserts the Mosaic kernels are in the
compiled program (``tpu_custom_call``): a block over VMEM or a layout Mosaic
cannot lower fails here. One case per target and strategy keeps the time small;
``jax-seqpar bench --target v5p:2x2x2 --kernels mosaic`` compiles every strategy with it.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

pytestmark = pytest.mark.compile_gate
pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu (jax[tpu])")
# Several compile-only processes may load libtpu at once on a shared host.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax_seqpar as sp  # noqa: E402
from jax_seqpar.kernels import make_options  # noqa: E402
from jax_seqpar.kernels.tpu import mosaic  # noqa: E402
from jax_seqpar.core.masks import MaskSpec, Tokens  # noqa: E402

MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'


def _tpu_mesh(name, shape=None, axis_names=("sp",)):
    """A compile-only mesh of TPU topology ``name`` (e.g. ``"v5p:2x2x2"``)."""
    from jax.experimental import topologies

    devices = np.array(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    return jax.sharding.Mesh(devices.reshape(shape or (devices.size,)), axis_names)


def _compile(fn, args):
    compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile()
    return compiled, compiled.as_text()


def _structs(sharding, batch, seq, heads, kv_heads, d_qk, d_v, dtype=jnp.bfloat16):
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape in (
        (batch, seq, heads, d_qk), (batch, seq, kv_heads, d_qk), (batch, seq, kv_heads, d_v))]


@pytest.mark.parametrize("target,heads,kv_heads,d_qk,d_v,max_logit", [
    pytest.param("v5e:2x4", 8, 2, 128, 128, False, id="v5e-d128"),
    pytest.param("v5p:2x2x2", 4, 4, 256, 256, False, id="v5p-d256"),
    pytest.param("v6e:2x4", 8, 1, 576, 512, False, id="v6e-mla"),
    pytest.param("v5p:2x2x2", 8, 2, 128, 128, True, id="v5p-d128-max-logit"),
])
def test_kernel_compiles_at_default_tiles(target, heads, kv_heads, d_qk, d_v, max_logit):
    """Forward, dq and dk/dv at the default (largest) tiles fit VMEM and lower; with
    ``return_max_logit`` the forward's extra output and VMEM running max too."""
    mesh = _tpu_mesh(target)
    chip = NamedSharding(jax.sharding.Mesh(mesh.devices.flat[:1], ("x",)), P())
    # Several tiles of every kernel.
    seq = 2 * mosaic.default_block_sizes(d_qk, d_v, jnp.bfloat16).block_q

    def fwd_bwd(q, k, v):
        tokens = Tokens(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (1, seq)),
                        jnp.zeros((1, seq), jnp.int32))

        def loss(q, k, v):
            out, lse, *high = mosaic.attention(q, k, v, tokens, tokens, make_options(
                q, MaskSpec.make(True), kernel="mosaic", softcap=30.0,
                return_max_logit=max_logit))
            return out.sum() + lse.sum() + sum(x.sum() for x in high)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    _, text = _compile(fwd_bwd, _structs(chip, 1, seq, heads, kv_heads, d_qk, d_v))
    assert text.count(MOSAIC_CALL) == 3


@pytest.mark.parametrize("backward", ["float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("d", [128, 256])
def test_fp8_kernel_compiles_for_v5p(d, backward):
    """FP8 (``compute_dtype=float8_e4m3fn``): q, k, v (and dout in an FP8 backward) enter
    the kernels as FP8 values with float32 per-token scales, widened to bfloat16 in VMEM
    for v5p's MXU; forward, dq and dk/dv compile at the default tiles, with GQA and
    segment ids, causal."""
    mesh = _tpu_mesh("v5p:2x2x2")
    chip = NamedSharding(jax.sharding.Mesh(mesh.devices.flat[:1], ("x",)), P())
    seq = 2 * mosaic.default_block_sizes(d, d, jnp.bfloat16).block_q
    compute = sp.Compute(jnp.float8_e4m3fn, backward_dtype=backward, hadamard=False)

    def fwd_bwd(q, k, v):
        tokens = Tokens(jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (1, seq)),
                        jnp.repeat(jnp.arange(2, dtype=jnp.int32), seq // 2)[None])

        def loss(q, k, v):
            out, lse = mosaic.attention(q, k, v, tokens, tokens, make_options(
                q, MaskSpec.make(True), kernel="mosaic", compute_dtype=compute))
            return out.sum() + lse.sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    _, text = _compile(fwd_bwd, _structs(chip, 1, seq, 8, 2, d, d))
    assert text.count(MOSAIC_CALL) == 3
    assert "f8e4m3fn[" in text  # the kernels take FP8 operands


@pytest.mark.parametrize("strategy,target,d_qk,d_v,max_logit", [
    pytest.param("ring", "v5p:2x2x2", 128, 128, False, id="ring-v5p-d128"),
    pytest.param("ulysses", "v5e:2x4", 256, 256, False, id="ulysses-v5e-d256"),
    pytest.param("allgather", "v6e:2x4", 576, 512, False, id="allgather-v6e-mla"),
    pytest.param("hybrid", "v5p:2x2x2", 128, 128, False, id="hybrid-v5p-d128"),
    pytest.param("ring", "v5p:2x2x2", 128, 128, True, id="ring-v5p-d128-max-logit"),
])
def test_strategy_compiles_with_mosaic(strategy, target, d_qk, d_v, max_logit):
    """Forward+backward through the global API on a compile-only TPU mesh; with
    ``return_max_logit`` the ring's steps continue the running max logit in the kernel
    (``accumulate`` triples aliased to the outputs)."""
    if strategy == "hybrid":
        axes = ("dcn", "ici")
        mesh = _tpu_mesh(target, (2, 4), axes)
    else:
        axes = "sp"
        mesh = _tpu_mesh(target)
    kv_heads = 1 if d_qk != d_v else 4  # MLA absorbed: MQA with Dqk=576, Dv=512
    attend = functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=axes,
                               strategy=strategy, kernel="mosaic", causal=True,
                               return_max_logit=max_logit)

    def loss(q, k, v):
        out, *high = jax.tree.leaves(attend(q, k, v))
        return out.astype(jnp.float32).sum() + sum(x.sum() for x in high)

    structs = _structs(NamedSharding(mesh, P(None, axes)), 1, 2048, 8, kv_heads, d_qk, d_v)
    _, text = _compile(jax.grad(loss, argnums=(0, 1, 2)), structs)
    assert text.count(MOSAIC_CALL) >= 3
