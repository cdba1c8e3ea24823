"""FP8 (``compute_dtype=float8_e4m3fn``) in the Pallas kernels: the Triton kernel in the
Pallas interpreter and the Mosaic kernel in the Pallas interpreter (as every CPU test
runs them), against :mod:`jax_seqpar.core.reference` in float32, outputs and gradients,
with the XLA kernel's FP8 error on the same problem as the yardstick
(``test_compute_dtype.py`` bounds that one against float64); their compilation for H100
and v5p is in the compile gate (``test_compile_gate.py``, ``test_mosaic_compile.py``).

The problem: FlashAttention-3's distribution (``test_compute_dtype.fa3_inputs``), GQA (4
query heads on 2 K/V heads), causal within two packed documents (segment ids)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_seqpar
from jax_seqpar import kernels
from jax_seqpar.core import reference
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.kernels import make_options
from jax_seqpar.kernels.gpu import pallas
from test_compute_dtype import fa3_inputs

SEQ = 256
FP8 = jnp.float8_e4m3fn
BACKWARDS = {"fp8": FP8, "bf16": jnp.bfloat16}
#: The Pallas kernels' error may exceed the XLA kernel's FP8 error on the same problem by
#: this factor (other tiles: other per-tile scales of P and dS).
OF_XLA = 1.25
#: Bounds against the float32 reference at this shape (measured: out 1.27e-2 (Mosaic),
#: 1.62e-2 (Triton), 1.60e-2 (XLA); the gradients' relative RMSE up to 0.074 with an FP8
#: backward, 0.058 with a bf16 one).
OUT_RMSE = 2e-2
GRAD = {"fp8": 0.1, "bf16": 0.08}
#: FP8 as a kernel takes it: q and k as given (the strategies rotate them before; a kernel
#: refuses a call that still asks for the rotation).
UNROTATED = jax_seqpar.Compute(FP8, hadamard=False)


@pytest.fixture(scope="module")
def problem():
    q, k, v, g = fa3_inputs((1, SEQ, 4, 64))
    k, v = k[:, :, :2], v[:, :, :2]  # GQA: 2 K/V heads
    segments = jnp.repeat(jnp.arange(2, dtype=jnp.int32), SEQ // 2)[None]
    tokens = Tokens(jnp.arange(SEQ, dtype=jnp.int32)[None], segments)

    def oracle(q, k, v):
        return reference.attention(q, k, v, causal=True, segment_ids=segments)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, pull = jax.vjp(oracle, *f32)
    return (q, k, v, g), tokens, (np.asarray(want), [np.asarray(x) for x in pull(g)])


def run(kernel, compute, q, k, v, g, tokens):
    """``(out, (dq, dk, dv))`` of one kernel through :func:`jax_seqpar.kernels.attention`."""
    options = make_options(q, MaskSpec.make(causal=True), kernel=kernel, compute_dtype=compute)

    def loss(q, k, v):
        out, _ = kernels.attention(options, q, k, v, tokens, tokens)
        return jnp.sum(out * g), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return out, grads


def errors(result, want):
    """The output's RMSE and the gradients' relative RMSEs against ``want``."""
    (out, grads), (want_out, want_grads) = result, want
    rmse = float(np.sqrt(np.mean((np.asarray(out, np.float64) - want_out) ** 2)))
    relative = [float(np.sqrt(np.mean((np.asarray(x, np.float64) - w) ** 2) / np.mean(w ** 2)))
                for x, w in zip(grads, want_grads)]
    return rmse, relative


@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_fp8_kernel_matches_the_reference_within_fp8s_error(kernel, backward, problem):
    (q, k, v, g), tokens, want = problem
    compute = jax_seqpar.Compute(FP8, backward_dtype=BACKWARDS[backward], hadamard=False)
    assert make_options(q, MaskSpec.make(causal=True), kernel=kernel,
                        compute_dtype=compute).kernel == kernel  # not refused, not rerouted
    rmse, grads = errors(run(kernel, compute, q, k, v, g, tokens), want)
    xla_rmse, xla_grads = errors(run("xla", compute, q, k, v, g, tokens), want)
    plain_rmse, _ = errors(run(kernel, None, q, k, v, g, tokens), want)
    assert rmse <= OUT_RMSE and rmse <= OF_XLA * xla_rmse, (rmse, xla_rmse)
    assert rmse > 5 * plain_rmse, f"FP8 error {rmse} is bf16's {plain_rmse}: FP8 not applied"
    assert max(grads) <= GRAD[backward], grads
    assert max(grads) <= OF_XLA * max(xla_grads), (grads, xla_grads)


@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_the_backward_dtype_changes_only_the_gradients(kernel, problem):
    """One forward whatever the backward's dtype; the gradients differ between them (the
    backward's products are the FP8 or the bfloat16 ones, not ignored)."""
    (q, k, v, g), tokens, want = problem
    fp8 = run(kernel, UNROTATED, q, k, v, g, tokens)
    bf16 = run(kernel, jax_seqpar.Compute(FP8, backward_dtype=jnp.bfloat16, hadamard=False),
               q, k, v, g, tokens)
    np.testing.assert_array_equal(np.asarray(fp8[0]), np.asarray(bf16[0]))
    for a, b in zip(fp8[1], bf16[1]):
        assert not np.array_equal(np.asarray(a), np.asarray(b))
    assert max(errors(bf16, want)[1]) < max(errors(fp8, want)[1])


