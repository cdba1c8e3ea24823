"""``dot_product_attention``: the arguments and results of ``jax.nn.dot_product_attention``.

A user swaps one call: the same ``BTNH`` layout, GQA, ``is_causal``,
``local_window_size``, padding by ``query_seq_lengths`` / ``key_value_seq_lengths``
and ``scale``. Without a mesh it runs our blockwise kernel locally (any query and
key lengths); with a mesh it is :func:`jax_seqpar.sequence_parallel_attention`
over the mesh's sequence axes.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

from jax_seqpar._inputs import Options, check_qkv
from jax_seqpar.api import sequence_parallel_attention
from jax_seqpar.masks import Tokens


def _lengths(name: str, lengths, batch: int):
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int32 [batch]=({batch},) array. "
                         f"Got {lengths.dtype}{list(lengths.shape)}.")
    return lengths.astype(jnp.int32)


def _valid(lengths, batch: int, seq: int):
    """``bool[B, seq]``: token ``i`` of row ``b`` is real (``i < lengths[b]``)."""
    arange = jnp.arange(seq, dtype=jnp.int32)
    if lengths is None:
        return jnp.ones((batch, seq), bool)
    return arange[None, :] < lengths[:, None]


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths: Optional[jax.Array] = None,
    key_value_seq_lengths: Optional[jax.Array] = None,
    local_window_size: Union[None, int, tuple[int, int]] = None,
    implementation: Optional[str] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
    seq_axes: Union[str, tuple] = "sp",
    strategy: str = "auto",
    layout: str = "auto",
    kernel: str = "auto",
    block_sizes=None,
) -> jax.Array:
    """Scaled dot-product attention, exact, sequence-parallel over ``mesh`` when given.

    Semantics are those of ``jax.nn.dot_product_attention``: ``query`` token ``i``
    sees key ``j`` when ``j <= i`` (``is_causal``), ``i - left <= j <= i + right``
    (``local_window_size``), ``j < key_value_seq_lengths[b]``; rows
    ``i >= query_seq_lengths[b]`` are zeros. One difference: a real query that sees
    no key at all returns zeros (``jax.nn``'s XLA path returns the mean of every
    value there).

    Args:
      query: ``[B, T, N, H]`` (or ``[T, N, H]``).
      key: ``[B, S, K, H]``; value: ``[B, S, K, Hv]`` (``N % K == 0``: MHA, GQA, MQA).
      bias, mask: dense ``[B, N, T, S]`` additive bias / boolean mask. Without a mesh
        the call is handed to ``jax.nn.dot_product_attention`` unchanged; with a mesh
        they are refused (see Raises).
      scale: logit scale; default ``1/sqrt(H)``.
      is_causal: causal mask (top-left aligned, as in ``jax.nn``).
      query_seq_lengths, key_value_seq_lengths: ``int32[B]`` valid lengths (padding).
      local_window_size: ``int`` (both sides) or ``(left, right)``.
      implementation: ``None`` for ours; a ``jax.nn`` implementation name
        (``"xla"``, ``"cudnn"``) hands the call to ``jax.nn`` (without a mesh only).
      mesh: a device mesh to split the sequence over, or ``None`` (local kernel).
      seq_axes, strategy, layout, kernel, block_sizes: as in
        :func:`jax_seqpar.sequence_parallel_attention` (``kernel`` and
        ``block_sizes`` also apply without a mesh).

    Returns:
      ``[B, T, N, Hv]`` (or ``[T, N, Hv]``) in ``query.dtype``.

    Raises:
      ValueError: bad shapes or lengths; with a mesh: a dense ``bias``/``mask`` (an
        ``[S, S]`` input needs every device to hold whole rows of scores, which is
        what sequence parallelism avoids: express the mask with ``is_causal``,
        ``local_window_size`` and the sequence lengths, or packed documents with
        ``sequence_parallel_attention(segment_ids=)``), query and key lengths that
        differ, or an ``implementation``.

    >>> out = dot_product_attention(q, k, v, is_causal=True, mesh=jax.make_mesh((8,), ("sp",)))
    """
    if query.ndim == 3:
        return dot_product_attention(
            query[None], key[None], value[None],
            None if bias is None else jnp.asarray(bias)[None] if jnp.ndim(bias) == 3 else bias,
            None if mask is None else jnp.asarray(mask)[None] if jnp.ndim(mask) == 3 else mask,
            scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
            implementation=implementation, mesh=mesh, seq_axes=seq_axes, strategy=strategy,
            layout=layout, kernel=kernel, block_sizes=block_sizes)[0]
    check_qkv(query, key, value)
    batch, q_len = query.shape[:2]
    kv_len = key.shape[1]
    dense = {name: x for name, x in (("bias", bias), ("mask", mask)) if x is not None}
    if mesh is None and (dense or implementation is not None):
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation)
    if mesh is not None:
        for name, x in dense.items():
            raise ValueError(
                f"a dense {name} of shape {tuple(jnp.shape(x))} cannot be sequence-parallel: "
                "it holds a score for every (query, key) pair, so each device would need "
                "whole [T, S] rows, which is what splitting the sequence avoids. Express the "
                "mask with is_causal=, local_window_size= and the sequence lengths (or packed "
                "documents with jax_seqpar.sequence_parallel_attention(segment_ids=)), or "
                "call without mesh= to attend locally.")
        if implementation is not None:
            raise ValueError(f"implementation={implementation!r} names a jax.nn kernel, which "
                             "cannot run sequence-parallel; drop it (use kernel=) or mesh=.")
        if q_len != kv_len:
            raise ValueError(f"with a mesh, query and key/value split ONE sequence: got query "
                             f"length {q_len} and key/value length {kv_len}. Call without "
                             "mesh= for attention between two sequences.")
    q_lengths = _lengths("query_seq_lengths", query_seq_lengths, batch)
    kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
    q_segments = kv_segments = None
    if q_lengths is not None or kv_lengths is not None:
        # Keys past their row's length get a segment no query has.
        q_segments = jnp.zeros((batch, q_len), jnp.int32)
        kv_segments = jnp.where(_valid(kv_lengths, batch, kv_len), 0, 1).astype(jnp.int32)
    if mesh is not None:
        out = sequence_parallel_attention(
            query, key, value, mesh=mesh, seq_axes=seq_axes, strategy=strategy,
            causal=is_causal, segment_ids=q_segments, kv_segment_ids=kv_segments,
            window=local_window_size, scale=scale, layout=layout, kernel=kernel,
            block_sizes=block_sizes)
    else:
        arange = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
        options = Options.make(query, causal=is_causal, window=local_window_size, scale=scale,
                               kernel=kernel, block_sizes=block_sizes)
        out, _ = options.attention(query, key, value, Tokens(arange(q_len), q_segments),
                                   Tokens(arange(kv_len), kv_segments))  # float32
    if q_lengths is not None:
        out = jnp.where(_valid(q_lengths, batch, q_len)[:, :, None, None], out, 0)
    return out.astype(query.dtype)  # [B, T, N, Hv]
