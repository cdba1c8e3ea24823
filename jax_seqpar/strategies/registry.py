"""The one list of strategies: every module that lists, chooses, models or benchmarks
strategies iterates :data:`STRATEGIES` (the API, the planner, the bench, the CLI, tests).

Each :class:`Strategy` holds what the rest of the package needs to know about it: its
per-shard function, the bytes it sends (:mod:`.traffic`), the token order that balances
its causal work, its head constraint and the features it serves. A new strategy is one
module and one entry here.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Callable, Literal, Mapping, Optional, TypedDict

from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.strategies import allgather, heads, hybrid, ring, traffic, ulysses
from jax_seqpar.strategies.decode import decode_attention
from jax_seqpar.strategies.halo import halo_sizes, ring_is_halo

__all__ = ["DECODE", "STRATEGIES", "Strategy", "StrategyName", "comm_bytes", "default_layout",
           "get"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to split attention over the sequence devices.

    Attributes:
      name: what ``strategy=`` takes.
      attention: the public per-shard function, ``attention(q, k, v, *, seq_axes, ...)``
        inside ``jax.shard_map``.
      attend: its core on described inputs, ``attend(q, k, v, options, metadata, *,
        seq_axes, **pipelining)`` (``options``: the call's
        :class:`~jax_seqpar.kernels.options.Options`; ``metadata``: its checked local
        :class:`~jax_seqpar.strategies.inputs.Metadata`): what the global view runs.
      pipelining: the keywords of ``attend`` beyond ``seq_axes`` (``"overlap"``,
        ``"chunks"``, ``"head_groups"``): the global call passes those it was given.
      bytes: its traffic model, ``bytes(sizes, **shape) -> bytes one device sends``
        (:func:`comm_bytes`).
      num_seq_axes: how many sequence axes it runs over: 1, or 2 (``(outer, inner)``: the
        ring over the outer, Ulysses over the inner).
      splits_heads: whether it splits heads over its (inner) axis, whose size must then
        divide the query heads (K/V heads are replicated up to it).
      zigzag_balances: whether the zigzag order balances its causal work (a ring's
        steps); Ulysses attends the whole sequence on every device: balanced already.
      global_view: whether :func:`jax_seqpar.sequence_parallel_attention` runs it
        (decode runs against a KV cache: :mod:`jax_seqpar.api.inference`).
      pieces: ``pieces(shape, ring, ulysses) -> (forward, backward)``: into how many
        pieces its ``head_groups`` / ``chunks="auto"`` cut the forward's and the
        backward's exchanges of a :class:`~jax_seqpar.core.shape.LayerShape` over
        ``ring x ulysses`` devices (:meth:`factorization`; the hybrid's: its inner
        all-to-alls), so
        that each piece after the first travels while a kernel works on an earlier one
        (None: each exchange whole, before or after the kernels); Ulysses' sequence
        pieces count as the equal pieces that leave the same share exposed. The ring's
        hops are its own pieces (one per step).
    """

    name: Literal[StrategyName, "decode"]
    attention: Callable
    attend: Callable
    bytes: Callable
    num_seq_axes: int = 1
    splits_heads: bool = False
    zigzag_balances: bool = False
    global_view: bool = True
    pieces: Optional[Callable] = None
    pipelining: tuple[str, ...] = ()

    def factorization(self, devices: int, ulysses: int) -> tuple[int, int]:
        """``(ring, ulysses)`` devices of this strategy over ``devices`` (``ulysses``: the
        inner group of a two-axis strategy)."""
        if self.num_seq_axes == 2:
            return devices // ulysses, ulysses
        return (1, devices) if self.splits_heads else (devices, 1)


