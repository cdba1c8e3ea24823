"""The error of ``compute_dtype=`` against a float64 oracle (issue 42), per variant, strategy
and device count: FlashAttention-3's benchmark distribution (entries N(0, 1), 0.1 % of them
with a 10x larger standard deviation), B=1, S=1024 (``S=`` in the environment), H=8, D=64,
causal, bfloat16 inputs; the output's RMSE, and the gradients' RMSE relative to the
oracle's RMS (``loss = sum(out * g)``, ``g`` a fixed N(0, 1) cotangent).

P=1 is the local call (no mesh); P=8 every strategy on the 8-device CPU mesh (the hybrid
with 4-way Ulysses inside). FP8 is emulated on CPU (values in FP8, products and sums in
float32): the numbers are the format's, not a speed.

Run: ``JAX_PLATFORMS=cpu python experiments/fp8_error.py``
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import jax.numpy as jnp
import numpy as np

import jax_seqpar as sp

B, S, H, D = 1, int(os.environ.get("S", 1024)), 8, 64
VARIANTS = {
    "bf16 (the inputs' dtype)": None,
    "e4m3, per-block + Hadamard (default)": jnp.float8_e4m3fn,
    "e4m3, per-block": sp.Compute(jnp.float8_e4m3fn, hadamard=False),
    "e4m3 forward, bf16 backward": sp.Compute(jnp.float8_e4m3fn, backward_dtype=jnp.bfloat16),
    "e5m2, per-block + Hadamard": jnp.float8_e5m2,
}
STRATEGIES = {"P=1 local": None, "P=8 ring": "ring", "P=8 ulysses": "ulysses",
              "P=8 allgather": "allgather", "P=8 hybrid": "hybrid"}


def fa3_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)

    def draw():
        x = rng.standard_normal((B, S, H, D))
        x[rng.random(x.shape) < 0.001] *= 10
        return x

    return [draw() for _ in range(4)]  # q, k, v, the cotangent


def oracle(q, k, v, g):
    """float64 causal attention and the gradients of ``sum(out * g)``."""
    with jax.enable_x64(True):
        def attention(q, k, v):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
            s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        out = attention(*args)
        grads = jax.grad(lambda *a: jnp.sum(attention(*a) * g), argnums=(0, 1, 2))(*args)
        return np.asarray(out), [np.asarray(x) for x in grads]


def errors(q, k, v, g, want, want_grads, strategy, compute_dtype, mesh):
    keywords = dict(causal=True, compute_dtype=compute_dtype)
    if strategy is not None:
        keywords.update(mesh=mesh, strategy=strategy, seq_axes="sp")
        if strategy == "hybrid":
            keywords["ulysses_size"] = 4

    def call(q, k, v):
        return sp.sequence_parallel_attention(q, k, v, **keywords)

    out = jax.jit(call)(q, k, v)
    cotangent = jnp.asarray(g, jnp.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(call(*a).astype(jnp.float32) * cotangent),
                             argnums=(0, 1, 2)))(q, k, v)
    rmse = float(np.sqrt(np.mean((np.asarray(out, np.float64) - want) ** 2)))
    relative = [float(np.sqrt(np.mean((np.asarray(x, np.float64) - w) ** 2))
                      / np.sqrt(np.mean(w ** 2))) for x, w in zip(grads, want_grads)]
    return rmse, relative


def main():
    q, k, v, g = fa3_inputs()
    q16, k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    # The oracle sees the inputs as the call does (rounded to bf16).
    want, want_grads = oracle(*(np.asarray(x, np.float64) for x in (q16, k16, v16)), g)
    mesh = jax.make_mesh((8,), ("sp",))
    print(f"B={B}, S={S}, H={H}, D={D}, causal, bf16 inputs (FA3's distribution); output RMSE "
          "against float64; gradients: RMSE / RMS of the float64 gradient (dq, dk, dv)")
    print("| variant | strategy | out RMSE | dq | dk | dv |")
    print("|---|---|---|---|---|---|")
    for name, compute_dtype in VARIANTS.items():
        for label, strategy in STRATEGIES.items():
            rmse, (dq, dk, dv) = errors(q16, k16, v16, g, want, want_grads, strategy,
                                        compute_dtype, mesh)
            print(f"| {name} | {label} | {rmse:.3e} | {dq:.3e} | {dk:.3e} | {dv:.3e} |",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
