"""The per-token data of a call (:class:`Metadata`), its checks, and its per-shard view.

The argument checks themselves are :mod:`jax_seqpar.core.checks` (ids, positions,
lengths, flags, numbers) and :func:`jax_seqpar.core.masks.normalize_window`; every
entry point reaches them once, at its boundary: the per-shard functions through
:func:`describe`, the global view through :func:`check_metadata`. Below the boundary,
a strategy's core reads its shard's tokens (:func:`shard_operands`) and checks nothing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional

import jax
import jax.numpy as jnp

from jax_seqpar.core import checks, layout, masks, packing, quant, reach
from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.kernels.options import KernelName, Options, make_options

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.kernels.options import BlockSizes

__all__ = ["Metadata", "Operands", "axis_size", "check_ids", "check_metadata", "check_qkv",
           "check_self_attention", "describe", "documents_within", "empty_result", "finish", "gather_tokens",
           "max_logit_over", "nothing_seen", "operands", "shard_operands", "spread_message"]


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Raise ``ValueError`` unless q, k, v form a valid ``[B, S, H, D]`` triple."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim]. "
                             f"Got {name}.shape={x.shape}.")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must share the batch size. Got {q.shape=}, {k.shape=}, "
                         f"{v.shape=}.")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on [batch, seq, kv_heads]. Got {k.shape=}, "
                         f"{v.shape=}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share head_dim. Got q head_dim={q.shape[3]}, "
                         f"k head_dim={k.shape[3]}.")
    if not q.dtype == k.dtype == v.dtype or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must share one floating dtype (as jax.nn.dot_product_attention "
                         f"requires). Got q.dtype={q.dtype}, k.dtype={k.dtype}, "
                         f"v.dtype={v.dtype}; cast them to one dtype first.")
    if quant.is_fp8(q.dtype.name):
        raise ValueError(
            f"q, k, v are {q.dtype}, an FP8 dtype with no scales: the outputs and gradients "
            f"would be rounded to it unscaled. Pass them in bfloat16, float16 or float32 and "
            f"compute_dtype=jnp.{q.dtype} (scaled per token and head, the softmax and sums "
            f"in float32; jax_seqpar.Compute).")
    heads, kv_heads = q.shape[2], k.shape[2]
    if not heads or not kv_heads or not q.shape[3] or not v.shape[3]:
        raise ValueError(f"q, k, v need at least one head and a head_dim of at least 1. Got "
                         f"{q.shape=}, {k.shape=}, {v.shape=}.")
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads} "
                         "(MHA, GQA or MQA).")


def check_self_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                         local: bool = False) -> None:
    """:func:`check_qkv` plus one sequence for q and k (``local``: the shards inside
    ``shard_map``, where a different count means q and k/v were split differently)."""
    check_qkv(q, k, v)
    if q.shape[1] == k.shape[1]:
        return
    if local:
        raise ValueError(
            f"sequence-parallel attention splits ONE sequence, so every shard holds as many "
            f"query as key/value tokens. Got {q.shape[1]} local query tokens and {k.shape[1]} "
            "local key/value tokens: shard q, k and v along the same split of the same "
            "sequence (for attention to another sequence, run "
            "jax_seqpar.dot_product_attention without a mesh).")
    raise ValueError(f"self-attention needs q and k of one sequence length. "
                     f"Got q seq={q.shape[1]}, k seq={k.shape[1]}.")


def check_ids(name: str, ids: jax.typing.ArrayLike | None, batch: int, seq: int, *,
              segments: bool = False):
    """``ids`` as ``int32[batch, seq]`` (or None): integers of that shape that fit int32,
    and for ``segments`` not the reserved padding id (:mod:`jax_seqpar.core.checks`);
    ``ValueError`` otherwise."""
    check = checks.segment_ids if segments else checks.positions
    return check(name, ids, batch, seq)


def empty_result(q: jax.Array, v: jax.Array, return_lse: bool, return_max_logit: bool = False):
    """The result of a call with no query or no key (a zero-size dim): zeros of
    ``[B, T, H, Dv]`` in ``q.dtype`` (a query that sees no key gets zeros), with
    ``return_lse`` the ``float32[B, T, H]`` lse of rows that saw nothing, and with
    ``return_max_logit`` the ``float32[H]`` max logit of heads that saw nothing (-inf)."""
    out = jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    result = ((out,) + ((jnp.full(q.shape[:3], masks.EMPTY_LSE, jnp.float32),) if return_lse
                        else ()) +
              ((jnp.full(q.shape[2:3], -jnp.inf, jnp.float32),) if return_max_logit else ()))
    return result[0] if len(result) == 1 else result


def axis_size(axis_name: str | tuple[str, ...]) -> int:
    """Number of shards along ``axis_name`` (a name or a tuple of names)."""
    return jax.lax.axis_size(axis_name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Metadata(Generic[masks.Leaf]):
    """The per-token data of a call beside q, k, v: one pytree, built and checked once at
    the entry point (:func:`describe`, or the global view's own boundary) and moved by
    the layers below as it is (padding, placement, relayouts, ``shard_map``).

    Attributes:
      segment_ids, kv_segment_ids, positions, bidirectional_ids: ``int32[B, S]`` (the
        local ``S`` inside ``shard_map``) or None, as the entry points document them.
      sinks: ``[H]`` float sink logits, or None.
    """

    segment_ids: Optional[masks.Leaf] = None
    kv_segment_ids: Optional[masks.Leaf] = None
    positions: Optional[masks.Leaf] = None
    bidirectional_ids: Optional[masks.Leaf] = None
    sinks: Optional[masks.Leaf] = None

    def arrays(self) -> tuple:
        """The fields in order (None kept)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Operands(Generic[masks.Leaf]):
    """The per-token data as the kernels see it (a pytree: the operand of the
    pipelines' ``custom_vjp``): one :class:`~jax_seqpar.core.masks.Tokens` per side.

    Attributes:
      q_tokens, kv_tokens: the query and key/value tokens' metadata.
      sinks: ``[h]`` sink logits of the heads attended, or None.
    """

    q_tokens: masks.Tokens[masks.Leaf]
    kv_tokens: masks.Tokens[masks.Leaf]
    sinks: Optional[masks.Leaf] = None


def describe(q: jax.Array, k: jax.Array, v: jax.Array, *, local: bool,
             causal: bool = False, window: int | tuple[int, int] | None = None,
             chunk_size: int | None = None, mask_fn: Callable | None = None,
             scale: float | None = None, kernel: KernelName = "auto",
             block_sizes: BlockSizes | None = None, softcap: float | None = None,
             compute_dtype: ComputeLike = None,
             return_lse: bool = False, return_max_logit: bool = False,
             segment_ids: jax.typing.ArrayLike | None = None,
             kv_segment_ids: jax.typing.ArrayLike | None = None,
             positions: jax.typing.ArrayLike | None = None,
             bidirectional_ids: jax.typing.ArrayLike | None = None,
             sinks: jax.typing.ArrayLike | None = None,
             max_document_shards: int | None = None) -> tuple[Options, Metadata]:
    """The boundary of every self-attention entry point: the call's
    :class:`~jax_seqpar.kernels.options.Options` and checked :class:`Metadata` of
    ``q [B, S, H, Dqk]``, ``k, v [B, S, Hkv, .]`` (``local``: the shards inside
    ``shard_map``, ``S`` the local length; else global arrays), ``ValueError`` naming a
    bad argument. Every check of a call runs here, once; the layers below check nothing
    again. The keywords are those of :func:`jax_seqpar.sequence_parallel_attention`."""
    check_self_attention(q, k, v, local=local)
    spec = masks.MaskSpec.make(checks.flag("causal", causal), window, chunk_size, mask_fn,
                               max_document_shards)
    if spec.max_document_shards is not None and segment_ids is None:
        raise ValueError(f"max_document_shards={spec.max_document_shards} bounds where the "
                         "documents lie: pass their segment_ids= (in the order the shards hold "
                         "them), or drop max_document_shards.")
    options = make_options(q, spec, scale=scale, kernel=kernel, block_sizes=block_sizes,
                           softcap=softcap, return_lse=return_lse,
                           compute_dtype=compute_dtype, return_max_logit=return_max_logit)
    return options, check_metadata(q, options, Metadata(
        segment_ids, kv_segment_ids, positions, bidirectional_ids, sinks))


def check_metadata(q: jax.Array, options: Options, metadata: Metadata) -> Metadata:
    """``metadata`` of the self-attention call on ``q [B, S, H, Dqk]`` checked against
    its shapes (ids and positions ``int32[B, S]`` whose values fit int32, bidirectional
    ids only with causal, sinks ``[H]``, ``kv_segment_ids`` only beside ``segment_ids``,
    the mask predicate traced on the metadata's shapes): the one check of each array."""
    from jax_seqpar.core.merge import check_sinks

    batch, seq_len, heads = q.shape[:3]
    if metadata.kv_segment_ids is not None and metadata.segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids for the queries too (a query "
                         "sees a key when their segment ids are equal).")
    checks.mask_fn(options.spec, batch, seq_len, seq_len, given=tuple(
        name for name in ("segment_ids", "bidirectional_ids")
        if getattr(metadata, name) is not None))
    def ids(name, x, segments=False):  # each given array checked once; None stays None
        return None if x is None else check_ids(name, x, batch, seq_len, segments=segments)

    return Metadata(
        ids("segment_ids", metadata.segment_ids, True),
        ids("kv_segment_ids", metadata.kv_segment_ids, True),
        ids("positions", metadata.positions),
        checks.bidirectional_ids(metadata.bidirectional_ids, batch, seq_len,
                                 options.spec.causal),
        check_sinks(metadata.sinks, heads))


def operands(metadata: Metadata) -> Operands:
    """The kernels' view of checked ``metadata``: one :class:`~jax_seqpar.core.masks.Tokens`
    per side, the keys' segment ids ``kv_segment_ids`` where given (positions as given,
    None included)."""
    q_tokens = masks.Tokens(*(None if x is None else jnp.asarray(x) for x in (
        metadata.positions, metadata.segment_ids, metadata.bidirectional_ids)))
    kv_tokens = q_tokens
    if metadata.kv_segment_ids is not None:
        kv_tokens = dataclasses.replace(q_tokens,
                                        segment_ids=jnp.asarray(metadata.kv_segment_ids))
    return Operands(q_tokens, kv_tokens, metadata.sinks)


def shard_operands(q: jax.Array, options: Options, metadata: Metadata,
                   axis_name: str | tuple[str, ...]) -> Operands:
    """:func:`operands` of this shard, positions defaulting to the contiguous split along
    ``axis_name``; with ``max_document_shards``, the ids checked against it
    (:func:`documents_within`)."""
    if metadata.positions is None:
        batch, local_len = q.shape[:2]
        positions = layout.shard_positions("contiguous", local_len, axis_name=axis_name)
        positions = jnp.broadcast_to(positions, (batch, local_len)).astype(jnp.int32)
        metadata = dataclasses.replace(metadata, positions=positions)
    return documents_within(options, operands(metadata), axis_name)


def documents_within(options: Options, shard: Operands,
                     axis_name: str | tuple[str, ...]) -> Operands:
    """``shard`` (the local ``[B, L]`` tokens), once every document of the sequence is
    checked to lie on at most ``options.spec.max_document_shards`` consecutive shards of
    ``axis_name``: else the program fails with a ``ValueError`` naming the row, the
    document, the shards it spans and the bound
    (:func:`jax_seqpar.core.checks.refuse_unless`), never a silently dropped key.

    It gathers every shard's ids, sorted (``int32[B, S]``, twice with separate
    ``kv_segment_ids``; :func:`jax_seqpar.strategies.traffic.document_check_bytes`):
    a set of documents cannot be checked disjoint from another's with less."""
    bound = options.spec.max_document_shards
    shards = axis_size(axis_name)
    if not reach.documents_bound_reach(bound, shards):  # bounds nothing: nothing to check
        return shard
    ids = jnp.asarray(shard.q_tokens.segment_ids)
    kv_ids = shard.kv_tokens.segment_ids
    separate = kv_ids is not shard.q_tokens.segment_ids
    local = jnp.concatenate([ids, jnp.asarray(kv_ids)], axis=1) if separate else ids  # [B, L|2L]
    # Sorted: the gather is the check's own (no other collective's to merge with).
    gathered = jax.lax.all_gather(jnp.sort(local, axis=1), axis_name, axis=1, tiled=True)
    span, document = packing.widest_documents(gathered, shards)  # [B]
    row = jnp.argmax(span)
    checked = checks.refuse_unless(span[row] <= bound, spread_message(bound, shards), ids, row,
                                   document[row], span[row])
    q_tokens = dataclasses.replace(shard.q_tokens, segment_ids=checked)
    kv_tokens = shard.kv_tokens if separate else q_tokens
    return Operands(q_tokens, kv_tokens, shard.sinks)


def spread_message(bound: Optional[int], shards: int) -> Callable[..., str]:
    """``message(row, document, span)``: what a call refuses when a document of its
    segment ids spans more than ``max_document_shards=bound`` of ``shards`` (the host's
    check and the program's say the same)."""
    def message(row, document, span):
        return (f"max_document_shards={bound}, but in row {int(row)} document "
                f"{int(document)} spans {int(span)} consecutive shards of {shards}: "
                f"lay the batch out with permute_batch(..., 'per_document', num_shards=, "
                f"max_document_shards=) and pass packing.document_shards(segment_ids, "
                f"num_shards) of the laid-out ids (or a bound >= {int(span)}).")

    return message


def finish(options: Options, q: jax.Array, result: tuple, operands: Operands):
    """A shard's float32 kernel ``result`` (``(out, lse)``, and the ``float32[B, L, H]``
    row max logits with ``options.return_max_logit``) with the sinks of ``operands``
    folded in, out in ``q.dtype``: what the strategies' cores return, ``out``, then
    ``lse`` with ``options.return_lse``, then the row max logits (the per-shard
    functions reduce them: :func:`max_logit_over`)."""
    from jax_seqpar.core.merge import with_sinks

    out, lse = with_sinks(result[0], result[1], operands.sinks)
    rows = tuple(jax.lax.stop_gradient(x) for x in result[2:3])
    rest = ((lse,) if options.return_lse else ()) + rows
    return (out.astype(q.dtype), *rest) if rest else out.astype(q.dtype)


def max_logit_over(options: Options, result: Any, axis_name: str | tuple[str, ...] | None):
    """A core's ``result`` (:func:`finish`) as a per-shard function returns it: with
    ``options.return_max_logit``, its last entry, the row max logits ``float32[B, L, H]``,
    reduced to ``float32[H]`` over the shard's batch rows and tokens and, across devices,
    over ``axis_name`` (a ``pmax``; None: no axis)."""
    if not options.return_max_logit:
        return result
    high = jnp.max(jax.lax.stop_gradient(result[-1]), axis=(0, 1), initial=-jnp.inf)  # [H]
    if axis_name is not None:
        high = jax.lax.pmax(high, axis_name)
    return (*result[:-1], high)


def nothing_seen(options: Options, q: jax.Array, d_v: int) -> tuple:
    """The float32 result of no key yet for ``q [B, L, H, .]`` (a ring's first carry):
    ``out`` zeros ``[B, L, H, d_v]``, ``lse`` ``EMPTY_LSE`` and, with
    ``options.return_max_logit``, row max logits ``-inf``, ``[B, L, H]`` each."""
    rows = q.shape[:3]
    return ((jnp.zeros(rows + (d_v,), jnp.float32), jnp.full(rows, masks.EMPTY_LSE, jnp.float32))
            + ((jnp.full(rows, -jnp.inf, jnp.float32),) if options.return_max_logit else ()))


# Any: a Tokens or a tuple of them (a pytree, which JAX types as Any), returned as given.
def gather_tokens(tokens: Any, axis_name: str | tuple[str, ...]) -> Any:
    """``[B, S/P]`` metadata of the local tokens (a :class:`~jax_seqpar.core.masks.Tokens` or a
    tree of them) -> ``[B, S]`` of the whole sequence; an array that appears more than
    once (query and key positions) is gathered once."""
    gathered = {}

    def gather(x):
        if id(x) not in gathered:
            gathered[id(x)] = jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
        return gathered[id(x)]

    return jax.tree.map(gather, tokens)
