"""Layer 0, ``core``: data and math that know no kernel and no mesh.

One attention layer's shape (:mod:`.shape`: the record the traffic model, the planner,
tuning and the benchmarks share), masks from per-token metadata (:mod:`.masks`), the
online-softmax merge (:mod:`.merge`), token orders (:mod:`.layout`,
:mod:`.batch_layout`), the plain-jnp oracle (:mod:`.reference`), mesh splitting
(:mod:`.meshes`), the public boundary's argument checks (:mod:`.checks`), JAX-version
shims (:mod:`.compat`) and optional dependencies (:mod:`.extras`).
"""

__all__: list[str] = []
