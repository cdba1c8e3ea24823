"""``dot_product_attention``: the arguments and results of ``jax.nn.dot_product_attention``.

A user swaps one call: the same ``BTNH`` (or ``TNH``) layout, GQA, ``is_causal``,
``local_window_size``, padding by ``query_seq_lengths`` / ``key_value_seq_lengths``,
``scale``, a boolean key-padding ``mask`` and ``return_residual``. Everything is
expressed as per-token metadata (segment ids), never as a ``[T, S]`` array, so it
runs sequence-parallel with a mesh (:func:`jax_seqpar.sequence_parallel_attention`)
and locally without one (:func:`jax_seqpar.strategies.local.local_attention`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.api import attention
from jax_seqpar.api.attention import LayoutChoice, StrategyChoice
from jax_seqpar.api.head_rows import per_head
from jax_seqpar.core import checks, masks
from jax_seqpar.core.merge import check_sinks, with_sinks
from jax_seqpar.kernels.options import KernelName, make_options
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.inputs import Metadata, Operands, check_qkv

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.kernels.options import BlockSizes

__all__ = ["dot_product_attention", "without_segment_ids"]

# Segment ids of the metadata: a query sees a key when their ids are equal, so a padded
# (or masked) key and a padded query, each with an id of its own, see nothing.
_REAL, _MASKED_KEY, _PADDED_QUERY = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class _WithoutSegmentIds:
    """A caller's ``mask_fn`` shown the tokens' positions and bidirectional ids only: the
    segment ids an entry point makes for itself (padding, KV heads) are not the caller's.
    Equal (and hashed) by the function it wraps, so a compiled program is reused."""

    mask_fn: Callable

    def __call__(self, q: masks.Tokens, kv: masks.Tokens):
        absent = masks.Absent("q_tokens/kv_tokens.segment_ids", _HIDDEN_SEGMENT_IDS)
        hide = lambda t: masks.Tokens(t.positions, absent, t.bidirectional_ids)  # noqa: E731
        return self.mask_fn(hide(q), hide(kv))


_HIDDEN_SEGMENT_IDS = (
    "dot_product_attention, prefill and decode show mask_fn no segment ids (the ids they "
    "make for padding are their own, not the caller's): mask on positions and "
    "bidirectional_ids, or call sequence_parallel_attention with segment_ids=.")


def without_segment_ids(spec: masks.MaskSpec) -> masks.MaskSpec:
    """``spec`` whose ``mask_fn`` (if any) is called with ``masks.Tokens`` whose
    ``segment_ids`` are :class:`~jax_seqpar.core.masks.Absent` (reading them is a
    ``ValueError``), for entry points that take no segment ids from the caller
    (:func:`dot_product_attention`, ``prefill``, ``decode``): the ids they make for
    themselves (padding, KV heads) are not the caller's to read."""
    if spec.mask_fn is None or isinstance(spec.mask_fn, _WithoutSegmentIds):
        return spec
    return dataclasses.replace(spec, mask_fn=_WithoutSegmentIds(spec.mask_fn))


def _ensure_4d(x):
    """``x`` with leading unit dims up to rank 4 (``jax.nn``'s rule for ``TNH`` inputs)."""
    x = jnp.asarray(x)
    return jnp.expand_dims(x, tuple(range(4 - x.ndim))) if x.ndim < 4 else x


def _below(lengths, seq: int):
    """``bool[B, seq]``: token ``i`` of row ``b`` is within ``lengths[b]``."""
    return jnp.arange(seq, dtype=jnp.int32)[None, :] < lengths[:, None]


def _check_mask(mask, shape: tuple):
    """``mask`` as a 4-D bool array broadcastable to ``shape = (B, N, T, S)``."""
    mask = _ensure_4d(mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True: the pair attends), as in jax.nn. Got "
                         f"dtype {mask.dtype}; pass an additive mask as bias= instead.")
    if mask.ndim != 4 or any(m not in (1, n) for m, n in zip(mask.shape, shape)):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"[B, N, T, S]={shape}; each dimension must be 1 or the full size.")
    return mask


