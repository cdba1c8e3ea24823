"""The global-view entry point: one call shards the sequence over a mesh and attends.

``sequence_parallel_attention`` takes global ``[B, S, H, D]`` arrays, pads the
sequence to what the strategy and layout need, places the arrays sequence-sharded
on the mesh, runs the chosen strategy inside ``jax.shard_map`` and returns the
output at the caller's length, in the caller's token order, sharded like its
queries. Tokens either arrive in natural order and are relayouted inside the
shards (zigzag: two half-shard ``ppermute`` s; striped: one ``all_to_all``), or
arrive already laid out with their ``positions`` and are not moved. Explicit-axis
meshes (the ``jax.make_mesh`` default) and Auto meshes both work; batch and head
shardings (data and tensor parallelism) are kept.
"""

from __future__ import annotations

import functools
import logging
import math
import typing
from typing import TYPE_CHECKING, Callable, Literal, Optional, Union

import jax
import jax.numpy as jnp

from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.api import placement as _placement
from jax_seqpar.api.program import Placement, attend
from jax_seqpar.core import checks, masks
from jax_seqpar.core.layout import LayoutName
from jax_seqpar.core.meshes import split_axis
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.kernels.options import KernelName, Options
from jax_seqpar.planning import plan as planning
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.inputs import Metadata, describe

#: What ``strategy=`` takes: a registered strategy that runs on the global view, or
#: ``"auto"`` (planned: :func:`jax_seqpar.planning.plan.auto_choice`).
StrategyChoice = Literal["auto", registry.StrategyName]
STRATEGIES: tuple[StrategyChoice, ...] = typing.get_args(StrategyChoice)
#: What ``layout=`` takes: a token order, or ``"auto"``
#: (:func:`jax_seqpar.strategies.registry.default_layout`).
LayoutChoice = Literal["auto", LayoutName]
LAYOUTS: tuple[LayoutChoice, ...] = typing.get_args(LayoutChoice)

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.kernels.options import BlockSizes

#: Says what ``strategy="auto"`` chose (INFO), once per layer, mask and mesh.
_LOG = logging.getLogger("jax_seqpar")

__all__ = ["LAYOUTS", "STRATEGIES", "LayoutChoice", "StrategyChoice", "attend", "placement",
           "sequence_parallel_attention"]


def _choose_strategy(q, k, v, mesh, axes: tuple, spec: masks.MaskSpec, batch_shards: int,
                     head_shards: int) -> tuple[registry.StrategyName, int | None]:
    """``(strategy, ulysses_size)`` for the batch rows and heads one sequence group really
    holds: a tuned plan, else the hardware model's choice."""
    batch, seq_len, heads, head_dim = q.shape
    # Planned at the length the call pads to (whole zigzag half-shards on every device).
    seq_len = _placement.padded_length(seq_len, 2 * math.prod(mesh.shape[a] for a in axes))
    local = LayerShape(batch // batch_shards, seq_len, heads // head_shards,
                       k.shape[2] // head_shards, head_dim, v.shape[3], dtype=q.dtype,
                       causal=spec.causal, window=spec.window, chunk_size=spec.chunk_size)
    return _announced(local, spec, mesh, axes)


@functools.lru_cache(maxsize=None)
def _announced(local: LayerShape, spec: masks.MaskSpec, mesh: jax.sharding.Mesh,
               axes: tuple) -> tuple[registry.StrategyName, int | None]:
    """:func:`jax_seqpar.planning.plan.auto_choice`, said once per layer, mask and mesh on
    the ``jax_seqpar`` logger (INFO): the strategy, the token order ``layout="auto"``
    takes with it, the pieces its exchange travels in with ``overlap="auto"`` (as the
    time model counts them, :attr:`~jax_seqpar.strategies.entry.Strategy.pieces`), and
    why (the predicted time, bytes and memory of every candidate)."""
    strategy, ulysses_size, why = planning.auto_plan(local, mesh, axes)
    entry = registry.get(strategy)
    devices = math.prod(mesh.shape[a] for a in axes)
    ring, ulysses = entry.factorization(devices, ulysses_size or mesh.shape[axes[-1]])
    layout = registry.default_layout(strategy, spec, seq_len=local.seq_len, num_shards=devices)
    pieces = "" if entry.pieces is None else (
        ", its exchange in %d / %d pieces (forward / backward)" % entry.pieces(local, ring,
                                                                             ulysses))
    _LOG.info('strategy="auto" on %s over %s: %s%s, layout="auto" -> %s%s (%s)',
              dict(mesh.shape), axes, strategy,
              "" if ulysses_size is None else f" (ulysses_size={ulysses_size})",
              layout, pieces, why)
    return strategy, ulysses_size


