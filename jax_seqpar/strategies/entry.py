"""What the package knows of one strategy, as one record: :class:`Strategy`.

Each strategy module builds its own entry at its end (``ulysses.ENTRY``, ``ring.ENTRY``,
...) from its per-shard function and its models; :mod:`.registry` lists the entries and
the API, the planner, the bench and the CLI read them, never a strategy's name. This
module imports no strategy module, so every strategy module can import it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.strategies.pieces import KernelCall

__all__ = ["Strategy"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to split attention over the sequence devices.

    The time and memory model (:mod:`jax_seqpar.planning.predict`) and the compute model
    (:mod:`jax_seqpar.planning.compute`, :mod:`jax_seqpar.planning.packed`) read the
    fields below; a strategy's own terms (its bytes, steps, pieces, memory) are functions
    of plain numbers and :class:`~jax_seqpar.core.shape.LayerShape`, written in its module.

    Attributes:
      name: what ``strategy=`` takes.
      attention: the public per-shard function, ``attention(q, k, v, *, seq_axes,
        ...)`` inside ``jax.shard_map``.
      attend: its core on described inputs, ``attend(q, k, v, options, metadata, *,
        seq_axes, **pipelining)`` (``options``: the call's
        :class:`~jax_seqpar.kernels.options.Options`; ``metadata``: its checked local
        :class:`~jax_seqpar.strategies.inputs.Metadata`): what the global view runs.
        None: the strategy runs only per shard (the global view refuses it).
      pipelining: the keywords of ``attend`` beyond ``seq_axes`` (``"overlap"``,
        ``"pieces"``, ``"head_groups"``): the global call passes those it was given.
      bytes: its traffic model, ``bytes(sizes, *, batch, seq_len, num_heads,
        num_kv_heads, head_dim, v_head_dim, dtype_bytes, backward, with_segment_ids,
        spec) -> bytes one device sends`` over ``sizes`` (devices per sequence axis;
        ``spec`` the :class:`~jax_seqpar.core.masks.MaskSpec` of causality and window),
        read by :func:`~jax_seqpar.strategies.registry.comm_bytes`; it raises
        ``ValueError`` where the strategy cannot run the layer.
      num_seq_axes: how many sequence axes it runs over: 1, or 2 (``(outer, inner)``:
        the ``parts[0]`` strategy over the outer, ``parts[1]`` over the inner).
      splits_heads: whether it splits heads over its (inner) axis, whose size must then
        divide the query heads (K/V heads are replicated up to it).
      zigzag_balances: its default token order: whether the zigzag order balances its
        causal work (a ring's steps; else the contiguous split). Ulysses attends the
        whole sequence on every device: balanced already.
      global_view: whether :func:`jax_seqpar.sequence_parallel_attention` runs it
        (decode runs against a KV cache: :mod:`jax_seqpar.api.inference`); only such
        strategies are the planner's candidates.
      pieces: ``pieces(shape, ring, ulysses) -> (forward, backward)``: into how many
        pieces its ``head_groups`` / ``pieces="auto"`` cut the forward's and the
        backward's exchanges of a :class:`~jax_seqpar.core.shape.LayerShape` over
        ``ring x ulysses`` devices (:meth:`factorization`; a two-axis strategy's: its
        inner exchange), so that each piece after the first travels while a kernel
        works on an earlier one (None: each exchange whole, before or after the
        kernels); Ulysses' sequence pieces count as the equal pieces that leave the same
        share exposed. A ring's hops are its own pieces (one per step).
      preference: its rank in the planner's choice by bytes (no hardware): the fewest
        bytes win, the lower rank on a tie; None: never chosen by bytes (the
        all-gather: its K/V memory is O(S)).
      parts: a two-axis strategy's ``(outer, inner)`` strategies, by name (the hybrid:
        the ring over the outer axis, Ulysses over the inner); the time model takes the
        inner's exchange (its bytes, steps, collective kinds) around the outer's ring.
      exchanges: the collective kinds (HLO names, as
        :attr:`jax_seqpar.planning.hardware.Hardware.overlaps` lists them) of the
        exchange it sends around its kernels, ``(forward, backward)``: Ulysses'
        all-to-alls, the all-gather's gather and dK/dV hops. None: K/V travel a
        ``ppermute`` hop per ring step over its ``ring`` factor, each behind that step's
        kernel (the ring; the hybrid's outer ring, its inner exchange its ``parts[1]``'s).
      exchange_steps: ``exchange_steps(size, shape) -> int``: latency steps of that
        exchange over ``size`` devices (forward, plus backward where ``shape.backward``);
        set with ``exchanges``.
      gathers_kv: the compute model's view of its kernels: each device attends its own
        query shard to every key in one step (K/V gathered: the all-gather). False: a
        ring group's tokens (all the sequence after a head split over all devices) attend
        to the group's K/V ring step by ring step.
      kernel_calls: ``kernel_calls(shape, ring, ulysses, shards, group)``: the kernel
        calls of ring group ``group`` per ring step (lists of
        :class:`~jax_seqpar.strategies.pieces.KernelCall`) where its pipeline cuts the
        exchange into sequence pieces, whose gathered token order interleaves the devices
        (``shards``: ``int[P, L]`` positions of the devices' tokens, in device order); the
        compute model counts its tiles call by call. None (the field, or its result): a
        device attends in its group's device order, one call a ring step.
      kv_memory: ``kv_memory(shape, ring, ulysses) -> bytes`` per device of the K/V (and
        K/V gradients) it holds beyond the layer's own arrays, over ``ring x ulysses``
        devices (the ring's block in flight and dK/dV accumulators, the all-gather's
        gathered K/V); None: nothing more.
    """

    name: str
    attention: Callable
    bytes: Callable[..., float]
    num_seq_axes: int = 1
    splits_heads: bool = False
    zigzag_balances: bool = False
    global_view: bool = True
    pieces: Optional[Callable[[LayerShape, int, int], tuple[int, int]]] = None
    preference: Optional[int] = None
    parts: Optional[tuple[str, str]] = None
    exchanges: Optional[tuple[str, str]] = None
    exchange_steps: Optional[Callable[[int, LayerShape], int]] = None
    gathers_kv: bool = False
    kv_memory: Optional[Callable[[LayerShape, int, int], float]] = None
    kernel_calls: Optional[Callable[..., Optional[list[list[KernelCall]]]]] = None
    attend: Optional[Callable] = None
    pipelining: tuple[str, ...] = ()

    def __post_init__(self):
        if self.num_seq_axes not in (1, 2):
            raise ValueError(f"Strategy {self.name!r}: num_seq_axes must be 1 or 2. Got "
                             f"{self.num_seq_axes!r}.")
        if (self.num_seq_axes == 2) != (self.parts is not None):
            raise ValueError(f"Strategy {self.name!r}: a two-axis strategy names its "
                             f"(outer, inner) parts, and only it. Got num_seq_axes="
                             f"{self.num_seq_axes}, parts={self.parts!r}.")
        if (self.exchanges is None) != (self.exchange_steps is None):
            raise ValueError(f"Strategy {self.name!r}: exchanges and exchange_steps come "
                             f"together (the collectives and their latency steps).")

    def factorization(self, devices: int, ulysses: int) -> tuple[int, int]:
        """``(ring, ulysses)`` devices of this strategy over ``devices`` (``ulysses``: the
        inner group of a two-axis strategy)."""
        if self.num_seq_axes == 2:
            return devices // ulysses, ulysses
        return (1, devices) if self.splits_heads else (devices, 1)
