"""jax_seqpar: sequence (context) parallel exact attention for JAX.

Strategies (per-shard functions, called inside ``jax.shard_map``): Ulysses,
ring, hybrid (Ulysses inside x ring across), all-gather and sharded-cache decode;
and one global-view entry point, :func:`sequence_parallel_attention`.
"""

from jax_seqpar.allgather import allgather_attention as allgather_attention
from jax_seqpar.api import sequence_parallel_attention as sequence_parallel_attention
from jax_seqpar.batch_layout import permute_batch as permute_batch
from jax_seqpar.batch_layout import unpermute_batch as unpermute_batch
from jax_seqpar.decode import decode_attention as decode_attention
from jax_seqpar.dot_product import dot_product_attention as dot_product_attention
from jax_seqpar.hybrid import hybrid_attention as hybrid_attention
from jax_seqpar.layout import contiguous_positions as contiguous_positions
from jax_seqpar.layout import striped_permute as striped_permute
from jax_seqpar.layout import striped_positions as striped_positions
from jax_seqpar.layout import striped_unpermute as striped_unpermute
from jax_seqpar.layout import zigzag_permute as zigzag_permute
from jax_seqpar.layout import zigzag_positions as zigzag_positions
from jax_seqpar.layout import zigzag_unpermute as zigzag_unpermute
from jax_seqpar.plan import comm_bytes as comm_bytes
from jax_seqpar.ring import ring_attention as ring_attention
from jax_seqpar.ulysses import ulysses_attention as ulysses_attention
