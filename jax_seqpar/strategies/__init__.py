"""Layer 2, ``strategies``: per-shard attention over a named mesh axis (inside
``jax.shard_map``), one strategy per module, the local (no-mesh) path, and what each
strategy sends (:mod:`.traffic`). Strategies reach kernels only through
:class:`~jax_seqpar.kernels.options.Options`."""

__all__: list[str] = []
