"""Layer 2, ``strategies``: per-shard attention over a named mesh axis (inside
``jax.shard_map``), one strategy per module (its per-shard function, its model and its
:class:`~jax_seqpar.strategies.entry.Strategy` entry, listed by :mod:`.registry`), the
local (no-mesh) path, and the bytes model's shared rules (:mod:`.traffic`). Strategies
reach kernels only through :class:`~jax_seqpar.kernels.options.Options`."""

__all__: list[str] = []