def _ulysses_pieces(shape, ring: int, ulysses: int, *, hybrid: bool = False) -> int:
    """The pieces of Ulysses' exchange over ``ulysses`` devices (the hybrid's inner one,
    beside a ring of ``ring``) as ``overlap="auto"`` cuts them
    (:func:`heads.resolve_pieces`).

    Sequence chunks (:func:`heads.chunk_sizes`) leave the first query and K/V pieces and
    the last output piece exposed, ``1/2^(c-1)`` of the bytes: as many as ``2^(c-1)``
    equal pieces. The hybrid chunks unless a window makes its ring a halo exchange
    (the window's default order is the contiguous split).
    Head groups where each group has its own K/V heads; 1 where K/V heads are shared by
    several groups: they travel whole ahead of group 0 and only parts of q and out hide
    (a third of the bytes at 2 query heads and 1 K/V head a device, compiled), which the
    pieces model would overstate."""
    if ulysses == 1:
        return 1
    local_len = -(-shape.seq_len // (ring * ulysses))
    halo_ring = hybrid and ring_is_halo(MaskSpec.make(shape.causal, shape.window),
                                        shape.seq_len // ring, ring)
    chunks, groups = heads.resolve_pieces(
        "auto", "auto", "auto", shape.num_heads, shape.num_kv_heads, ulysses, local_len,
        shared_kv=not hybrid, chunked=not halo_ring)
    if chunks > 1:
        return 2 ** (chunks - 1)
    _, kv_local = heads.local_head_counts(shape.num_heads, shape.num_kv_heads, ulysses)
    return groups if kv_local % groups == 0 else 1


_PIPELINING = ("overlap", "chunks", "head_groups")

#: The name of a strategy the global entry point runs (``strategy=``; the entry points
#: add ``"auto"``), in the order tables list them.
StrategyName = Literal["ulysses", "ring", "allgather", "hybrid"]

_ENTRIES = {s.name: s for s in (
    Strategy("ulysses", ulysses.ulysses_attention, ulysses.attend, traffic.ulysses_bytes,
             splits_heads=True, pipelining=_PIPELINING,
             pieces=lambda shape, ring, ulysses: (_ulysses_pieces(shape, ring, ulysses),) * 2),
    Strategy("ring", ring.ring_attention, ring.attend, traffic.ring_bytes,
             zigzag_balances=True),
    # forward: K/V gathered in chunks; backward: dK/dV passed around the ring, a hop a piece
    Strategy("allgather", allgather.allgather_attention, allgather.attend,
             traffic.allgather_bytes, zigzag_balances=True, pipelining=("chunks",),
             pieces=lambda shape, ring, ulysses: (
                 allgather.default_chunks(-(-shape.seq_len // ring)), ring)),
    Strategy("hybrid", hybrid.hybrid_attention, hybrid.attend, traffic.hybrid_bytes,
             num_seq_axes=2, splits_heads=True, zigzag_balances=True, pipelining=_PIPELINING,
             pieces=lambda shape, ring, ulysses: (
                 _ulysses_pieces(shape, ring, ulysses, hybrid=True),) * 2),
)}
#: Every strategy the global entry point runs, by :data:`StrategyName`.
STRATEGIES: Mapping[StrategyName, Strategy] = {name: _ENTRIES[name]
                                      for name in typing.get_args(StrategyName)}

#: Attention of new tokens to a sequence-sharded KV cache (forward only).
DECODE = Strategy("decode", decode_attention, decode_attention, traffic.decode_bytes,
                  global_view=False)


def get(name: str) -> Strategy:
    """The strategy called ``name`` (:data:`STRATEGIES` or ``"decode"``)."""
    if name == DECODE.name:
        return DECODE
    if name not in STRATEGIES:
        raise ValueError(f"strategy={name!r} is not one of {tuple(STRATEGIES)}.")
    return STRATEGIES[typing.cast(StrategyName, name)]  # checked just above


def default_layout(strategy: StrategyName, spec: MaskSpec = MaskSpec(), *,
                   seq_len: int | None = None,
                   num_shards: int | None = None) -> Literal["contiguous", "zigzag"]:
    """The token order ``layout="auto"`` uses: balance and locality.

    A window bounds every query's keys, so work per query is (nearly) the same
    everywhere and the contiguous split is balanced; it is also the only order
    whose shards are local, where the ring and the all-gather exchange just a
    halo. Without a window, zigzag where it balances causal work
    (:attr:`Strategy.zigzag_balances`); everything else is contiguous.

    Args:
      strategy: a name of :data:`STRATEGIES`.
      spec: the mask (its ``causal`` and ``window`` decide).
      seq_len, num_shards: when both are given, a window that reaches (nearly)
        every shard (no halo, see :func:`jax_seqpar.strategies.halo.halo_sizes`)
        counts as no window.
    Returns:
      ``"contiguous"`` or ``"zigzag"``.

    >>> default_layout("ring", MaskSpec.make(causal=True, window=(4096, 0)))
    'contiguous'
    >>> default_layout("ring", MaskSpec(causal=True))
    'zigzag'
    """
    if spec.window is not None:
        if seq_len is None or num_shards is None:
            return "contiguous"
        if halo_sizes(spec, seq_len // num_shards, num_shards) is not None:
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


def comm_bytes(strategy: Literal[StrategyName, "decode"], *, batch: int, seq_len: int,
               num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
               axis_sizes: int | tuple[int, ...] | Mapping[str, int], dtype_bytes: float = 2,
               backward: bool = False, with_segment_ids: bool = False,
               window: int | tuple[int, int] | None = None, causal: bool = False) -> float:
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

    Args:
      strategy: a name of :data:`STRATEGIES`.
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
      causal: only matters with a window (a causal window reaches no later shard).

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
    return float(entry.bytes(sizes, backward=backward, with_segment_ids=with_segment_ids,
                             spec=MaskSpec.make(causal, window), **shape))
