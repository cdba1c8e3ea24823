"""The ring's schedules as GPUs and TPUs run them, checked on CPU.

The ring's backward picks its schedule by the platform a program is lowered for
(``jax.lax.platform_dependent``): on CPU each step accumulates into the dK/dV that
arrived; on GPU and TPU each step computes fresh dK/dV while the accumulator is in flight
(the transfers and the kernel pass one ``optimization_barrier``). Its hops
(:func:`jax_seqpar.strategies.ring.shift`) travel as one byte buffer on GPU. The compile
gate compiles these branches for its targets but never runs them; here they run on CPU,
chosen by hand, against the reference: outputs and gradients.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from checks import assert_matches, normals, segments
from jax_seqpar import sequence_parallel_attention
from jax_seqpar.core import reference


def _take_the_accelerator_branch(monkeypatch, platform="default"):
    """``platform_dependent`` takes the GPU/TPU branch (``default``; ``"cuda"`` where a
    call has one) on CPU too; JAX's caches are cleared so that nothing traced before
    (the backward of a ``custom_vjp`` is traced once per shape) is reused."""
    def default_branch(*args, default, **branches):
        return branches.get(platform, default)(*args)

    jax.clear_caches()
    monkeypatch.setattr(jax.lax, "platform_dependent", default_branch)


@pytest.fixture
def accelerator_schedule(monkeypatch):
    _take_the_accelerator_branch(monkeypatch)
    yield
    monkeypatch.undo()
    jax.clear_caches()  # later tests trace the CPU branch again


@pytest.mark.parametrize("causal, with_segments", [(True, False), (False, True)])
def test_ring_backward_accelerator_schedule(accelerator_schedule, causal, with_segments,
                                            tolerances):
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = normals([(2, 64, 4, 8), (2, 64, 2, 8), (2, 64, 2, 8)])
    ids = segments(2, 64) if with_segments else None
    ours = functools.partial(sequence_parallel_attention, mesh=mesh, strategy="ring",
                             causal=causal, segment_ids=ids)
    theirs = functools.partial(reference.attention, causal=causal, segment_ids=ids)
    with jax.set_mesh(mesh):
        assert_matches(ours, theirs, (q, k, v), tolerances)


@pytest.fixture
def gpu_schedule(monkeypatch):
    _take_the_accelerator_branch(monkeypatch, "cuda")
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("strategy, extra", [
    ("ring", dict(causal=True)),
    ("allgather", dict(causal=False, segments=True, pieces=4)),
    ("hybrid", dict(causal=True, segments=True, ulysses_size=2, pieces=2)),
])
def test_gpu_schedule_packed_hops(gpu_schedule, strategy, extra, tolerances):
    """The GPU branch: every hop's arrays (K, V and positions; K/V with the dK/dV
    accumulator; dK/dV home) in one byte buffer, unpacked on arrival, in bf16 (two-byte
    arrays beside four-byte ones); the all-gather's pieces merged after their barrier."""
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = normals([(1, 64, 4, 8), (1, 64, 2, 8), (1, 64, 2, 8)], dtype=jnp.bfloat16)
    extra = dict(extra)
    ids = segments(1, 64) if extra.pop("segments", False) else None
    ours = functools.partial(sequence_parallel_attention, mesh=mesh, strategy=strategy,
                             segment_ids=ids, kernel="xla", **extra)  # the GPU's kernels
    # need a GPU: the XLA kernel, whatever the platform
    for key in ("ulysses_size", "pieces"):
        extra.pop(key, None)
    theirs = functools.partial(reference.attention, segment_ids=ids, **extra)
    with jax.set_mesh(mesh):
        assert_matches(ours, theirs, (q, k, v), tolerances)


def test_the_accelerator_branch_is_what_runs(monkeypatch):
    """With the branch taken by hand, the lowered training step holds the accelerator
    schedule's barriers (more than the CPU schedule's)."""
    mesh = jax.make_mesh((8,), ("sp",))
    q, k, v = normals([(1, 64, 2, 8)] * 3)

    def loss(q, k, v):
        out = sequence_parallel_attention(q, k, v, mesh=mesh, strategy="ring", causal=True)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    def barriers():
        with jax.set_mesh(mesh):
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
        return text.count("optimization_barrier")

    on_cpu = barriers()
    _take_the_accelerator_branch(monkeypatch)
    try:
        assert barriers() > on_cpu
    finally:
        monkeypatch.undo()
        jax.clear_caches()