def _key_segments(mask, kv_lengths, batch: int, kv_len: int):
    """``int32[B, S]`` (or ``[B, N, S]`` for a per-head mask): which keys are visible,
    from the key lengths and a ``[B|1, N|1, 1, S|1]`` mask; None when all are."""
    visible = None if kv_lengths is None else _below(kv_lengths, kv_len)[:, None]  # [B, 1, S]
    if mask is not None:
        heads = mask.shape[1]
        keys = jnp.broadcast_to(mask[:, :, 0, :], (batch, heads, kv_len))  # [B, N|1, S]
        visible = keys if visible is None else visible & keys
    if visible is None:
        return None
    segments = jnp.where(visible, _REAL, _MASKED_KEY).astype(jnp.int32)
    return segments[:, 0] if segments.shape[1] == 1 else segments


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
    return_residual: bool = False,
    mesh: Optional[jax.sharding.Mesh] = None,
    seq_axes: Union[str, tuple] = "sp",
    strategy: StrategyChoice = "auto",
    layout: LayoutChoice = "auto",
    kernel: KernelName = "auto",
    block_sizes: BlockSizes | None = None,
    softcap: Optional[float] = None,
    compute_dtype: ComputeLike = None,
    sinks: Optional[jax.Array] = None,
    ulysses_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    bidirectional_ids: Optional[jax.Array] = None,
    mask_fn: Optional[Callable] = None,
    return_max_logit: bool = False,
):
    """Scaled dot-product attention, exact, sequence-parallel over ``mesh`` when given.

    Semantics are those of ``jax.nn.dot_product_attention``: ``query`` token ``i``
    sees key ``j`` when ``j <= i`` (``is_causal``), ``i - left <= j <= i + right``
    (``local_window_size``), ``j < key_value_seq_lengths[b]`` and ``mask[b, n, 0, j]``;
    rows ``i >= query_seq_lengths[b]`` are zeros. Differences: a real query that
    sees no key at all returns zeros (``jax.nn``'s XLA path returns the mean of
    every value there), and the residual is differentiable.

    It runs under ``jax.jit``, ``jax.grad``, ``jax.vjp`` and ``jax.vmap``, on
    Explicit meshes (inside ``jax.set_mesh`` or not; inputs replicated, or sharded
    over the sequence, batch or heads) and on Auto meshes; without a mesh, inputs
    sharded over an Explicit mesh attend on their own devices (batch rows and heads
    stay where they are, the sequence is gathered) and the output keeps their sharding.
    ``jax.vmap`` folds its axis into the batch: one kernel call.

    Args:
      query: ``[B, T, N, H]`` (or ``[T, N, H]``).
      key: ``[B, S, K, H]``; value: ``[B, S, K, Hv]`` (one floating dtype;
        ``N % K == 0``: MHA, GQA, MQA).
      bias: an additive bias broadcastable to ``[B, N, T, S]``: handed to ``jax.nn``
        without a mesh, refused with one (see Raises).
      mask: a boolean mask broadcastable to ``[B, N, T, S]`` (True: the pair attends).
        A key-padding mask, ``[B|1, N|1, 1, S]``, becomes per-key metadata and works
        with and without a mesh. Shared by the heads (``[B|1, 1, 1, S]``) it costs
        nothing; per head (``[B|1, N, 1, S]``, ``N > 1``) every head runs as a batch
        row of its own, with K/V heads repeated to the ``N`` query heads (GQA's saving
        is lost) and no Ulysses or hybrid split (they divide heads). A mask with a
        query dimension (``[.., T, S]``, ``T > 1``) is dense: handed to ``jax.nn``
        without a mesh, refused with one.
      scale: logit scale; default ``1/sqrt(H)``.
      is_causal: causal mask (top-left aligned, as in ``jax.nn``).
      query_seq_lengths, key_value_seq_lengths: ``int32[B]`` valid lengths, as in
        ``jax.nn``: keys past ``key_value_seq_lengths`` are masked; query rows past
        ``query_seq_lengths`` are zero (they mask no key). Either alone, or both.
      local_window_size: ``int`` (both sides) or ``(left, right)``.
      implementation: ``None`` for ours; a ``jax.nn`` implementation name
        (``"xla"``, ``"cudnn"``) hands the call to ``jax.nn`` (without a mesh only).
      return_residual: also return the log-sum-exp of every row's logits.
      mesh: a device mesh to split the sequence over (Explicit or Auto axes), or
        ``None``: attend locally (queries and keys may then differ in length;
        ``seq_axes``, ``strategy`` and ``layout`` must keep their defaults).
      seq_axes, strategy, layout, kernel, block_sizes, ulysses_size: as in
        :func:`jax_seqpar.sequence_parallel_attention` (``strategy="auto"`` picks one
        the shapes allow; ``kernel`` and ``block_sizes`` also apply without a mesh).
      softcap, sinks, compute_dtype: logit soft-capping, per-head attention sinks ``[N]``
        and the products' dtype (not in ``jax.nn``; see
        :func:`jax_seqpar.sequence_parallel_attention`).
      chunk_size: query ``i`` and key ``j`` see each other only inside one chunk,
        ``i // chunk_size == j // chunk_size`` (Llama 4's chunked attention is
        ``is_causal=True, chunk_size=8192``); a positive int, or None.
      bidirectional_ids: ``int32[B, T]`` (or ``[T]``), with ``is_causal`` and ``T == S``:
        tokens that carry the same non-zero id see each other in both directions (a
        prefix-LM prompt, an image's tokens); 0 is plain causal.
      mask_fn: ``mask_fn(q_tokens, kv_tokens) -> bool``, a jittable elementwise
        predicate on :class:`jax_seqpar.core.masks.Tokens` (``positions``, and
        ``bidirectional_ids``, zeros when not given; reading ``segment_ids`` is a
        ``ValueError``), ANDed with the rest
        (see :class:`jax_seqpar.core.masks.MaskSpec`). Define it once: compiled
        programs are keyed on the function.
      return_max_logit: also return ``float32[N]``, per head the largest scaled logit of a
        visible pair before ``softcap`` (as in
        :func:`jax_seqpar.sequence_parallel_attention`; not in ``jax.nn``: refused with
        a bias, a dense or per-head mask, or an ``implementation``).

    Returns:
      ``[B, T, N, Hv]`` (or ``[T, N, Hv]``) in ``query.dtype``, sharded like ``query``
      on Explicit meshes (as ``jax.nn`` shards it where ``jax.nn`` runs); with
      ``return_residual``, ``(out, residual)``, the residual ``[B, T, N]`` (or
      ``[T, N]``) in ``key.dtype`` as in ``jax.nn``, computed in float32 and
      differentiable (``jax.nn`` stops its gradient; a call handed to ``jax.nn``
      keeps ``jax.nn``'s). A row that sees no key (including rows past
      ``query_seq_lengths``) has residual ``-1e30`` (``jax.nn``: about ``-2.4e38``;
      both are ``-inf`` in float16). ``return_max_logit`` appends the max logit last:
      ``(out, max_logit)`` or ``(out, residual, max_logit)``.

    Raises:
      ValueError: bad shapes, lengths or mask dtype; with a mesh: a ``bias``, a dense
        ``mask`` (an ``[T, S]`` input needs every device to hold whole rows of scores,
        which is what sequence parallelism avoids: express the mask with
        ``is_causal``, ``local_window_size``, the sequence lengths and a key-padding
        mask, or packed documents with ``sequence_parallel_attention(segment_ids=)``),
        query and key lengths that differ, an ``implementation``, a per-head mask with
        ``strategy="ulysses"`` or ``"hybrid"``, or a strategy the shapes do not allow
        (e.g. Ulysses over more devices than heads).

    .. code-block:: python

        out = dot_product_attention(q, k, v, is_causal=True, mesh=jax.make_mesh((8,), ("sp",)))
    """
    ndim = jnp.ndim(query)
    query, key, value = (_ensure_4d(x) for x in (query, key, value))
    check_qkv(query, key, value)
    batch, q_len, heads = query.shape[:3]
    kv_len = key.shape[1]
    is_causal = checks.flag("is_causal", is_causal)
    return_residual = checks.flag("return_residual", return_residual)
    return_max_logit = checks.flag("return_max_logit", return_max_logit)
    if mesh is None:
        checks.mesh_only(seq_axes=(seq_axes, "sp"), strategy=(strategy, "auto"),
                         layout=(layout, "auto"), ulysses_size=(ulysses_size, None))
    if mask is not None:
        mask = _check_mask(mask, (batch, heads, q_len, kv_len))
    key_mask = mask is not None and mask.shape[2] == 1  # varies along keys only
    dense = {name: x for name, x in (("bias", bias), ("mask", None if key_mask else mask))
             if x is not None}
    spec = without_segment_ids(masks.MaskSpec.make(is_causal, local_window_size, chunk_size,
                                                   mask_fn))
    bidirectional_ids = _check_bidirectional(bidirectional_ids, ndim, is_causal, batch, q_len,
                                             kv_len)
    if mesh is None and (dense or implementation is not None):
        ours = {name: value for name, value in (
            ("softcap", softcap), ("sinks", sinks), ("chunk_size", chunk_size),
            ("compute_dtype", compute_dtype),
            ("bidirectional_ids", bidirectional_ids), ("mask_fn", mask_fn),
            ("return_max_logit", return_max_logit or None)) if value is not None}
        if ours:
            raise ValueError("softcap= and sinks= are ours, not jax.nn's, and so are "
                             "chunk_size=, compute_dtype=, bidirectional_ids=, mask_fn= and "
                             "return_max_logit=: "
                             f"{', '.join(n + '=' for n in ours)} cannot combine with a bias, "
                             "a dense mask or a jax.nn implementation. Fold the mask into the "
                             "dense mask, or express it with is_causal=, local_window_size=, "
                             "the sequence lengths and a key-padding mask [B, 1, 1, S].")
        # jax.nn's overloads take return_residual only as a literal True or False and
        # implementation only as 'xla'/'cudnn'; a drop-in forwards the caller's values.
        result = jax.nn.dot_product_attention(  # type: ignore[call-overload, misc]
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation,
            return_residual=return_residual)
        return jax.tree.map(lambda x: _squeeze(x, ndim), result)
    if mesh is not None:
        _check_mesh_call(dense, implementation, q_len, kv_len)
    q_lengths = checks.lengths("query_seq_lengths", query_seq_lengths, batch)
    kv_lengths = checks.lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
    kv_segments = _key_segments(mask if key_mask else None,
                                None if kv_lengths is None else jnp.asarray(kv_lengths),
                                batch, kv_len)
    q_segments = None
    if q_lengths is not None:
        q_segments = jnp.where(_below(jnp.asarray(q_lengths), q_len), _REAL,
                               _PADDED_QUERY).astype(jnp.int32)
        if kv_segments is None:  # query lengths say nothing about the keys: every one is real
            kv_segments = jnp.zeros((batch, kv_len), jnp.int32)
    elif kv_segments is not None:
        q_segments = jnp.zeros((batch, q_len), jnp.int32)
    checks.mask_fn(spec, batch, q_len, kv_len,
                   given=() if bidirectional_ids is None else ("bidirectional_ids",))
    options = make_options(query, spec, scale=scale, kernel=kernel, block_sizes=block_sizes,
                           softcap=softcap, return_lse=return_residual,
                           compute_dtype=compute_dtype, return_max_logit=return_max_logit)
    sinks = check_sinks(sinks, heads)

    def attend(q, k, v, operands: Operands, return_lse: bool):
        """The one path on ``[rows, T, heads, D]`` (heads folded into rows for a per-head
        mask): the keys' bidirectional ids are the queries'."""
        call = dataclasses.replace(options, return_lse=return_lse)
        metadata = Metadata(operands.q_tokens.segment_ids, operands.kv_tokens.segment_ids,
                            None, operands.q_tokens.bidirectional_ids, operands.sinks)
        where = attention.placement(q, k, v, call, metadata, mesh=mesh, seq_axes=seq_axes,
                                    strategy=strategy, layout=layout,
                                    ulysses_size=ulysses_size)
        return attention.attend(q, k, v, call, metadata, where)
    q_tokens = masks.Tokens(None, q_segments, bidirectional_ids)  # [B, T] fields or None
    if kv_segments is not None and kv_segments.ndim == 3:  # a per-head mask
        splits_heads = strategy != "auto" and registry.get(strategy).splits_heads
        if return_max_logit:
            raise ValueError("return_max_logit=True keeps a maximum per head, but a per-head "
                             f"mask (shape {tuple(kv_segments.shape)}) runs each head as a "
                             "batch row of its own; use a mask shared by the heads "
                             "([B, 1, 1, S]) or the sequence lengths.")
        if mesh is not None and (splits_heads or ulysses_size):
            raise ValueError(
                f"a per-head mask of shape {None if mask is None else tuple(mask.shape)} runs "
                f"each of the {heads} heads "
                f"as a batch row of its own (one head each), which strategy={strategy!r} "
                "cannot split over devices by heads; use strategy='ring', 'allgather' or "
                "'auto', or a mask shared by the heads ([B, 1, 1, S]).")
        out, lse = per_head(attend, query, key, value, q_tokens, kv_segments)
        if sinks is not None:  # per head: folded in once the heads are unfolded
            out, lse = with_sinks(out.astype(jnp.float32), lse, sinks)
            out = out.astype(query.dtype)
        result = (out, lse) if return_residual else out
    else:
        result = attend(query, key, value,
                        Operands(q_tokens, masks.Tokens(None, kv_segments), sinks),
                        return_residual)
    if not (return_residual or return_max_logit):
        return _squeeze(result, ndim)  # [B, T, N, Hv]
    out, *rest = result  # [B, T, N, Hv], float32 [B, T, N] (residual), float32 [N]
    lse = [_squeeze(rest[0].astype(key.dtype), ndim)] if return_residual else []
    return (_squeeze(out, ndim), *lse, *rest[len(lse):])


