"""bf16 gradients keep their precision at any P: every strategy against a float64 oracle.

What crosses devices in a backward (the ring's and the all-gather's dK/dV
accumulators, the gradient of a window's halo sent back) is carried and summed in
float32 and cast once at the end, so the gradient error of a bf16 call does not grow
with the number of devices: at P=8 it stays within 1.25x of the same global call on a
one-device mesh (P=1). The oracle is numpy float64 on the same bf16 inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_seqpar as sp
from contexts import make_mesh

#: Big enough that bf16 dK/dV accumulators show (rounded at every hop, the all-gather's
#: P=8 error was 2.9x (dk) and 4.8x (dv) P=1's), small enough that compiling dominates
#: (about 7 s a call on 2 CPU cores). H=8 lets Ulysses run at P=8.
SHAPE = dict(batch=1, seq_len=256, num_heads=8, head_dim=32)
#: Every strategy (:func:`call_for`): the two-axis hybrid on a (P/I, I) mesh and the
#: hybrid that splits one axis in two (``ulysses_size``), I = max(1, P/2).
STRATEGIES = ("ring", "ulysses", "allgather", "hybrid", "hybrid-split")
#: The largest P=8 / P=1 error ratio allowed, for dq, dk and dv alike.
GROWTH = 1.25


def inputs(batch, seq_len, num_heads, head_dim, num_kv_heads=None, seed=0):
    """bf16 ``(q, k, v, dout)``, ``[B, S, H|Hkv, D]``, drawn on the host."""
    rng = np.random.default_rng(seed)
    heads = (num_heads, num_kv_heads or num_heads, num_kv_heads or num_heads, num_heads)
    return tuple(jnp.asarray(rng.standard_normal((batch, seq_len, h, head_dim), np.float32),
                             jnp.bfloat16) for h in heads)


def oracle(q, k, v, dout, *, window=None):
    """float64 ``(dq, dk, dv)`` of causal softmax attention (numpy, the inputs' exact
    values); ``window=(left, 0)``: a query sees the ``left`` keys before it too."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]  # GQA: each K/V head serves `group` query heads
    k, v = (np.repeat(x, group, axis=2) for x in (k, v))
    scale = q.shape[-1] ** -0.5
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    distance = np.arange(s.shape[-2])[:, None] - np.arange(s.shape[-1])  # query - key
    visible = (distance >= 0) & (window is None or distance <= window[0])
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [B, H, S, S]
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, v)
    rows = np.einsum("bqhd,bqhd->bhq", dout, out)[..., None]
    ds = p * (dp - rows) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q)
    return (np.einsum("bhqk,bkhd->bqhd", ds, k),
            *(x.reshape(*x.shape[:2], -1, group, x.shape[-1]).sum(3) for x in (dk, dv)))


def call_for(strategy: str, devices: int):
    """``(mesh, keyword arguments)`` of ``strategy`` on the first ``devices`` devices."""
    inner = max(1, devices // 2)
    if strategy == "hybrid":
        return (make_mesh((devices // inner, inner), ("dcn", "ici")),
                dict(strategy="hybrid", seq_axes=("dcn", "ici")))
    if strategy == "hybrid-split":
        return make_mesh((devices,), ("sp",)), dict(strategy="hybrid", ulysses_size=inner)
    return make_mesh((devices,), ("sp",)), dict(strategy=strategy)


def gradients(strategy: str, devices: int, q, k, v, dout, *, window=None):
    """bf16 ``(dq, dk, dv)`` of ``<attention(q, k, v), dout>``: the README's context (an
    Explicit mesh inside ``jax.set_mesh``, unsharded inputs, ``jax.jit`` of ``jax.grad``)."""
    mesh, kwargs = call_for(strategy, devices)

    def loss(q, k, v):
        out = sp.sequence_parallel_attention(q, k, v, mesh=mesh, causal=True, window=window,
                                             **kwargs)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def errors(strategy: str, devices: int, args, expected, *, window=None):
    """Max abs error of ``(dq, dk, dv)`` against the float64 ``expected``."""
    got = gradients(strategy, devices, *args, window=window)
    return tuple(float(np.max(np.abs(np.asarray(g, np.float64) - e)))
                 for g, e in zip(got, expected))


@functools.cache
def _case(window=None, kv_heads=None):
    args = inputs(**SHAPE, num_kv_heads=kv_heads)
    return args, oracle(*args, window=window)


#: A causal sliding window reaching 100 tokens back: at P=8 (32 tokens a device) the
#: windowed ring and all-gather exchange a halo of 4 hops, their gradients sent back.
WINDOW = (100, 0)


def _tier(strategy, window):
    # The all-gather's backward is the one that rounded what it sent (its dK/dV at every
    # hop, its halo's gradient): in the default tier. The others (about 15 s of compiles
    # each on 2 cores) run in the matrix tier.
    marks = () if strategy == "allgather" else pytest.mark.matrix
    return pytest.param(strategy, window, marks=marks,
                        id=strategy + ("-window" if window else ""))


@pytest.mark.parametrize("strategy, window", [_tier(s, None) for s in STRATEGIES]
                         + [_tier(s, WINDOW) for s in ("allgather", "ring")])
def test_bf16_gradient_error_is_flat_in_p(strategy, window):
    _check_flat(strategy, window=window)


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", [
    "ring", "allgather",
    # Ulysses replicates a K/V head for every device that needs it; the replicas' dK/dV
    # come back and sum in float32.
    "ulysses",
    # Known: the hybrid's ring rounds each replica's dK/dV to bf16 on its last hop home
    # (its stage's primal dtype) before they travel back in float32: 1.26x P=1's dv
    # error at 2 x 4 with one K/V head (dk flat).
    pytest.param("hybrid", marks=pytest.mark.xfail(strict=True, reason="ring's bf16 dK/dV"))])
def test_bf16_gradient_error_is_flat_in_p_with_one_kv_head(strategy):
    _check_flat(strategy, kv_heads=1)


def _check_flat(strategy, window=None, kv_heads=None):
    args, expected = _case(window, kv_heads)
    one = errors(strategy, 1, args, expected, window=window)
    eight = errors(strategy, 8, args, expected, window=window)
    for name, at_one, at_eight in zip(("dq", "dk", "dv"), one, eight):
        assert at_eight <= GROWTH * at_one, (strategy, window, name, at_one, at_eight)
