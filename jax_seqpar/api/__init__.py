"""Layer 4, ``api``: what users call on global arrays. :mod:`.attention` (the
global entry point), :mod:`.dot_product` (``jax.nn``-compatible), :mod:`.inference`
(a sequence-sharded KV cache), and :mod:`.placement` (shardings and padding)."""

from jax_seqpar.api.attention import sequence_parallel_attention as sequence_parallel_attention

__all__ = ["sequence_parallel_attention"]