def test_auto_runs_the_pallas_fp8_kernels_and_other_backwards_are_refused():
    q = jnp.ones((1, 32, 2, 16), jnp.bfloat16)
    spec = MaskSpec.make(causal=True)
    # auto keeps its per-platform choice (Triton on GPU, Mosaic on TPU, XLA on CPU) for
    # an FP8 forward with an FP8 or bf16 backward, and the XLA kernel for the others.
    assert make_options(q, spec, compute_dtype=FP8).kernel == "auto"
    assert make_options(q, spec, compute_dtype=jax_seqpar.Compute(
        FP8, backward_dtype=jnp.bfloat16)).kernel == "auto"
    other = jax_seqpar.Compute(FP8, backward_dtype=jnp.float8_e5m2, hadamard=False)
    assert make_options(q, spec, compute_dtype=other).kernel == "xla"
    # the Triton FP8 kernels serve the head dims the compile gate measured
    assert all(pallas.compiles_clean(d, d, FP8) for d in (64, 128, 256))
    assert not any(pallas.compiles_clean(d, d, FP8) for d in (16, 32, 80, 96, 192, 512))
    assert not pallas.compiles_clean(128, 64, FP8) and not pallas.compiles_clean(576, 512, FP8)
    for kernel in ("pallas", "mosaic"):
        with pytest.raises(ValueError, match=f"kernel='{kernel}'.*same FP8 format or in "
                                             "bfloat16.*kernel='xla'"):
            make_options(q, spec, kernel=kernel, compute_dtype=other)


def test_the_global_api_runs_fp8_in_the_pallas_kernel():
    q, k, v, _ = fa3_inputs((1, 64, 2, 16))
    fp8 = jax_seqpar.sequence_parallel_attention(q, k, v, causal=True, kernel="pallas",
                                                 compute_dtype=FP8)
    exact = jax_seqpar.sequence_parallel_attention(q, k, v, causal=True, kernel="pallas")
    error = np.abs(np.asarray(fp8, np.float32) - np.asarray(exact, np.float32)).max()
    assert fp8.dtype == jnp.bfloat16 and 1e-3 < error < 0.5, error


@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_fp8_calls_accumulate_like_one_call(kernel, problem):
    """A ring's steps in FP8: the forward continued over a second run of keys
    (``accumulate``; Mosaic in the kernel, in place) is the call over both, to FP8's
    rounding of other tiles' probabilities; the backward adds ``accumulate`` (Mosaic: dq
    in the kernel)."""
    from jax_seqpar.kernels.gpu import pallas
    from jax_seqpar.kernels.tpu import mosaic

    module = {"pallas": pallas, "mosaic": mosaic}[kernel]
    (q, k, v, g), tokens, _ = problem
    options = make_options(q, MaskSpec.make(causal=True), kernel=kernel,
                           compute_dtype=UNROTATED)
    half = SEQ // 2
    keys = [jax.tree.map(lambda x, s=s: x[:, s], (k, v, tokens))
            for s in (slice(0, half), slice(half, None))]
    forward = jax.jit(lambda *a, accumulate=None: module.forward(*a, options,
                                                                 accumulate=accumulate))
    first = forward(q, *keys[0][:2], tokens, keys[0][2])
    out, lse = forward(q, *keys[1][:2], tokens, keys[1][2], accumulate=first)
    whole, whole_lse = forward(q, k, v, tokens, tokens)
    assert float(jnp.sqrt(jnp.mean((out - whole) ** 2))) < 5e-3
    np.testing.assert_allclose(lse, whole_lse, atol=2e-2)

    delta = jnp.sum(g * whole, axis=-1)
    backward = jax.jit(lambda *a, accumulate=None: module.backward(
        q, k, v, tokens, tokens, whole_lse, delta, g.astype(q.dtype), options,
        accumulate=accumulate))
    grads = backward()
    given = tuple(jnp.full(x.shape, 0.5, jnp.float32) for x in grads)
    for total, grad, earlier in zip(backward(accumulate=given), grads, given):
        np.testing.assert_allclose(total, grad + earlier, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capability, message", [
    ((8, 0), r"FP8 matrix units.*this GPU's is 8\.0"),
    ((9, 0), r"head dims in \(64, 128, 256\).*got 16 and 16")])
def test_pallas_fp8_where_triton_cannot_run_it_is_refused(monkeypatch, capability, message):
    """``kernel="pallas"`` with FP8 compute on a GPU host that the FP8 Triton kernels do
    not serve is a ``ValueError`` naming why and the alternatives, not a Triton error:
    an A100 (compute capability 8.0: no FP8 matrix unit), or an H100 at head dim 16 (not
    one of ``FP8_HEAD_DIMS``: the FP8 backward spills; at 80, 96, 192 the padded FP8 loads
    do not lower). ``"auto"`` runs the XLA kernel there; the interpreter still runs it."""
    q, k, v, _ = fa3_inputs((1, 64, 2, 16))
    tokens = Tokens(jnp.arange(64, dtype=jnp.int32)[None])
    options = make_options(q, MaskSpec.make(causal=True), kernel="pallas",
                           compute_dtype=UNROTATED)
    monkeypatch.setattr(pallas, "gpu_capability", lambda: capability)
    monkeypatch.setattr(pallas.config, "gpu_capability", lambda: capability)
    with pytest.raises(ValueError, match=r"kernel='pallas' runs the FP8 Triton kernel, which "
                                         rf".*{message}.*kernel='auto' or kernel='xla'"):
        pallas.forward(q, k, v, tokens, tokens, options, interpret=False)
    assert pallas.compiles_clean(64, 64, FP8) == (capability >= (8, 9))  # else auto: XLA
    out, _ = pallas.forward(q, k, v, tokens, tokens, options, interpret=True)
    assert out.shape == (1, 64, 2, 16)
