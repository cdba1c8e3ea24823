"""The global entry point in every context a user calls it from (tests/contexts.py).

Each strategy runs under each context, at a length the devices divide and one they do
not; causal masking and the dtypes (float32, bfloat16, float16) rotate over the cases so
that every strategy meets each (causal, dtype) pair and every context several. Out and
gradients are compared against the float32 reference, and on Explicit meshes the output
must carry the queries' sharding.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest

import contexts
import jax_seqpar as sp
from jax_seqpar import reference

B, H, HKV, D = 1, 8, 2, 8
LENGTHS = (64, 60)  # divisible by the 8 devices (and the 16 zigzag chunks); not divisible
#: strategy name -> (mesh shape, axis names, keyword arguments)
STRATEGIES = {
    "ring": ((8,), ("sp",), dict(strategy="ring")),
    "ulysses": ((8,), ("sp",), dict(strategy="ulysses")),
    "allgather": ((8,), ("sp",), dict(strategy="allgather")),
    "hybrid-2-axes": ((2, 4), ("dcn", "ici"), dict(strategy="hybrid")),
    "hybrid-1-axis": ((8,), ("sp",), dict(strategy="hybrid", ulysses_size=4)),
}
_MASK_DTYPES = list(itertools.product((True, False), (jnp.float32, jnp.bfloat16, jnp.float16)))


def _cases():
    for s, strategy in enumerate(STRATEGIES):
        for c, name in enumerate(sorted(contexts.CONTEXTS)):
            for n, seq in enumerate(LENGTHS):
                causal, dtype = _MASK_DTYPES[(2 * c + n + s) % len(_MASK_DTYPES)]
                yield pytest.param(name, strategy, seq, causal, dtype,
                                   id=f"{name}-{strategy}-S{seq}-"
                                      f"{'causal' if causal else 'full'}-{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("context_name,strategy,seq,causal,dtype", list(_cases()))
def test_every_strategy_in_every_context(context_name, strategy, seq, causal, dtype, make_qkv,
                                         tolerances):
    context = contexts.Context(context_name)
    shape, names, kwargs = STRATEGIES[strategy]
    mesh = context.mesh(shape, names)
    seq_axes = names if len(names) > 1 else names[0]
    q, k, v = make_qkv(batch=B, seq=seq, heads=H, kv_heads=HKV, head_dim=D, dtype=dtype)

    def build(mesh):
        return functools.partial(sp.sequence_parallel_attention, mesh=mesh, seq_axes=seq_axes,
                                 causal=causal, **kwargs)

    context.check(build, (q, k, v), functools.partial(reference.attention, causal=causal),
                  tolerances, mesh=mesh, seq_axes=seq_axes)
