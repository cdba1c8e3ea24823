"""Validation of attention inputs and the per-shard token metadata every strategy uses.

The argument checks themselves are :mod:`jax_seqpar.core.checks` (ids, positions,
lengths, flags, numbers) and :func:`jax_seqpar.core.masks.normalize_window`; every
entry point, global or per shard, reaches them through the functions here.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Callable, Generic, Literal, Optional

import jax
import jax.numpy as jnp

from jax_seqpar.core import checks, layout, masks
from jax_seqpar.kernels.contract import check_softcap
from jax_seqpar.kernels.options import Options
from jax_seqpar.kernels import make_options
from jax_seqpar.kernels import KernelName

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.kernels.contract import BlockSizes
    from jax_seqpar.strategies.registry import StrategyName

__all__ = ["Call", "Metadata", "Operands", "Shard", "axis_size", "check_ids",
           "check_qkv", "check_self_attention", "empty_result", "gather_tokens",
           "per_shard", "prepare", "shard_tokens"]


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
    heads, kv_heads = q.shape[2], k.shape[2]
    if not heads or not kv_heads or not q.shape[3] or not v.shape[3]:
        raise ValueError(f"q, k, v need at least one head and a head_dim of at least 1. Got "
                         f"{q.shape=}, {k.shape=}, {v.shape=}.")
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads} "
                         "(MHA, GQA or MQA).")


def check_self_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                         segment_ids: jax.typing.ArrayLike | None):
    """:func:`check_qkv` plus one sequence length for q and k; returns ``segment_ids``
    as ``int32[B, S]`` (:func:`check_ids`)."""
    check_qkv(q, k, v)
    batch, seq_len = q.shape[:2]
    if k.shape[1] != seq_len:
        raise ValueError(f"self-attention needs q and k of one sequence length. "
                         f"Got q seq={seq_len}, k seq={k.shape[1]}.")
    return check_ids("segment_ids", segment_ids, batch, seq_len, segments=True)


def check_ids(name: str, ids: jax.typing.ArrayLike | None, batch: int, seq: int, *,
              segments: bool = False):
    """``ids`` as ``int32[batch, seq]`` (or None): integers of that shape that fit int32,
    and for ``segments`` not the reserved padding id (:mod:`jax_seqpar.core.checks`);
    ``ValueError`` otherwise."""
    check = checks.segment_ids if segments else checks.positions
    return check(name, ids, batch, seq)


def empty_result(q: jax.Array, v: jax.Array, return_lse: bool):
    """The result of a call with no query or no key (a zero-size dim): zeros of
    ``[B, T, H, Dv]`` in ``q.dtype`` (a query that sees no key gets zeros), and with
    ``return_lse`` the ``float32[B, T, H]`` lse of rows that saw nothing."""
    out = jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
    if not return_lse:
        return out
    return out, jnp.full(q.shape[:3], masks.EMPTY_LSE, jnp.float32)


def shard_tokens(q: jax.Array, metadata: "Metadata", *,
                 axis_name: str | tuple[str, ...]) -> masks.Tokens:
    """Metadata of this shard's tokens; positions default to the contiguous split.

    Args:
      q: the local ``[B, S_local, H, D]`` queries (for shapes).
      metadata: the local ``int32[B, S_local]`` segment ids, positions and bidirectional
        ids (each None or given; the bidirectional ids already checked:
        :func:`jax_seqpar.core.checks.bidirectional_ids`).
      axis_name: the mesh axis (or tuple of axes) the sequence is split over.
    """
    batch, local_len = q.shape[:2]
    segment_ids = check_ids("segment_ids", metadata.segment_ids, batch, local_len, segments=True)
    positions = check_ids("positions", metadata.positions, batch, local_len)
    if positions is None:
        positions = layout.shard_positions("contiguous", local_len, axis_name=axis_name)
        positions = jnp.broadcast_to(positions, (batch, local_len)).astype(jnp.int32)
    return masks.Tokens(*(None if x is None else jnp.asarray(x)
                          for x in (positions, segment_ids, metadata.bidirectional_ids)))


def axis_size(axis_name: str | tuple[str, ...]) -> int:
    """Number of shards along ``axis_name`` (a name or a tuple of names)."""
    return jax.lax.axis_size(axis_name)


@dataclasses.dataclass(frozen=True)
class Call:
    """Everything static about one attention call: the one description every entry
    point builds from its keywords (:meth:`make`) and every layer below reads (hashable:
    the key of its compiled program).

    Attributes:
      spec: the mask (:class:`~jax_seqpar.core.masks.MaskSpec`).
      scale: the score multiplier, or None (``1/sqrt(Dqk)``).
      kernel: the ``kernel=`` name (:func:`jax_seqpar.kernels.get`); block_sizes: its
        tiles or None; softcap: the logit soft-cap or None.
      return_lse: also return the float32 log-sum-exp.
      mesh, axes, strategy, ulysses_size, layout, batch_entry, head_entry, out_spec,
        pipeline: the global view's choices (:mod:`jax_seqpar.api.program`): the mesh and
        its sequence axes, the strategy and the hybrid's split, the token order, the
        kept batch/head shardings, the output's sharding and the pipelining keywords set
        (``(name, value)`` pairs). Unused by the per-shard and local paths.
    """

    spec: masks.MaskSpec = masks.MaskSpec()
    scale: Optional[float] = None
    kernel: KernelName = "auto"
    block_sizes: Optional[BlockSizes] = None
    softcap: Optional[float] = None
    return_lse: bool = False
    mesh: Optional[jax.sharding.Mesh] = None
    axes: tuple = ()
    strategy: Optional[StrategyName] = None
    ulysses_size: Optional[int] = None
    layout: Literal["auto", layout.LayoutName] = "contiguous"
    batch_entry: str | tuple[str, ...] | None = None
    head_entry: str | tuple[str, ...] | None = None
    out_spec: Optional[jax.sharding.PartitionSpec] = None
    pipeline: tuple = ()

    @classmethod
    def make(cls, *, causal: bool = False, window: int | tuple[int, int] | None = None,
             chunk_size: int | None = None, mask_fn: Callable | None = None,
             scale: float | None = None, kernel: KernelName = "auto",
             block_sizes: BlockSizes | None = None, softcap: float | None = None,
             return_lse: bool = False) -> "Call":
        """The call of these keywords, each checked (``ValueError`` naming it): ``causal``
        and ``return_lse`` bools, ``window`` non-negative ints, ``chunk_size`` a positive
        int, ``mask_fn`` a callable, ``scale`` a finite number, ``softcap`` a positive
        one. Array arguments are checked against the arrays by :func:`prepare` and the
        entry points."""
        spec = masks.MaskSpec.make(checks.flag("causal", causal), window, chunk_size, mask_fn)
        return cls(spec, checks.scale(scale), kernel, block_sizes, check_softcap(softcap),
                   checks.flag("return_lse", return_lse))

    def options(self, q: jax.Array) -> Options:
        """The kernels' options for queries ``q [..., Dqk]`` (``ValueError`` for a bad
        kernel or tile sizes)."""
        return make_options(q, self.spec, scale=self.scale, kernel=self.kernel,
                            block_sizes=self.block_sizes, softcap=self.softcap)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Metadata(Generic[masks.Leaf]):
    """The dynamic arrays of a call beside q, k, v (a pytree; absent fields None).

    Attributes:
      segment_ids, kv_segment_ids, positions, bidirectional_ids: ``int32[B, S]`` (the
        local ``S`` inside ``shard_map``), as the entry points document them.
      sinks: ``[H]`` float sink logits.
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
    """The dynamic operands of a pipeline beside q, k, v (a pytree, for custom_vjp).

    Attributes:
      q_tokens, kv_tokens: the query and key/value :class:`~jax_seqpar.core.masks.Tokens`.
      sinks: ``[h]`` sink logits of the heads attended, or None.
    """

    q_tokens: masks.Tokens[masks.Leaf]
    kv_tokens: masks.Tokens[masks.Leaf]
    sinks: Optional[masks.Leaf] = None


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard's prepared call (:func:`prepare`), what a strategy's core reads.

    Attributes:
      q_tokens, kv_tokens: the local tokens' metadata (the keys' segment ids may differ).
      options: the kernels' options; sinks: ``[H]`` or None.
      contiguous: the positions are the default contiguous split (a window may then
        shrink the exchange to a halo); return_lse: as the call's.
    """

    q_tokens: masks.Tokens
    kv_tokens: masks.Tokens
    options: Options
    sinks: Optional[jax.Array]
    contiguous: bool
    return_lse: bool

    def finish(self, q: jax.Array, out: jax.Array, lse: jax.Array):
        """The float32 ``(out, lse)`` of this shard with the sinks folded in, out in
        ``q.dtype``; the result the per-shard functions return."""
        from jax_seqpar.core.merge import with_sinks

        out, lse = with_sinks(out, lse, self.sinks)
        return (out.astype(q.dtype), lse) if self.return_lse else out.astype(q.dtype)


def prepare(q: jax.Array, k: jax.Array, v: jax.Array, call: Call, metadata: Metadata,
            axis_name: str | tuple[str, ...]) -> Shard:
    """The common prologue of every per-shard strategy: validate, then build metadata.

    Args:
      q, k, v: the local ``[B, S/P, H|Hkv, D]`` shards.
      call: the static call; metadata: its local arrays.
      axis_name: the mesh axis (or axes) the sequence is split over (default positions).
    """
    from jax_seqpar.core.merge import check_sinks

    check_qkv(q, k, v)
    check_sinks(metadata.sinks, q.shape[2])
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"sequence-parallel attention splits ONE sequence, so every shard holds as many "
            f"query as key/value tokens. Got {q.shape[1]} local query tokens and {k.shape[1]} "
            "local key/value tokens: shard q, k and v along the same split of the same "
            "sequence (for attention to another sequence, run "
            "jax_seqpar.dot_product_attention without a mesh).")
    spec, (batch, local_len) = call.spec, q.shape[:2]
    bidirectional = checks.bidirectional_ids(metadata.bidirectional_ids, batch, local_len,
                                             spec.causal)
    checks.mask_fn(spec, batch, local_len, local_len)
    q_tokens = shard_tokens(q, dataclasses.replace(metadata, bidirectional_ids=bidirectional),
                            axis_name=axis_name)
    kv_tokens = q_tokens
    if metadata.kv_segment_ids is not None:
        if metadata.segment_ids is None:
            raise ValueError("kv_segment_ids needs segment_ids for the queries too (a query "
                             "sees a key when their segment ids are equal).")
        kv_segment_ids = check_ids("kv_segment_ids", metadata.kv_segment_ids, batch,
                                   local_len, segments=True)
        kv_tokens = dataclasses.replace(q_tokens, segment_ids=jnp.asarray(kv_segment_ids))
    return Shard(q_tokens, kv_tokens, call.options(q), metadata.sinks,
                 metadata.positions is None, call.return_lse)


#: The public types of the strategies' own keywords (their cores' keyword-only arguments:
#: the pipelining of Ulysses, the hybrid and the all-gather) where a core leaves them bare.
_OWN_TYPES = {"overlap": "bool | Literal['auto']", "chunks": "int | Literal['auto']",
              "head_groups": "int | Literal['auto']"}


def per_shard(core: Callable) -> Callable:
    """The public per-shard function of a strategy's ``core``: the keywords every
    per-shard function takes, written once here, read into a :class:`Call` and a
    :class:`Metadata`, then ``core(q, k, v, call, metadata, *, seq_axes, **extra)``
    (``extra``: the core's own keyword-only arguments, e.g. Ulysses' pipelining, which
    the public signature lists after the common ones). The core's docstring is the
    function's; the core itself is its ``core`` attribute (what the global view calls).
    """

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                  seq_axes: str | tuple[str, ...], causal: bool = False,
                  segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                  window: int | tuple[int, int] | None = None, scale: float | None = None,
                  kernel: KernelName = "auto", block_sizes: BlockSizes | None = None,
                  softcap: float | None = None, sinks: jax.Array | None = None,
                  kv_segment_ids: jax.Array | None = None, chunk_size: int | None = None,
                  bidirectional_ids: jax.Array | None = None, mask_fn: Callable | None = None,
                  return_lse: bool = False, **extra: object):
        call = Call.make(causal=causal, window=window, chunk_size=chunk_size, mask_fn=mask_fn,
                         scale=scale, kernel=kernel, block_sizes=block_sizes, softcap=softcap,
                         return_lse=return_lse)
        metadata = Metadata(segment_ids, kv_segment_ids, positions, bidirectional_ids, sinks)
        return core(q, k, v, call, metadata, seq_axes=seq_axes, **extra)

    common = list(inspect.signature(attention).parameters.values())[:-1]
    own = [p.replace(annotation=_OWN_TYPES.get(p.name, p.annotation))
           if p.annotation is p.empty else p
           for p in inspect.signature(core).parameters.values()
           if p.kind == p.KEYWORD_ONLY and p.name != "seq_axes"]
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(attention, name, getattr(core, name))
    setattr(attention, "__signature__", inspect.Signature(common + own))
    setattr(attention, "core", core)
    return attention


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
