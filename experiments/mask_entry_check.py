"""The new masks as the README runs an entry point: errors vs the reference, compilations
per call, and a jitted three-step training loop on the caller's mesh.

Run: ``python experiments/mask_entry_check.py`` (CPU, 8 emulated devices). Prints, per
mask family x strategy x dtype at S=61 (not a multiple of the 8 devices): the largest
error of the output and of the gradients against ``jax_seqpar.core.reference`` (inputs
made without a sharding, inside ``jax.set_mesh`` of an Explicit ``jax.make_mesh`` mesh,
under ``jax.jit``), the compilations of three eager calls and of three jitted calls
(the second and third must compile nothing), then a Flax ``SelfAttention`` with a
prefix-LM mask trained three jitted steps with the model made before ``set_mesh``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import dispatch  # noqa: E402

import jax_seqpar  # noqa: E402
from jax_seqpar.core import reference  # noqa: E402

S, H, D = 61, 8, 16


def _hidden_every_third(q, kv):
    return (q.positions - kv.positions) % 3 != 1


def families(seq):
    docs = (np.arange(seq) >= seq // 2).astype(np.int32)[None]
    start = np.where(docs[0] == 0, 0, seq // 2)
    prompts = np.where(np.arange(seq) - start < 8, docs + 1, 0).astype(np.int32)
    images = np.zeros((1, seq), np.int32)
    images[:, 10:25] = 3
    return {"chunked": dict(chunk_size=20),
            "prefix_lm": dict(segment_ids=jnp.asarray(docs), bidirectional_ids=jnp.asarray(prompts)),
            "vlm": dict(bidirectional_ids=jnp.asarray(images)),
            "mask_fn": dict(mask_fn=_hidden_every_third)}


class Compiles:
    def __enter__(self):
        self.count = 0
        self._listen = lambda event, duration, **_: setattr(
            self, "count", self.count + (event == dispatch.BACKEND_COMPILE_EVENT))
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *_):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def main():
    mesh = jax.make_mesh((8,), ("sp",))
    keys = jax.random.split(jax.random.key(0), 3)
    print(f"{'family':10} {'strategy':9} {'dtype':8} {'err out':>9} {'err grad':>9} "
          f"{'eager compiles':>15} {'jit compiles':>13}")
    for name, mask in families(S).items():
        for strategy in ("ring", "ulysses", "allgather", "hybrid"):
            for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
                q, k, v = (jax.random.normal(key, (1, S, H, D), dtype) for key in keys)

                def loss(q, k, v, attend):
                    return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

                ours = lambda q, k, v: jax_seqpar.sequence_parallel_attention(  # noqa: E731
                    q, k, v, mesh=mesh, strategy=strategy, causal=True, **mask,
                    **({"ulysses_size": 2} if strategy == "hybrid" else {}))
                ref = lambda q, k, v: reference.attention(q, k, v, causal=True, **mask)  # noqa
                step = jax.jit(jax.value_and_grad(lambda *a: loss(*a, ours), (0, 1, 2)))
                with jax.set_mesh(mesh):
                    with Compiles() as eager:
                        counts_eager = []
                        for _ in range(3):
                            before = eager.count
                            out = ours(q, k, v)
                            counts_eager.append(eager.count - before)
                    with Compiles() as jitted:
                        counts_jit = []
                        for _ in range(3):
                            before = jitted.count
                            _, grads = step(q, k, v)
                            counts_jit.append(jitted.count - before)
                up = [x.astype(jnp.float32) for x in (q, k, v)]
                want = ref(*up)
                want_grads = jax.grad(lambda *a: loss(*a, ref), (0, 1, 2))(*up)
                err_out = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
                err_grad = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
                               for g, w in zip(grads, want_grads))
                print(f"{name:10} {strategy:9} {jnp.dtype(dtype).name:8} {err_out:9.2e} "
                      f"{err_grad:9.2e} {str(counts_eager):>15} {str(counts_jit):>13}")
    _train_three_steps(mesh)


def _train_three_steps(mesh):
    from flax import nnx
    import optax
    from jax_seqpar.flax import SelfAttention

    model = SelfAttention(32, 4, num_kv_heads=2, mesh=mesh, causal=True, chunk_size=24,
                          rngs=nnx.Rngs(0))  # made before set_mesh
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (2, S, 32))
    prompts = jnp.asarray(np.where(np.arange(S) < 10, 1, 0)[None].repeat(2, 0), jnp.int32)

    @nnx.jit
    def train_step(model, optimizer, x, prompts):
        def loss(model):
            return jnp.mean(model(x, bidirectional_ids=prompts) ** 2)
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    with jax.set_mesh(mesh):
        with Compiles() as compiles:
            counts, losses = [], []
            for _ in range(3):
                before = compiles.count
                losses.append(float(train_step(model, optimizer, x, prompts)))
                counts.append(compiles.count - before)
    meshes = {str(getattr(jax.typeof(p).sharding, "mesh", None).shape_tuple)
              for p in jax.tree.leaves(nnx.state(model))
              if getattr(jax.typeof(p).sharding, "mesh", None) is not None}
    print(f"Flax SelfAttention (chunk_size=24, prefix bidirectional ids), 3 jitted steps: "
          f"losses {['%.5f' % l for l in losses]}, compiles per step {counts}, "
          f"parameter meshes {sorted(meshes)} (caller's: {mesh.shape_tuple})")


if __name__ == "__main__":
    main()
