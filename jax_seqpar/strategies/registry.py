"""The one list of strategies: every module that lists, chooses, models or benchmarks
strategies iterates :data:`STRATEGIES` (the API, the planner, the bench, the CLI, tests).

Each strategy module ends with its :class:`~jax_seqpar.strategies.entry.Strategy` entry
(its per-shard function, the bytes it sends, its terms of the time and memory model,
the token order that balances its causal work, its head constraint), and this module
lists them; :func:`register` adds one more (a strategy written outside the package),
which the planner then considers and :func:`comm_bytes` counts.
"""

from __future__ import annotations

import math
import typing
from typing import Literal, Mapping, TypedDict

from jax_seqpar.core import quant
from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.core.shape import dtype_of_size
from jax_seqpar.strategies import allgather, decode, hybrid, ring, traffic, ulysses
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.core.reach import mask_reach

__all__ = ["DECODE", "STRATEGIES", "Strategy", "StrategyName", "check_layer", "comm_bytes",
           "default_layout", "get", "names", "register", "unregister"]


#: The name of a strategy the global entry point runs (``strategy=``; the entry points
#: add ``"auto"``), in the order tables list them: the package's own. :func:`register`
#: adds others, which the planner and :func:`comm_bytes` take by their names (typed as
#: this alias, as the registry's keys).
StrategyName = Literal["ulysses", "ring", "allgather", "hybrid"]

#: Every strategy the global entry point runs, by name (:data:`StrategyName`, then any
#: :func:`register` added), live: registering adds to it.
STRATEGIES: dict[StrategyName, Strategy] = {}
#: The registered strategies the global entry point does not run (decode), by name.
_OTHERS: dict[str, Strategy] = {}


def register(entry: Strategy) -> None:
    """Adds ``entry`` to the strategies: :func:`get` finds it, the planner
    (:func:`jax_seqpar.planning.plan.plan_layer`, :func:`~jax_seqpar.planning.predict.candidates`)
    considers it where it has a :attr:`~Strategy.preference` or a model to predict, and
    :func:`comm_bytes` counts it; a ``global_view`` entry joins :data:`STRATEGIES`.

    Raises:
      ValueError: a strategy of that name is registered already (:func:`unregister` it
        first), or the name is ``"auto"``.
    """
    if not isinstance(entry, Strategy):
        raise ValueError(f"register takes a strategies.entry.Strategy. Got {entry!r}.")
    if entry.name == "auto" or entry.name in STRATEGIES or entry.name in _OTHERS:
        raise ValueError(f"strategy {entry.name!r} is registered already (or reserved): "
                         f"unregister it first, or choose another name.")
    if entry.global_view:
        STRATEGIES[typing.cast(StrategyName, entry.name)] = entry  # open: any name
    else:
        _OTHERS[entry.name] = entry


def unregister(name: str) -> Strategy:
    """Removes the strategy called ``name`` and returns its entry (:func:`register`'s
    undo, e.g. at the end of a test)."""
    entry = get(name)
    if entry.global_view:
        del STRATEGIES[typing.cast(StrategyName, name)]
    else:
        del _OTHERS[name]
    return entry


for _module in (ulysses, ring, allgather, hybrid, decode):
    register(_module.ENTRY)

#: Attention of new tokens to a sequence-sharded KV cache (forward only).
DECODE = decode.ENTRY


def names() -> tuple[StrategyName, ...]:
    """Every strategy the global entry point runs, by name, the registered ones included
    (:data:`STRATEGIES`' keys)."""
    return tuple(STRATEGIES)


def get(name: str) -> Strategy:
    """The strategy called ``name`` (:data:`STRATEGIES`, ``"decode"`` or another
    registered strategy the global entry point does not run)."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    if name in _OTHERS:
        return _OTHERS[name]
    raise ValueError(f"strategy={name!r} is not one of {tuple(STRATEGIES)}.")


def default_layout(strategy: StrategyName | str, spec: MaskSpec = MaskSpec(), *,
                   seq_len: int | None = None,
                   num_shards: int | None = None) -> Literal["contiguous", "zigzag"]:
    """The token order ``layout="auto"`` uses: balance and locality.

    A window or chunks bound every query's keys, so work per query is (nearly) the
    same everywhere and the contiguous split is balanced; it is also the only order
    whose shards are local, where every strategy sends only the mask's reach
    (:func:`jax_seqpar.core.reach.mask_reach`: a halo, nothing for chunks that fit
    a shard). ``max_document_shards`` is a bound on the order given: contiguous keeps
    it (any relayout would break it). Without a bounded reach, zigzag where it balances causal work
    (:attr:`Strategy.zigzag_balances`); everything else is contiguous.

    Args:
      strategy: a name of :data:`STRATEGIES`.
      spec: the mask (its ``causal``, ``window`` and ``chunk_size`` decide).
      seq_len, num_shards: when both are given, the reach decides: a window or chunks
        that reach (nearly) every shard count as none. Without them, a window means
        contiguous and chunks are not known to be local.
    Returns:
      ``"contiguous"`` or ``"zigzag"``.

    >>> default_layout("ring", MaskSpec.make(causal=True, window=(4096, 0)))
    'contiguous'
    >>> default_layout("ring", MaskSpec(causal=True))
    'zigzag'
    >>> default_layout("ring", MaskSpec(causal=True, chunk_size=1024), seq_len=8192, num_shards=8)
    'contiguous'
    """
    if spec.max_document_shards is not None:
        return "contiguous"  # the bound holds in the order given: keep it
    if seq_len is None or num_shards is None:
        if spec.window is not None:
            return "contiguous"
    elif mask_reach(spec, -(-seq_len // num_shards), num_shards) is not None:
        return "contiguous"
    return "zigzag" if spec.causal and get(strategy).zigzag_balances else "contiguous"


class _LayerSizes(TypedDict):
    """The layer's sizes every traffic model and :func:`traffic.check_shape` take."""

    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype_bytes: float