def _squeeze(x, ndim: int):
    """``x`` without the leading unit dims :func:`_ensure_4d` gave an ``ndim``-D input."""
    return jnp.squeeze(x, tuple(range(4 - ndim)))


def _check_bidirectional(ids, ndim: int, is_causal: bool, batch: int, q_len: int,
                         kv_len: int):
    """``int32[B, T]`` bidirectional ids (``[T]`` for a ``TNH`` call), or None;
    ``ValueError`` for ids without ``is_causal``, between two sequences, or of
    another shape."""
    if ids is None:
        return None
    if not is_causal:
        raise ValueError("bidirectional_ids lift the causal mask for tokens that share a "
                         "non-zero id; without is_causal=True every token already sees both "
                         "directions. Pass is_causal=True (prefix-LM, vision-language masks) "
                         "or drop bidirectional_ids.")
    if q_len != kv_len:
        raise ValueError(f"bidirectional_ids need one sequence (self-attention): got query "
                         f"length {q_len} and key/value length {kv_len}.")
    if ndim == 3 and jnp.ndim(ids) == 1:  # TNH: ids [T]
        ids = (ids if hasattr(ids, "shape") else np.asarray(ids))[None]
    return checks.bidirectional_ids(ids, batch, q_len, True)


def _check_mesh_call(dense: dict, implementation, q_len: int, kv_len: int) -> None:
    """Raise ``ValueError`` for what cannot run sequence-parallel."""
    if "bias" in dense:
        raise ValueError(
            f"a bias of shape {tuple(jnp.shape(dense['bias']))} cannot be sequence-parallel: "
            "the kernels take masks as per-token metadata, not additive scores. Express it "
            "with is_causal=, local_window_size=, the sequence lengths or a boolean "
            "key-padding mask=[B, 1, 1, S], or call without mesh= to attend locally.")
    if "mask" in dense:
        raise ValueError(
            f"a dense mask of shape {tuple(dense['mask'].shape)} cannot be sequence-parallel: "
            "it holds a score for every (query, key) pair, so each device would need "
            "whole [T, S] rows, which is what splitting the sequence avoids. Express the "
            "mask with is_causal=, local_window_size=, the sequence lengths and a key-padding "
            "mask of shape [B, 1, 1, S] (or packed documents with "
            "jax_seqpar.sequence_parallel_attention(segment_ids=)), or call without mesh= "
            "to attend locally.")
    if implementation is not None:
        raise ValueError(f"implementation={implementation!r} names a jax.nn kernel, which "
                         "cannot run sequence-parallel; drop it (use kernel=) or mesh=.")
    if q_len != kv_len:
        raise ValueError(f"with a mesh, query and key/value split ONE sequence: got query "
                         f"length {q_len} and key/value length {kv_len}. Call without "
                         "mesh= for attention between two sequences.")