def sequence_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Optional[jax.sharding.Mesh] = None,
    seq_axes: Union[str, tuple] = "sp",
    strategy: StrategyChoice = "auto",
    causal: bool = False,
    segment_ids: Optional[jax.Array] = None,
    positions: Optional[jax.Array] = None,
    kv_segment_ids: Optional[jax.Array] = None,
    window: int | tuple[int, int] | None = None,
    scale: Optional[float] = None,
    layout: LayoutChoice = "auto",
    kernel: KernelName = "auto",
    block_sizes: BlockSizes | None = None,
    batch_axes: str | tuple[str, ...] | None = None,
    softcap: Optional[float] = None,
    compute_dtype: ComputeLike = None,
    sinks: Optional[jax.Array] = None,
    return_lse: bool = False,
    ulysses_size: Optional[int] = None,
    overlap: bool | Literal["auto"] = "auto",
    pieces: int | Literal["auto"] = "auto",
    head_groups: int | Literal["auto"] = "auto",
    chunk_size: Optional[int] = None,
    bidirectional_ids: Optional[jax.Array] = None,
    mask_fn: Callable | None = None,
    max_document_shards: Optional[int] = None,
    return_max_logit: bool = False,
):
    """Exact attention with the sequence split over ``seq_axes`` of ``mesh``.

    Two ways to order the tokens. Without ``positions``, ``q, k, v`` are in natural
    order and the call relayouts them inside the shards (``layout``) and back: a
    convenience for one-off calls that pays the relayout's traffic every call.
    With ``positions``, the tokens are already in the order the model keeps them in
    (put a whole batch into a layout once with :func:`jax_seqpar.permute_batch`)
    and no relayout happens: a layer then sends exactly ``jax_seqpar.comm_bytes``.

    Any sequence length works: the call pads to what the strategy and layout need,
    masks the padding and returns the caller's length.

    Args:
      q: ``[B, S, H, Dqk]`` global queries.
      k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` (``H % Hkv == 0``).
      mesh: the device mesh (Explicit or Auto axis types), or None: attend on the
        caller's devices without splitting the sequence (the same kernels and masks;
        ``seq_axes``, ``strategy``, ``layout``, ``batch_axes`` and ``ulysses_size``
        must then keep their defaults: a ``ValueError`` otherwise).
      seq_axes: the mesh axis splitting the sequence, or ``(outer, inner)``:
        ``"hybrid"`` runs Ulysses over ``inner`` and the ring over ``outer``.
      strategy: ``"ulysses"``, ``"ring"``, ``"hybrid"``, ``"allgather"`` or
        ``"auto"`` (a plan tuned on this mesh, else :func:`jax_seqpar.planning.plan.plan` for
        the devices' hardware preset, counting the batch rows and heads each sequence
        group holds: :func:`jax_seqpar.planning.plan.auto_choice`).
      causal, window: the mask on true token positions (see ``MaskSpec``): ``causal``
        a bool, ``window`` one int or ``(left, right)`` of non-negative ints.
      segment_ids: ``int32[B, S]`` packed documents attend within themselves
        (``-2**31`` is reserved for padding). Ids, positions: any integer dtype
        whose values fit int32 (:mod:`jax_seqpar.core.checks`).
      positions: ``int32[B, S]`` global positions of the tokens in the order given,
        or None (natural order, relayouted by ``layout``).
      kv_segment_ids: ``int32[B, S]`` the keys' own segment ids where they differ from
        the queries' (e.g. padded keys of ragged rows), or None: ``segment_ids``.
      scale: a finite number; defaults to ``1/sqrt(Dqk)``.
      layout: ``"zigzag"``, ``"striped"``, ``"contiguous"``, ``"per_document"`` or
        ``"auto"`` (zigzag where it balances causal work: ring, hybrid and
        all-gather with ``causal=True`` and no window; contiguous with a window,
        whose ring and all-gather then exchange only the halo the window reaches);
        must be ``"auto"`` or ``"contiguous"`` with ``positions``.
        ``"per_document"`` (needs ``segment_ids``) balances causal work within packed
        documents (:mod:`jax_seqpar.core.packing`): the call computes the order from
        the segment ids and gathers the whole sequence into it and back, every call;
        a model applies it once per batch instead (:func:`jax_seqpar.permute_batch`).
      kernel: ``"auto"`` (Triton on GPU, Mosaic on TPU, XLA elsewhere: chosen by the
        platform the program is lowered for; :mod:`jax_seqpar.kernels.lowering`), ``"xla"``,
        ``"pallas"`` or ``"mosaic"``.
      block_sizes: tile sizes (:class:`jax_seqpar.kernels.BlockSizes`, one class for every
        kernel; a size left None is the running kernel's default), or None.
      batch_axes: mesh axes the batch is sharded over (data parallelism), or None:
        read from the inputs' sharding, and on Auto meshes under ``jit`` the mesh
        axes outside ``seq_axes`` that divide the batch.
      softcap: logits become ``softcap * tanh(s / softcap)`` before masking (Gemma 2);
        a positive number, ``inf`` meaning no cap (the limit).
      compute_dtype: the dtype Q·Kᵀ and P·V take their operands in (``jnp.bfloat16``,
        ``jnp.float8_e4m3fn``, ...; None: the inputs' dtype), or a
        :class:`jax_seqpar.Compute` (another dtype backward, the Hadamard rotation).
        FP8 is scaled per head and per kernel tile of tokens, q and k rotated first by
        default; ``kernel="auto"`` runs it in the Pallas kernels where they serve it
        (Triton on H100-class GPUs, Mosaic on TPU) and the XLA kernel elsewhere. The
        softmax, the lse and every partial sum stay float32; the output and the
        gradients keep the inputs' dtype.
      sinks: ``[H]`` float logits of a zero-valued virtual key per head (gpt-oss:
        ``p_j = exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k))``), differentiable.
      return_lse: also return the float32 ``[B, S, H]`` log-sum-exp of every row
        (sinks included), for callers that merge partial results.
      ulysses_size: with ``strategy="hybrid"`` (or ``"auto"``, which it then makes the
        hybrid), Ulysses over groups of this many neighbouring sequence devices and the
        ring across the groups, on the same devices
        (:func:`jax_seqpar.core.meshes.split_axis`: one axis works too).
      overlap, pieces, head_groups: how Ulysses' exchange (``"ulysses"``, the hybrid's
        inner one) is pipelined behind the kernel: ``"auto"`` or True (along the
        sequence where each device holds enough tokens, the keys first, then the
        queries: all but ``1/2^(pieces-1)`` of the bytes travel while a kernel runs, in
        no more memory than ``overlap=False``; else in head groups: the planner's rule,
        :func:`jax_seqpar.strategies.heads.resolve_pieces`), ``overlap=False`` (each
        exchange whole, one kernel call), or forced counts for experiments (``pieces``
        also sets the all-gather's pieces); a strategy without the keyword refuses a
        value other than ``"auto"``.
      chunk_size: tokens see each other only inside one chunk ``position // chunk_size``
        (Llama 4's chunked attention: ``causal=True, chunk_size=8192``); a positive int
        or None.
      bidirectional_ids: ``int32[B, S]`` (needs ``causal``): tokens that carry the same
        non-zero id see each other both ways (a prefix-LM's prompt: one id per
        document's prefix; an image's tokens in a vision-language model); 0 is causal.
      mask_fn: ``mask_fn(q_tokens, kv_tokens) -> bool``, an elementwise predicate on
        broadcastable :class:`jax_seqpar.core.masks.Tokens` fields ANDed with the rest of
        the mask (define it once: compiled programs are keyed on the function).
      max_document_shards: with ``segment_ids``, ``D``: every document lies on at most
        ``D`` consecutive shards in the order given (``positions`` from
        :func:`jax_seqpar.permute_batch`'s ``"per_document"`` layout with
        ``max_document_shards=``; or natural order, ``layout="auto"``/``"contiguous"``).
        Every strategy then sends only ``D - 1`` shards' K/V either side (``D = 1``:
        none). A batch that breaks it fails with a ``ValueError`` naming the document
        (under ``jit``: ``jax.errors.JaxRuntimeError`` carrying it), never a dropped key.
      return_max_logit: also return ``float32[H]``, per head the largest scaled logit
        ``scale * q.k`` any visible query-key pair reaches over the whole batch and
        sequence (QK-Clip, Muon; TransformerEngine's context-parallel max logit): taken
        before ``softcap`` (what QK-Clip clips), over the pairs the mask lets through
        (sinks are no pairs), ``-inf`` for a head with no visible pair; with an FP8
        ``compute_dtype`` of the logits the kernel computed from the quantized q and k.
        It has no gradient (``stop_gradient``; the output's gradients are unchanged).
        Computed in the kernel (every kernel: XLA, Triton, Mosaic) and reduced with one
        ``pmax`` of ``[H]`` across the devices.

    Returns:
      ``[B, S, H, Dv]`` in ``q.dtype``, in the caller's token order, sharded like
      ``q`` on Explicit meshes (its type's batch, sequence and head entries; an
      unsharded ``q`` gives an unsharded output, as ``jax.nn`` would); with
      ``return_lse`` and/or ``return_max_logit`` a tuple in that order: ``(out, lse)``,
      ``(out, max_logit)`` or ``(out, lse, max_logit)``. A batch or sequence of length 0
      gives an empty result (the max logit ``-inf``).

    Raises:
      ValueError: bad shapes, unknown axes/strategy/layout, a layout with
        ``positions``, heads a Ulysses axis does not divide, ids or positions that
        are not integers fitting int32 (or use the padding id), options of the wrong
        type or range, or mesh-only arguments with ``mesh=None``.

    .. code-block:: python

        mesh = jax.make_mesh((8,), ("sp",))
        out = sequence_parallel_attention(q, k, v, mesh=mesh, strategy="ring", causal=True)
    """
    options, metadata = describe(
        q, k, v, local=False, causal=causal, window=window, chunk_size=chunk_size,
        mask_fn=mask_fn, scale=scale, kernel=kernel, block_sizes=block_sizes, softcap=softcap,
        compute_dtype=compute_dtype,
        return_lse=return_lse, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
        positions=positions, bidirectional_ids=bidirectional_ids, sinks=sinks,
        max_document_shards=max_document_shards, return_max_logit=return_max_logit)
    where = placement(q, k, v, options, metadata, mesh=mesh, seq_axes=seq_axes,
                      strategy=strategy, layout=layout, batch_axes=batch_axes,
                      ulysses_size=ulysses_size, overlap=overlap, pieces=pieces,
                      head_groups=head_groups)
    return attend(q, k, v, options, metadata, where)


