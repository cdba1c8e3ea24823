"""An ``attention_fn`` for Flax's multi-head attention layers, backed by jax_seqpar.

``flax.nnx.MultiHeadAttention(attention_fn=...)`` and
``flax.linen.MultiHeadDotProductAttention(attention_fn=...)`` call their
``attention_fn`` with ``[batch..., length, heads, head_dim]`` projections and a
fixed set of keywords (``mask``, dropout, ``dtype``, ``precision``, ``module``;
NNX adds ``is_causal``). :func:`make_attention_fn` returns a function with
exactly those parameters, so both layers accept it as is. Linen passes only the
keywords an ``attention_fn`` names, so every keyword that changes the result is
named here and refused when we cannot honour it: a request is never dropped.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.api import attention
from jax_seqpar.core import checks, masks
from jax_seqpar.api.attention import LayoutChoice, StrategyChoice
from jax_seqpar.strategies.inputs import describe
from jax_seqpar.kernels.options import BlockSizes, KernelName, check_softcap


def _refuse(name: str, value, fix: str) -> None:
    raise ValueError(f"jax_seqpar attention_fn cannot apply {name}={value!r}: {fix}")


def make_attention_fn(
    mesh: Optional[jax.sharding.Mesh],
    *,
    seq_axes: Union[str, tuple] = "sp",
    strategy: StrategyChoice = "auto",
    causal: bool = False,
    window: int | tuple[int, int] | None = None,
    scale: Optional[float] = None,
    layout: LayoutChoice = "auto",
    kernel: KernelName = "auto",
    block_sizes: BlockSizes | None = None,
    softcap: Optional[float] = None,
    compute_dtype: ComputeLike = None,
    ulysses_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    mask_fn: Optional[Callable] = None,
):
    """An ``attention_fn`` for Flax NNX ``MultiHeadAttention`` and Linen
    ``MultiHeadDotProductAttention`` that runs sequence-parallel exact attention.

    The mask is configured here, from per-token metadata (``causal``, ``window``,
    ``chunk_size``, ``mask_fn``), never passed as a dense ``[S, S]`` array. NNX's
    ``is_causal=True`` (a call argument of its ``MultiHeadAttention``) turns causal
    masking on as well. Segment ids of packed documents and bidirectional ids (a
    prefix-LM prompt, an image's tokens) vary per batch and cannot travel through
    Flax's layers (they do not forward them); call the returned function directly
    with ``segment_ids=`` / ``bidirectional_ids=``, or use
    :class:`jax_seqpar.flax.SelfAttention`.

    Refused with ``ValueError`` (at trace time) rather than ignored: a dense
    ``mask`` (use ``causal=`` / ``window=`` / ``segment_ids=``), a ``bias``,
    dropout that is active (``dropout_rate > 0`` and not ``deterministic``),
    ``module`` (``sow_weights=True``: the attention weights never exist) and
    custom einsums (Linen's ``qk_attn_weights_einsum`` /
    ``attn_weights_value_einsum``). ``precision`` and ``force_fp32_for_softmax``
    are accepted; scores and softmax are always computed in float32.

    Args:
      mesh: the device mesh to split the sequence over, or ``None`` for the
        local (unsharded) blockwise kernel.
      seq_axes, strategy, causal, window, scale, layout, kernel, block_sizes,
        softcap, compute_dtype, ulysses_size, chunk_size, mask_fn: as in
        :func:`jax_seqpar.sequence_parallel_attention` (checked when the function is
        made; each call builds its descriptions once:
        :func:`jax_seqpar.strategies.inputs.describe`).

    Returns:
      ``attention_fn(query, key, value, bias=None, mask=None, ..., is_causal=False,
      *, segment_ids=None, bidirectional_ids=None, sinks=None)``: ``query [batch...,
      S, H, Dqk]``, ``key [batch..., S, Hkv, Dqk]``, ``value [batch..., S, Hkv, Dv]``
      (any number of batch dims, including none), ``segment_ids`` and
      ``bidirectional_ids`` ``int32[batch..., S]`` (the latter with causal masking);
      returns ``[batch..., S, H, Dv]`` in the promoted dtype of the inputs (or ``dtype``).

    .. code-block:: python

        mesh = jax.make_mesh((8,), ("sp",))
        layer = nnx.MultiHeadAttention(
            num_heads=8, in_features=256, decode=False, rngs=nnx.Rngs(0),
            attention_fn=make_attention_fn(mesh, strategy="ring", causal=True))
    """
    masks.MaskSpec.make(checks.flag("causal", causal), window, chunk_size, mask_fn)
    checks.scale(scale)  # refused when the function is made, before any call
    check_softcap(softcap)

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                     dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                     precision=None, module=None, is_causal=False,
                     force_fp32_for_softmax=False, qk_attn_weights_einsum=None,
                     attn_weights_value_einsum=None, *, segment_ids=None,
                     bidirectional_ids=None, sinks=None):
        """Flax's ``attention_fn`` contract; see :func:`make_attention_fn`."""
        del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
        if mask is not None:
            _refuse("mask", f"<array of shape {jnp.shape(mask)}>",
                    "dense masks are not supported; configure make_attention_fn(causal=..., "
                    "window=...) and pass segment_ids= for packed documents "
                    "(decode=True caches are not supported either).")
        if bias is not None:
            _refuse("bias", f"<array of shape {jnp.shape(bias)}>",
                    "additive attention biases are not supported.")
        if dropout_rate > 0.0 and not deterministic:
            _refuse("dropout_rate", dropout_rate,
                    "attention dropout is not supported; set dropout_rate=0.0 or call the "
                    "layer with deterministic=True.")
        if module is not None:
            _refuse("module", type(module).__name__,
                    "sow_weights=True needs the attention weights, which sequence-parallel "
                    "attention never materializes.")
        for name, einsum in (("qk_attn_weights_einsum", qk_attn_weights_einsum),
                             ("attn_weights_value_einsum", attn_weights_value_einsum)):
            if einsum is not None:
                _refuse(name, einsum, "custom einsums are not supported.")
        if dtype is None:
            dtype = jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
        batch_dims = query.shape[:-3]
        for name, x in (("key", key), ("value", value)):
            if x.shape[:-3] != batch_dims:
                raise ValueError(f"query and {name} must share batch dims. Got "
                                 f"query.shape={query.shape}, {name}.shape={x.shape}.")
        flat = math.prod(batch_dims)
        query, key, value = (x.reshape(flat, *x.shape[-3:]) for x in (query, key, value))
        ids = masks.Tokens(None, segment_ids, bidirectional_ids)
        for name in ("segment_ids", "bidirectional_ids"):
            x = getattr(ids, name)
            expected = (*batch_dims, query.shape[1])
            if x is not None and tuple(jnp.shape(x)) != expected:
                raise ValueError(f"{name} must have shape [batch..., length]={expected}. "
                                 f"Got {tuple(jnp.shape(x))}.")
        ids = jax.tree.map(lambda x: jnp.reshape(x, (flat, query.shape[1])), ids)  # [B, S]
        options, metadata = describe(
            query, key, value, local=False, causal=causal or checks.flag("is_causal", is_causal),
            window=window, chunk_size=chunk_size, mask_fn=mask_fn, scale=scale,
            kernel=kernel, block_sizes=block_sizes, softcap=softcap,
            compute_dtype=compute_dtype,
            segment_ids=ids.segment_ids, bidirectional_ids=ids.bidirectional_ids, sinks=sinks)
        where = attention.placement(query, key, value, options, metadata, mesh=mesh,
                                    seq_axes=seq_axes, strategy=strategy, layout=layout,
                                    ulysses_size=ulysses_size)
        out = attention.attend(query, key, value, options, metadata, where)
        return out.reshape(*batch_dims, *out.shape[1:])  # [batch..., S, H, Dv]

    return attention_fn
