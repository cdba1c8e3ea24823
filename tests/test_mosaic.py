"""What only the TPU (Mosaic) kernel has: its fetch plan, its validation and its lowering.

The kernel against the reference is in the kernel matrix (``test_kernels.py``, at 128-token
tiles, the TPU lane width); every strategy with ``kernel="mosaic"`` in
``test_exactness.py`` (``test_strategies[*-mosaic]``); the TPU compilation itself in
``test_mosaic_compile.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checks
import kernel_cases as kc
from jax_seqpar.core import blocks, masks
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.kernels.options import Options
from jax_seqpar.kernels.tpu import mosaic


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_accumulate_in_the_kernel(dtype):
    """The forward continues ``accumulate=(out, lse)`` of earlier keys in the kernel (in
    place: a buffer still used after the call keeps its value) and matches the XLA
    kernel merging after; the backward adds ``accumulate``'s dq in the dq kernel."""
    from jax_seqpar.kernels import xla

    case = kc.for_kernel(kc.Case(batch=2, heads=4, kv_heads=2, causal=True, segments=True),
                         "mosaic")  # two 128-token tiles
    q_tokens, kv_tokens = kc.tokens(case)
    (q, k, v), (dout, _) = kc.inputs(case, dtype)
    plain = Options(MaskSpec.make(case.causal), case.d_qk**-0.5, mosaic)
    tiled = kc.options("mosaic", case)
    part = lambda x, s: jax.tree.map(lambda a: a[:, s], x)  # noqa: E731
    first, rest = slice(0, case.tile), slice(case.tile, None)
    earlier = xla.forward(q, part(k, first), part(v, first), q_tokens, part(kv_tokens, first),
                          plain)
    assert bool(jnp.any(earlier[1] == masks.EMPTY_LSE))

    @jax.jit
    def continued(acc):
        result = mosaic.forward(q, part(k, rest), part(v, rest), q_tokens,
                                part(kv_tokens, rest), tiled, accumulate=acc)
        return result, acc

    (out, lse), kept = continued(earlier)
    want = xla.forward(q, part(k, rest), part(v, rest), q_tokens, part(kv_tokens, rest),
                       plain, accumulate=earlier)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, want[0], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse, want[1], atol=tol, rtol=tol)
    for got, given in zip(kept, earlier):
        np.testing.assert_array_equal(got, given)
    full = xla.forward(q, k, v, q_tokens, kv_tokens, plain)
    np.testing.assert_allclose(out, full[0], atol=tol, rtol=tol)

    delta = jnp.sum(dout * full[0], axis=-1)
    args = (q, k, v, q_tokens, kv_tokens, full[1], delta, dout.astype(dtype), tiled)
    grads = mosaic.backward(*args)
    totals = tuple(checks.normals([g.shape for g in grads], seed=3))
    summed = mosaic.backward(*args, accumulate=totals)
    for got, grad, total in zip(summed, grads, totals):
        np.testing.assert_allclose(got, grad + total, atol=1e-5, rtol=1e-5)


def test_plan_fetches_no_new_tile_on_empty_steps():
    """An EMPTY step re-requests the previous block (no copy); a row's first EMPTY
    steps request its first visible tile, which the pipeline then keeps."""
    from jax_seqpar.kernels.tpu import _common as _mosaic_common

    e, p, f = blocks.EMPTY, blocks.PARTIAL, blocks.FULL
    classes = jnp.array([[e, e, p, f, e, p], [e, e, e, e, e, e], [f, e, e, p, e, e]], jnp.int32)
    plan = np.asarray(_mosaic_common.plan(classes))
    np.testing.assert_array_equal(plan & 3, classes)
    np.testing.assert_array_equal(plan >> 2, [[2, 2, 2, 3, 3, 5], [0] * 6, [0, 0, 0, 3, 3, 3]])


@pytest.mark.parametrize("bad,message", [
    (dict(block_sizes=dict(block_q=100)), "multiple of 128"),
    (dict(dtype=jnp.float16), "cast them first"),
    (dict(softcap=-1.0), "positive float"),
])
def test_bad_input_raises(bad, message):
    q = k = v = jnp.zeros((1, 16, 2, 32), bad.get("dtype", jnp.float32))
    tokens = Tokens(jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ValueError, match=message):
        block_sizes = mosaic.BlockSizes(**bad.get("block_sizes", {}))
        mosaic.forward(q, k, v, tokens, tokens,
                       Options(MaskSpec(), 1.0, mosaic, block_sizes, bad.get("softcap")))


def test_lowering_for_tpu_emits_mosaic_and_cpu_interprets():
    """The kernel follows the platform the program is lowered for, not the host."""
    case = kc.for_kernel(kc.Case(batch=1, causal=True), "mosaic")
    q_tokens, kv_tokens = kc.tokens(case)
    (q, k, v), _ = kc.inputs(case, jnp.bfloat16)

    def f(q, k, v):
        return mosaic.forward(q, k, v, q_tokens, kv_tokens,
                              Options(MaskSpec.make(True), 0.1, mosaic))

    traced = jax.jit(f).trace(q, k, v)
    assert "tpu_custom_call" in traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" not in traced.lower(lowering_platforms=("cpu",)).as_text()