def placement(q: jax.Array, k: jax.Array, v: jax.Array, options: Options, metadata: Metadata,
              *, mesh: Optional[jax.sharding.Mesh], seq_axes: Union[str, tuple] = "sp",
              strategy: StrategyChoice = "auto", layout: LayoutChoice = "auto",
              batch_axes: str | tuple[str, ...] | None = None,
              ulysses_size: Optional[int] = None, overlap: bool | Literal["auto"] = "auto",
              pieces: int | Literal["auto"] = "auto",
              head_groups: int | Literal["auto"] = "auto") -> Optional[Placement]:
    """Where a call on global ``q, k, v`` runs, its keywords checked once (``ValueError``
    naming a bad one): None without a mesh (every keyword here must then keep its
    default), else the :class:`~jax_seqpar.api.program.Placement`, ``strategy="auto"``
    resolved (:func:`jax_seqpar.planning.plan.auto_choice`). See
    :func:`sequence_parallel_attention` for the keywords."""
    if mesh is None:
        checks.mesh_only(seq_axes=(seq_axes, "sp"), strategy=(strategy, "auto"),
                         layout=(layout, "auto"), batch_axes=(batch_axes, None),
                         ulysses_size=(ulysses_size, None), overlap=(overlap, "auto"),
                         pieces=(pieces, "auto"), head_groups=(head_groups, "auto"))
        return None
    axes = (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes)
    for name in axes:
        if name not in mesh.shape:
            raise ValueError(f"seq_axes names {name!r}, which is not an axis of the mesh "
                             f"{dict(mesh.shape)}.")
    if strategy != "auto" and strategy not in registry.STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of "
                         f"{('auto', *registry.STRATEGIES)}.")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}.")
    if metadata.positions is not None and layout not in ("auto", "contiguous"):
        raise ValueError(f"positions= says the tokens are already in the order to keep; "
                         f"layout={layout!r} would relayout them again. Put the batch into "
                         "the layout once (jax_seqpar.permute_batch) and drop layout=.")
    bound = options.spec.max_document_shards
    if bound is not None and layout not in ("auto", "contiguous"):
        raise ValueError(f"max_document_shards={bound} bounds where the documents lie in the "
                         f"order given; layout={layout!r} would move them. Lay the batch out "
                         "once (permute_batch(..., 'per_document', max_document_shards=)) and "
                         "pass positions=, or keep layout='auto'.")
    _placement.check_documents_home(bound, mesh, axes, metadata.segment_ids,
                                    metadata.kv_segment_ids)
    if layout == "per_document" and metadata.segment_ids is None:
        raise ValueError('layout="per_document" orders the tokens by their documents: pass '
                         "segment_ids= (int32[B, S]); without documents use "
                         'layout="zigzag".')
    batch_entry, head_entry = _placement.kept_entries(q, k, v, mesh, axes, batch_axes)
    if ulysses_size is not None:  # a two-axis strategy's split, named: nothing left to choose
        two_axes = [name for name, entry in registry.STRATEGIES.items()
                    if entry.num_seq_axes == 2]  # the built-in one first
        if strategy != "auto" and strategy not in two_axes:
            raise ValueError(f'ulysses_size={ulysses_size} needs strategy="{two_axes[0]}" (or '
                             f'"auto"). Got strategy={strategy!r}.')
        strategy = two_axes[0] if strategy == "auto" else strategy
        split_axis(mesh, axes, ulysses_size)  # refuses a size the devices do not divide
    elif strategy == "auto" and q.shape[0] and q.shape[1]:  # an empty call runs nothing
        strategy, ulysses_size = _choose_strategy(
            q, k, v, mesh, axes, options.spec, _placement.entry_size(mesh, batch_entry),
            _placement.entry_size(mesh, head_entry))
    pipelining = ("overlap", "pieces", "head_groups")
    entry = registry.get(strategy) if strategy != "auto" else None
    if entry is not None and entry.attend is None:
        raise ValueError(f"strategy={strategy!r} has no attend core (its registry entry's "
                         "attend=None): it runs only as its per-shard function inside "
                         "jax.shard_map; pick another strategy for the global call.")
    if entry is not None and entry.num_seq_axes == 2 and ulysses_size is None and len(axes) != 2:
        raise ValueError(f"strategy={strategy!r} runs over two sequence axes (outer, inner); "
                         f"got seq_axes={axes}. Pass ulysses_size= to split one axis in two.")
    for name, value in (("overlap", overlap), ("pieces", pieces), ("head_groups", head_groups)):
        if not (isinstance(value, str) and value == "auto") and name not in (
                entry.pipelining if entry is not None else pipelining):
            raise ValueError(f"{name}={value!r} does not apply to strategy={strategy!r}, "
                             "which does not pipeline that way; drop it.")
    return Placement(
        mesh, axes, typing.cast(registry.StrategyName, strategy), ulysses_size,
        "contiguous" if metadata.positions is not None else layout, batch_entry, head_entry,
        _placement.caller_spec(q, mesh), overlap, pieces, head_groups)
