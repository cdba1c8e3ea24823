"""jax_seqpar: sequence (context) parallel exact attention for JAX.

Strategies (per-shard functions, called inside ``jax.shard_map``): Ulysses,
ring, hybrid (Ulysses inside x ring across), all-gather and sharded-cache decode;
and the global-view entry points, :func:`sequence_parallel_attention` and the
``jax.nn``-compatible :func:`dot_product_attention`.

The package is layered (``docs/design.md`` §2): ``core`` → ``kernels`` →
``strategies`` → ``planning`` → ``api`` → ``flax``, ``examples`` → ``tools``; each
imports only the layers before it. Module paths from before the layers
(``jax_seqpar.plan``, ``jax_seqpar.layout``, ...) still import (``jax_seqpar._moved``).
"""

from jax_seqpar import _moved

from jax_seqpar.api.attention import sequence_parallel_attention as sequence_parallel_attention
from jax_seqpar.api.dot_product import dot_product_attention as dot_product_attention
from jax_seqpar.core.batch_layout import permute_batch as permute_batch
from jax_seqpar.core.batch_layout import unpermute_batch as unpermute_batch
from jax_seqpar.core.layout import contiguous_positions as contiguous_positions
from jax_seqpar.core.layout import striped_permute as striped_permute
from jax_seqpar.core.layout import striped_positions as striped_positions
from jax_seqpar.core.layout import striped_unpermute as striped_unpermute
from jax_seqpar.core.layout import zigzag_permute as zigzag_permute
from jax_seqpar.core.layout import zigzag_positions as zigzag_positions
from jax_seqpar.core.layout import zigzag_unpermute as zigzag_unpermute
from jax_seqpar.core.work import work_per_shard as work_per_shard
from jax_seqpar.strategies.allgather import allgather_attention as allgather_attention
from jax_seqpar.strategies.decode import decode_attention as decode_attention
from jax_seqpar.strategies.hybrid import hybrid_attention as hybrid_attention
from jax_seqpar.strategies.ring import ring_attention as ring_attention
from jax_seqpar.strategies.registry import comm_bytes as comm_bytes
from jax_seqpar.strategies.ulysses import ulysses_attention as ulysses_attention

_moved.install()