def check_layer(axis_sizes: int | tuple[int, ...] | Mapping[str, int], *, batch: int,
                seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                v_head_dim: int | None = None, dtype_bytes: float = 2, **_: object) -> None:
    """Raises :func:`comm_bytes`' ``ValueError`` unless the layer (:func:`comm_bytes`'
    keywords: ``check_layer(8, **shape.comm_kwargs())``) fits ``axis_sizes``: sizes
    positive, heads in groups, the sequence divided by the devices. What every strategy
    needs; each strategy's bytes model checks its own constraints besides."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    traffic.check_shape(sizes=traffic.axis_sizes_tuple(axis_sizes), batch=batch,
                        seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, v_head_dim=v_head_dim, dtype_bytes=dtype_bytes)


def comm_bytes(strategy: StrategyName | str, *, batch: int, seq_len: int,
               num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
               axis_sizes: int | tuple[int, ...] | Mapping[str, int], dtype_bytes: float = 2,
               backward: bool = False, with_segment_ids: bool = False,
               window: int | tuple[int, int] | None = None, causal: bool = False,
               chunk_size: int | None = None, max_document_shards: int | None = None,
               compute_dtype: ComputeLike = None) -> float:
    """Bytes ONE device sends in one attention call.

    Shapes are global: q ``[batch, seq_len, num_heads, head_dim]``, k
    ``[batch, seq_len, num_kv_heads, head_dim]``, v ``[..., v_head_dim]``. A
    :class:`~jax_seqpar.core.shape.LayerShape` gives every keyword but ``axis_sizes``:
    ``comm_bytes(strategy, axis_sizes=8, **shape.comm_kwargs())``.

    * ``"ulysses"``: all_to_all of q, k, v (K/V heads replicated to
      ``lcm(num_kv_heads, P)``) and of the output, backward doubles it and adds
      the float32 ``<dout, out>`` rows ``[B, S/P, H]``; plus one all_gather of the
      int32 positions (and segment ids) to ``[B, S]``.
    * ``"ring"``: ``P-1`` ppermutes of the local K/V plus int32 positions
      (``B*S/P*4`` bytes a step; ``with_segment_ids`` adds as much again);
      backward re-rotates them and sends ``P`` float32 dK/dV accumulators.
    * ``"allgather"``: all_gather of K/V (in pieces) and positions; backward sends
      the dK/dV accumulators ``P`` hops around the ring in the input dtype.
    * ``"hybrid"`` with ``axis_sizes=(outer, inner)``: Ulysses over ``inner`` on
      the local shard ``[B, S/(outer*inner), ...]``, then the ring over ``outer``
      on ``[B, S/outer, lcm(Hkv, inner)/inner, .]`` (positions gathered over
      ``inner``, then rotated over ``outer``).
    * ``window=(left, right)`` (``right`` is 0 with ``causal``) on the contiguous
      split: the ring (hybrid: its ring part) and the all-gather exchange only
      the halo of ``left + right`` tokens of K/V (and segment ids, no positions):
      constant in ``P``. The ring's backward sends float32 dK/dV back, the
      all-gather's in the input dtype. A window reaching ``(P-1)*S/P`` tokens or
      more is the full ring / gather. Ulysses is unchanged by a window.
    * ``chunk_size`` (chunked attention, Llama 4) on the contiguous split bounds the
      reach as a window does (:func:`jax_seqpar.core.reach.mask_reach`: shard ``r``
      needs ``(r*S/P) mod chunk_size`` tokens before it, and without ``causal`` to its
      chunk's end after it; the tighter of the window and the chunks): the ring and the
      all-gather send that halo. Where the reach is ``(0, 0)`` (chunks that fit a
      shard) every strategy, Ulysses and the hybrid included, attends locally and sends
      nothing.
    * ``max_document_shards=D`` (with ``with_segment_ids``), in any token order: the
      reach is ``(D-1)*S/P`` tokens either side, a halo whose positions travel too
      (``D = 1``: local attention); every strategy adds the bound's check, one all-gather
      of the int32 segment ids (``B*S*4*(P-1)/P``).

    * ``"decode"``: decoding against a sequence-sharded KV cache; ``seq_len`` is
      the number of new tokens ``T`` (any, not divided); only the float32 merge
      of the partial results is sent (one ``pmax``, two ``psum`` s).

    A group of one device sends nothing. For non-hybrid strategies a tuple of
    axis sizes is flattened (the product is the group size).

    What the model leaves out, measured with :mod:`jax_seqpar.tools.hlo`:

    * the zigzag relayout of :func:`jax_seqpar.sequence_parallel_attention`
      (q, k, v in and out back: one local shard of each, twice with backward);
      models that apply the layout once to their inputs do not pay it per call;
    * with a ring of 2 compiled together with its backward, XLA merges the
      backward's single K/V hop with the forward's (CSE), sending one rotation
      less than counted here; rings of 3 or more match exactly;
    * XLA:CPU sends bf16 collectives as f32 (use ``dtype_bytes=4`` to compare).

    A strategy added with :func:`register` is counted by its own model
    (:attr:`Strategy.bytes <jax_seqpar.strategies.entry.Strategy.bytes>`).

    Args:
      strategy: a name of :data:`STRATEGIES` (or ``"decode"``, or a :func:`register` ed
        name).
      batch, seq_len, num_heads, num_kv_heads, head_dim: global sizes.
      v_head_dim: ``Dv``, defaults to ``head_dim`` (MLA absorbed: 576 / 512).
      axis_sizes: the sequence axes' sizes: an int, ``(outer, inner)``, or
        ``{name: size}`` (``mesh.shape`` of the sequence axes).
      dtype_bytes: bytes per element of q/k/v (2 for bf16). Cotangents use it
        too; the ring's dK/dV accumulators are float32 whatever it is.
      backward: count forward + backward (``jax.value_and_grad``) instead of forward.
      with_segment_ids: packed documents: segment ids travel with the keys.
      window: ``None``, an int or ``(left, right)``: the sliding window, with
        the per-shard functions' default (contiguous) positions.
      causal: only matters with a window or chunks (a causal query reaches no later
        shard).
      chunk_size: chunked attention's chunk, or None.
      max_document_shards: the most consecutive shards any document spans, or None.
      compute_dtype: the call's ``compute_dtype=`` (None: the inputs' dtype). Where it
        is FP8 or narrower than the inputs, K/V (Ulysses: q, k, v, and dout backward)
        travel in it, FP8 with one float32 scale per token and head
        (:mod:`jax_seqpar.strategies.wire`): ``D + 4`` bytes a row instead of ``2D`` in
        bf16. What the backward keeps from the forward (Ulysses' q, k, v, a halo, the
        all-gather's K/V) and the ring's re-sent K/V travel in a dtype that serves both
        passes. Outputs, gradients and the float32 partial sums keep their bytes.

    Returns:
      Bytes one device sends, as a float (fractions of ``(P-1)/P``).

    >>> comm_bytes("ulysses", batch=1, seq_len=1024, num_heads=64, num_kv_heads=64,
    ...            head_dim=128, axis_sizes=8, dtype_bytes=1) / 1024
    3587.5

    (the seed's ``N x 3584`` for q, k, v, out, plus 3.5 bytes of int32 positions.)
    """
    sizes = traffic.axis_sizes_tuple(axis_sizes)
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    shape = _LayerSizes(batch=batch, seq_len=seq_len, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                        dtype_bytes=dtype_bytes)
    entry = get(strategy)
    if entry.global_view:  # decode's seq_len is the new tokens, any number
        traffic.check_shape(sizes=sizes, **shape)
    if max_document_shards is not None and not with_segment_ids:
        raise ValueError(f"{max_document_shards=} bounds where documents lie: it needs "
                         "with_segment_ids=True.")
    spec = MaskSpec.make(causal, window, chunk_size, max_document_shards=max_document_shards)
    check = traffic.document_check_bytes(spec, batch=batch, seq_len=seq_len,
                                         devices=math.prod(sizes)) if entry.global_view else 0.0
    compute = quant.compute(compute_dtype, dtype_of_size(dtype_bytes))
    wire = {} if compute is None else {"compute": compute}
    return float(entry.bytes(sizes, backward=backward, with_segment_ids=with_segment_ids, **wire,
                             spec=spec, **shape) + check)
