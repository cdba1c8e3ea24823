"""Attention on the caller's devices, no sequence split: the one local path.

Every entry point that runs without a mesh (``sequence_parallel_attention(mesh=None)``,
``dot_product_attention`` without ``mesh=``, the Flax ``attention_fn`` with
``mesh=None``) comes here: the same kernels, masks and sinks as the strategies, on
whole arrays (the blockwise kernel, memory O(block), never the dense reference).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jax_seqpar._inputs import Options, check_ids, check_qkv
from jax_seqpar.masks import Tokens
from jax_seqpar.merge import check_sinks, with_sinks


def _tokens(name: str, positions, segment_ids, batch: int, length: int) -> Tokens:
    check_ids(f"{name}positions", positions, batch, length)
    check_ids(f"{name}segment_ids", segment_ids, batch, length)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return Tokens(positions.astype(jnp.int32),
                  None if segment_ids is None else segment_ids.astype(jnp.int32))


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    segment_ids: Optional[jax.Array] = None,
                    kv_segment_ids: Optional[jax.Array] = None,
                    positions: Optional[jax.Array] = None,
                    kv_positions: Optional[jax.Array] = None, window=None,
                    scale: Optional[float] = None, kernel: str = "auto", block_sizes=None,
                    softcap: Optional[float] = None, sinks: Optional[jax.Array] = None,
                    return_lse: bool = False):
    """Exact attention of ``q`` against ``k, v`` on whole arrays (queries and keys may
    differ in length).

    Args:
      q: ``[B, T, H, Dqk]``; k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` (one dtype).
      causal, window: the mask on token positions (see ``masks.MaskSpec``).
      segment_ids: ``int32[B, T]`` the queries' documents, or None.
      kv_segment_ids: ``int32[B, S]`` the keys' documents, or None (``segment_ids``
        when ``T == S``).
      positions: ``int32[B, T]`` the queries' positions (default ``arange(T)``);
        kv_positions: ``int32[B, S]`` the keys' (default ``arange(S)``).
      scale, kernel, block_sizes, softcap, sinks: as in
        :func:`jax_seqpar.sequence_parallel_attention`.
      return_lse: also return the ``float32[B, T, H]`` log-sum-exp (sinks included).

    Returns:
      ``[B, T, H, Dv]`` in ``q.dtype`` (softmax in float32); with ``return_lse``,
      ``(out, lse)``. A query that sees no key gets zeros.
    """
    check_qkv(q, k, v)
    batch, q_len, heads = q.shape[:3]
    kv_len = k.shape[1]
    if kv_segment_ids is None and segment_ids is not None:
        if q_len != kv_len:
            raise ValueError(f"segment_ids of {q_len} queries cannot serve {kv_len} keys; "
                             "pass kv_segment_ids= for the keys.")
        kv_segment_ids = segment_ids
    if segment_ids is None and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids needs segment_ids for the queries too (a query "
                         "sees a key when their segment ids are equal).")
    q_tokens = _tokens("", positions, segment_ids, batch, q_len)
    kv_tokens = _tokens("kv_", kv_positions, kv_segment_ids, batch, kv_len)
    check_sinks(sinks, heads)
    options = Options.make(q, causal=causal, window=window, scale=scale, kernel=kernel,
                           block_sizes=block_sizes, softcap=softcap)
    out, lse = options.attention(q, k, v, q_tokens, kv_tokens)  # f32 [B, T, H, Dv], [B, T, H]
    out, lse = with_sinks(out, lse, sinks)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out
