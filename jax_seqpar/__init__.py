"""jax_seqpar: sequence (context) parallel exact attention for JAX.

The global-view entry points, :func:`sequence_parallel_attention` and the
``jax.nn``-compatible :func:`dot_product_attention`; inference against a
sequence-sharded KV cache (:func:`prefill`, :func:`decode`, :class:`KVCache`, made by
``KVCache.create``); the per-shard strategies, called inside ``jax.shard_map``
(Ulysses, ring, hybrid: Ulysses inside x ring across, all-gather, and sharded-cache
decode); a batch put into a token order once (:func:`permute_batch`,
:func:`unpermute_batch`) and the positions of each order; the kernels' tiles
(:class:`BlockSizes`) and the bytes a strategy sends (:func:`comm_bytes`).

The other layout helpers live in :mod:`jax_seqpar.core.layout` (``zigzag_permute`` /
``zigzag_unpermute``, ``striped_permute`` / ``striped_unpermute`` on global arrays;
``to_zigzag``, ``from_zigzag``, ``shard_positions``, ... inside ``shard_map``); the
planner in :mod:`jax_seqpar.planning.plan`.

The package is layered (``docs/design.md`` §2): ``core`` → ``kernels`` →
``strategies`` → ``planning`` → ``api`` → ``flax``, ``examples`` → ``tools``; each
imports only the layers before it. Nothing runs at import beyond these imports.
"""

from jax_seqpar.api.attention import sequence_parallel_attention as sequence_parallel_attention
from jax_seqpar.api.dot_product import dot_product_attention as dot_product_attention
from jax_seqpar.api.inference import decode as decode
from jax_seqpar.api.inference import prefill as prefill
from jax_seqpar.api.kv_cache import KVCache as KVCache
from jax_seqpar.core.batch_layout import permute_batch as permute_batch
from jax_seqpar.core.batch_layout import unpermute_batch as unpermute_batch
from jax_seqpar.core.layout import contiguous_positions as contiguous_positions
from jax_seqpar.core.quant import Compute as Compute
from jax_seqpar.core.layout import striped_positions as striped_positions
from jax_seqpar.core.layout import zigzag_positions as zigzag_positions
from jax_seqpar.core.work import work_per_shard as work_per_shard
from jax_seqpar.kernels.contract import BlockSizes as BlockSizes
from jax_seqpar.strategies.allgather import allgather_attention as allgather_attention
from jax_seqpar.strategies.decode import decode_attention as decode_attention
from jax_seqpar.strategies.hybrid import hybrid_attention as hybrid_attention
from jax_seqpar.strategies.ring import ring_attention as ring_attention
from jax_seqpar.strategies.registry import comm_bytes as comm_bytes
from jax_seqpar.strategies.ulysses import ulysses_attention as ulysses_attention

__all__ = [
    "BlockSizes",
    "Compute",
    "KVCache",
    "allgather_attention",
    "comm_bytes",
    "contiguous_positions",
    "decode",
    "decode_attention",
    "dot_product_attention",
    "hybrid_attention",
    "permute_batch",
    "prefill",
    "ring_attention",
    "sequence_parallel_attention",
    "striped_positions",
    "ulysses_attention",
    "unpermute_batch",
    "work_per_shard",
    "zigzag_positions",
]
