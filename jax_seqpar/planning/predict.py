"""Predicted time and memory of every way to split one attention layer over a mesh: the
package's one time model (the planner ranks by it; :mod:`.projection` reports it for
large meshes).

A candidate is a strategy and a factorization of the sequence devices
``P = ring x ulysses``: ``ulysses`` is ``1 x P``, ``ring`` and ``allgather``
``P x 1``, and ``hybrid`` every ``O x I`` with ``1 < I < P`` dividing the query
heads (USP, arXiv:2405.07719): Ulysses over ``I`` neighbouring devices, the
ring over the ``O`` groups. One mesh axis can be split that way (see
:func:`jax_seqpar.core.meshes.split_axis`), so the hybrid is not limited to the
mesh's own two axes.

Per layer (a :class:`~jax_seqpar.core.shape.LayerShape`), forward + backward, on one
device (:class:`~jax_seqpar.planning.hardware.Hardware` figures):

* compute: attention FLOPs ``2 B H (Dqk + Dv)`` per visible (query, key) pair,
  the backward ``(3 Dqk + 2 Dv) / (Dqk + Dv)`` times the forward (a pipeline's calls
  that read only dq or only dK/dV at the products they compute), causal and
  window masks counting only visible pairs, in whole tiles of ``tile`` tokens (a
  kernel fact, not the layer's) on the busiest device of every ring step (zigzag
  balances causal rings; Ulysses is balanced by construction), each kernel call of a
  pipeline in sequence pieces in the token order its all-to-alls give it
  (:mod:`jax_seqpar.planning.compute`), at
  ``peak_flops * attention_efficiency``. Packed documents (``segment_ids=`` of a
  representative batch, in the batch's ``layout``) are counted as the kernels
  compute them: tiles classified per row
  (:func:`jax_seqpar.core.work.computed_tiles_per_shard`), the busiest device's count,
  not the mean;
* which transfers hide behind a kernel is what the target's compiled programs show
  (:attr:`~jax_seqpar.planning.hardware.Hardware.overlaps`: the collective kinds a kernel can hide) for the way the
  strategy sends them (its pieces, :attr:`~jax_seqpar.strategies.entry.Strategy.pieces`);
* the ring: ``O`` steps of ``max(compute, hop) + latency`` (``compute + hop +
  latency`` where the target does not overlap collective-permutes), hops of the bytes
  :func:`jax_seqpar.comm_bytes` counts: ``O - 1`` K/V rotations forward,
  ``O - 1`` steps carrying K/V and float32 dK/dV backward and dK/dV's hop home,
  on the link the ring's slowest hop takes (:meth:`~jax_seqpar.planning.hardware.Hardware.link`);
  where a window or chunks bound the mask's reach over the ring's groups
  (:func:`jax_seqpar.core.reach.mask_reach`, the contiguous order), a halo exchange:
  its bytes in flight during the own block's kernel, then the halo's kernel (backward:
  the halo's gradients, then dK/dV back during the own block's), nothing at all where
  the reach is ``(0, 0)``;
* all-to-all and all-gather: ``bytes / bandwidth`` plus one latency per step: an
  ``all_to_all`` is one step, an ``all_gather`` or ``psum_scatter`` ``P - 1`` (ring
  algorithm, as NCCL runs them); per pass (forward, backward) added to the pass's
  compute, or, where the strategy sends them in ``n > 1`` pieces and the target
  overlaps their kind, ``t / n + max(compute, t (n - 1) / n)`` (the first piece
  waits, the rest travel under the kernels). The hybrid's inner all-to-alls, in
  pieces, hide behind its ring's first and last steps (what exceeds those steps'
  kernels waits). Ulysses sends
  4 all-to-alls a pass (q, k, v, out; dout, dq, dk, dv) and all-gathers the int32
  positions (and segment ids); the all-gather strategy gathers K, V and positions
  (and segment ids) and passes dK/dV around the ring (a collective-permute a hop). A
  group that spans domains sends the share bound for other domains,
  ``(size - D) / (size - 1)``, on the slow link while the rest goes on the fast one;
* memory: q, k, v, out and their gradients, Ulysses' K/V heads replicated to
  ``lcm(Hkv, I)``, the ring's K/V and float32 dK/dV in flight, all-gather's
  O(S) K/V and its cotangent, float32 accumulators and score tiles.

Bytes always come from :func:`~jax_seqpar.comm_bytes` (tests hold it
against the compiled HLO), so this module models time, not traffic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax

from jax_seqpar.core.masks import Tokens
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.planning import hardware as hardware_lib, packed
from jax_seqpar.planning.compute import TILE, step_seconds
from jax_seqpar.planning.hardware import Hardware
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.core.reach import mask_reach
from jax_seqpar.strategies.registry import StrategyName, comm_bytes
from jax_seqpar.core.layout import LayoutName

__all__ = ["TILE", "Candidate", "candidates", "predict"]

@dataclasses.dataclass(frozen=True)
class Candidate:
    """A strategy over ``ring x ulysses`` devices (``label`` names it in a plan)."""

    strategy: StrategyName
    ring: int
    ulysses: int

    @property
    def label(self) -> str:
        if registry.get(self.strategy).num_seq_axes == 2:
            return f"{self.strategy} {self.ring}x{self.ulysses}"
        return self.strategy


def candidates(devices: int, num_heads: int) -> list[Candidate]:
    """Every registered strategy and factorization of ``devices`` the heads allow: a
    two-axis strategy over every ``O x I`` with ``1 < I < P`` dividing the heads."""
    found = []
    for name, strategy in registry.STRATEGIES.items():
        if strategy.num_seq_axes == 2:
            found += [Candidate(name, devices // inner, inner)
                      for inner in range(2, devices)
                      if devices % inner == 0 and num_heads % inner == 0]
        elif not strategy.splits_heads or num_heads % devices == 0:
            found.append(Candidate(name, *strategy.factorization(devices, 1)))
    return found


def _comm_bytes(strategy, shape: LayerShape, axis_sizes):
    """:func:`~jax_seqpar.comm_bytes` of ``shape`` over ``axis_sizes``."""
    return comm_bytes(strategy, axis_sizes=axis_sizes, **shape.comm_kwargs())


def _collective(hardware: Hardware, num_bytes: float, size: int,
                steps: int) -> tuple[float, float, float]:
    """``(seconds, ici_bytes, dcn_bytes)`` of an all-to-all style collective over ``size``
    consecutive devices, not overlapped.

    Within one domain it runs at the fast link's collective bandwidth; across
    domains the share bound for other domains, ``(size - D) / (size - 1)``,
    goes on the slow link while the rest goes on the fast one.
    """
    if size == 1 or num_bytes == 0:
        return 0.0, 0.0, 0.0
    link = hardware.link(size)
    if link is hardware.ici:
        return link.seconds(num_bytes, steps, collective=True), num_bytes, 0.0
    local = min(hardware.devices_per_domain, size)
    remote = num_bytes * (size - local) / (size - 1)
    seconds = steps * link.latency + max(
        (num_bytes - remote) / hardware.ici.collective_bandwidth,
        remote / hardware.dcn.collective_bandwidth)
    return seconds, num_bytes - remote, remote


def _ring(hardware: Hardware, link, compute: list, hop_bytes: float,
          home_bytes: Optional[float] = None, *,
          home_hides: bool = False) -> tuple[float, float, float]:
    """``(seconds, comm_seconds, hidden_bytes)`` of ring steps of ``compute[i]`` seconds
    each: every step but the last sends a hop of ``hop_bytes``; the backward's last hop,
    ``home_bytes`` (dK/dV alone), brings the accumulators back after it (a ring of one
    has no hop; ``home_hides``: the trip home travels during the last step's own
    kernels, as the hybrid's query pieces run them). ``comm_seconds``: the hops alone;
    ``hidden_bytes``: those sent while a step's kernel computes."""
    overlaps = "collective-permute" in hardware.overlaps
    seconds = comm = hidden = 0.0
    for index, step in enumerate(compute):
        last = index == len(compute) - 1
        if last and (home_bytes is None or len(compute) == 1):
            seconds += step
            continue
        if not (home_bytes if last else hop_bytes):  # the mask's reach: nothing travels
            seconds += step
            continue
        hop = (home_bytes if last else hop_bytes) / link.bandwidth
        comm += hop + link.latency
        if (last and not home_hides) or not overlaps:  # home after the last step
            seconds += step + hop + link.latency
        else:
            seconds += max(step, hop) + link.latency
            hidden += home_bytes if last and home_bytes is not None else hop_bytes
    return seconds, comm, hidden


def _halo(hardware: Hardware, link, compute_fwd: list, compute_bwd: list, fwd_bytes: float,
          bwd_bytes: float) -> tuple[float, float, float]:
    """``(seconds, comm_seconds, hidden_bytes)`` of a ring that is a halo exchange
    (:mod:`jax_seqpar.strategies.halo`): forward, the halo's K/V travel while the own
    block's kernel (``compute_fwd[0]``) runs, then the halo's kernel (the other steps'
    compute); backward, the halo's gradients first (``compute_bwd[1:]``), then their
    float32 dK/dV travel back while the own block's backward runs. Nothing sent, no
    latency (a reach of ``(0, 0)``)."""
    overlaps = "collective-permute" in hardware.overlaps
    seconds = comm = hidden = 0.0
    for own, halo_compute, num_bytes in ((compute_fwd[0], sum(compute_fwd[1:]), fwd_bytes),
                                         (compute_bwd[0], sum(compute_bwd[1:]), bwd_bytes)):
        hop = num_bytes / link.bandwidth + link.latency if num_bytes else 0.0
        comm += hop
        if overlaps and num_bytes:
            seconds += halo_compute + max(own, hop)
            hidden += num_bytes
        else:
            seconds += halo_compute + own + hop
    return seconds, comm, hidden


def _exchange(hardware: Hardware, entry: Strategy, shape: LayerShape, devices: int,
              compute: tuple) -> dict:
    """An exchange strategy (:attr:`~jax_seqpar.strategies.entry.Strategy.exchanges`:
    Ulysses, the all-gather) over ``devices``: per pass (``compute``: its forward and
    backward kernel seconds), the pass's collectives and its kernels, overlapped where
    the strategy sends them in pieces and the target overlaps their kind."""
    steps, kinds = _exchange_model(entry)
    pieces = (entry.pieces(shape, *entry.factorization(devices, devices))
              if entry.pieces and devices > 1 else (1, 1))
    forward = shape.replace(backward=False)
    fwd_bytes = _comm_bytes(entry.name, forward, devices)
    passes = [(fwd_bytes, steps(devices, forward), compute[0], kinds[0], pieces[0])]
    if shape.backward:
        passes.append((_comm_bytes(entry.name, shape, devices) - fwd_bytes,
                       steps(devices, shape) - steps(devices, forward), compute[1],
                       kinds[1], pieces[1]))
    out = dict(seconds=0.0, comm=0.0, hidden_bytes=0.0, ici_bytes=0.0, dcn_bytes=0.0)
    for num_bytes, num_steps, kernels, kind, n in passes:
        comm, ici_bytes, dcn_bytes = _collective(hardware, num_bytes, devices, num_steps)
        if n > 1 and kind in hardware.overlaps:
            rest = (n - 1) / n
            out["seconds"] += comm / n + max(kernels, comm * rest)
            out["hidden_bytes"] += num_bytes * rest
        else:
            out["seconds"] += kernels + comm
        out["comm"] += comm
        out["ici_bytes"] += ici_bytes
        out["dcn_bytes"] += dcn_bytes
    return out


def _seconds(candidate: Candidate, shape: LayerShape, hardware: Hardware, tile: int,
             documents=None) -> dict:
    ring, inner = candidate.ring, candidate.ulysses
    entry = registry.get(candidate.strategy)
    devices = ring * inner
    sizes = (ring, inner) if entry.num_seq_axes == 2 else devices
    compute_fwd, compute_bwd = step_seconds(entry, ring, inner, shape, hardware, tile,
                                            documents)
    compute = sum(compute_fwd) + sum(compute_bwd)
    total_bytes = _comm_bytes(entry.name, shape, sizes)
    if entry.exchanges is not None:
        out = _exchange(hardware, entry, shape, devices, (sum(compute_fwd), sum(compute_bwd)))
        seconds, comm, hidden = out["seconds"], out["comm"], out["hidden_bytes"]
        ici_bytes, dcn_bytes = out["ici_bytes"], out["dcn_bytes"]
    else:  # a ring (the hybrid's: its inner part's exchange over the group, then its steps)
        forward = shape.replace(backward=False)
        inner_entry = _inner(entry) if inner > 1 else None
        exchange_bytes = fwd_exchange = 0.0
        if inner_entry is not None:
            inner_shape = shape.replace(seq_len=shape.seq_len // ring)
            exchange_bytes = _comm_bytes(inner_entry.name, inner_shape, inner)
            fwd_exchange = _comm_bytes(inner_entry.name, inner_shape.replace(backward=False),
                                       inner)
        fwd_ring = _comm_bytes(entry.name, forward, sizes) - fwd_exchange
        bwd_ring = total_bytes - exchange_bytes - fwd_ring
        link = hardware.link(ring, inner)
        kv_hop = fwd_ring / max(ring - 1, 1)
        # The inner exchange in pieces (the hybrid's default) travels during the ring's
        # first and last steps, all but one piece's share hidden; dK/dV's trip home then
        # travels during the last step's query pieces.
        n = entry.pieces(shape, ring, inner)[0] if entry.pieces and inner_entry else 1
        # The mask's reach bounds the ring (its default order is the contiguous split):
        # a halo exchange, in flight during the own block's kernel.
        is_halo = ring > 1 and mask_reach(shape.mask, shape.seq_len // ring, ring) is not None
        if is_halo:
            seconds, comm, hidden = _halo(hardware, link, compute_fwd, compute_bwd,
                                          fwd_ring, bwd_ring if shape.backward else 0.0)
        else:
            seconds, comm, hidden = _ring(hardware, link, compute_fwd, kv_hop)
        if shape.backward and not is_halo:  # P - 1 hops of K/V and dK/dV, then dK/dV home
            dkv_hop = max(bwd_ring - (ring - 1) * kv_hop, 0.0) / ring
            bwd_seconds, bwd_comm, bwd_hidden = _ring(hardware, link, compute_bwd,
                                                      kv_hop + dkv_hop, home_bytes=dkv_hop,
                                                      home_hides=n > 1)
            seconds, comm, hidden = seconds + bwd_seconds, comm + bwd_comm, hidden + bwd_hidden
        ici_bytes = dcn_bytes = 0.0
        passes = []
        if inner_entry is not None:
            steps, kinds = _exchange_model(inner_entry)
            passes.append((fwd_exchange, steps(inner, forward), compute_fwd, kinds[0]))
            if shape.backward:
                passes.append((exchange_bytes - fwd_exchange,
                               steps(inner, shape) - steps(inner, forward), compute_bwd,
                               kinds[1]))
        for num_bytes, num_steps, steps_compute, kind in passes:
            exchange, ici, dcn = _collective(hardware, num_bytes, inner, num_steps)
            ici_bytes, dcn_bytes, comm = ici_bytes + ici, dcn_bytes + dcn, comm + exchange
            if n > 1 and kind in hardware.overlaps:
                rest = (n - 1) / n
                ends = steps_compute[0] + (steps_compute[-1] if len(steps_compute) > 1 else 0)
                seconds += exchange / n + max(0.0, exchange * rest - ends)
                hidden += num_bytes * rest
            else:
                seconds += exchange
        if link is hardware.ici:
            ici_bytes += fwd_ring + bwd_ring
        else:
            dcn_bytes += fwd_ring + bwd_ring
    return dict(seconds=seconds, compute_seconds=compute, comm_seconds=comm,
                exposed_comm_seconds=seconds - compute, bytes=total_bytes,
                hidden_bytes=hidden, ici_bytes=ici_bytes, dcn_bytes=dcn_bytes)


def _exchange_model(entry: Strategy) -> tuple:
    """``(exchange_steps, exchanges)`` of an exchange strategy; ``ValueError`` for one
    without them (:class:`~jax_seqpar.strategies.entry.Strategy` refuses one alone)."""
    if entry.exchange_steps is None or entry.exchanges is None:
        raise ValueError(f"strategy {entry.name!r} is modelled as an exchange but names no "
                         f"exchanges={entry.exchanges!r} / exchange_steps="
                         f"{entry.exchange_steps!r}.")
    return entry.exchange_steps, entry.exchanges


def _inner(entry: Strategy) -> Optional[Strategy]:
    """The strategy a two-axis ``entry`` runs over its inner axis (its ``parts[1]``), whose
    exchange travels around the ring; None for a one-axis strategy."""
    if entry.parts is None:
        return None
    inner = registry.get(entry.parts[1])
    if inner.exchanges is None:
        raise ValueError(f"strategy {entry.name!r} runs {inner.name!r} over its inner axis, "
                         f"which has no exchange to model (Strategy.exchanges).")
    return inner


def _memory(candidate: Candidate, shape: LayerShape, tile: int) -> float:
    """Per-device bytes the layer holds at its peak (forward + backward)."""
    b, s, h, h_kv = shape.batch, shape.seq_len, shape.num_heads, shape.num_kv_heads
    d_qk, d_v, size = shape.head_dim, shape.v_head_dim or shape.head_dim, shape.dtype_bytes
    devices = candidate.ring * candidate.ulysses
    local = b * s / devices  # batch x local tokens
    grads = 2 if shape.backward else 1
    q_o = h * (d_qk + d_v)
    kv = h_kv * (d_qk + d_v)
    memory = local * (grads * (q_o + kv) * size + h * 4)  # q, k, v, out (+ grads), lse
    heads, kv_heads, tokens = h, h_kv, local
    if candidate.ulysses > 1:
        inner = candidate.ulysses
        kv_heads = math.lcm(h_kv, inner) // inner
        heads = h // inner
        tokens = local * inner  # [B, S/O, H/I, D] after the all-to-all
        memory += grads * tokens * (heads * (d_qk + d_v) + kv_heads * (d_qk + d_v)) * size
        memory += b * s / candidate.ring * 4  # gathered int32 positions
    kv_memory = registry.get(candidate.strategy).kv_memory
    if kv_memory is not None:  # the strategy's own: a ring's K/V in flight, gathered K/V
        memory += kv_memory(shape, candidate.ring, candidate.ulysses)
    memory += tokens * heads * (d_v + (d_qk if shape.backward else 0)) * 4  # f32 carries
    memory += b * heads * min(tile, s) ** 2 * 4 * (4 if shape.backward else 2)  # score tiles
    return float(memory)


def predict(candidate: Candidate, shape: LayerShape, hardware: Hardware | str | None, *,
            tile: int = TILE, segment_ids: jax.Array | None = None,
            layout: Optional[LayoutName] = None,
            bidirectional_ids: jax.Array | None = None) -> dict:
    """One layer's predicted time, broken down, and memory for ``candidate`` on ``hardware``.

    Args:
      candidate: a strategy over ``ring x ulysses`` devices (:func:`candidates`).
      shape: the layer; ``shape.backward`` counts the backward too, ``shape.chunk_size``
        chunked attention (its reach bounds the bytes, its tiles the compute).
      hardware: a :class:`~jax_seqpar.planning.hardware.Hardware` or a preset name.
      tile: tokens per kernel tile, each side (whole tiles are computed).
      segment_ids: ``int[B', S]`` natural-order document ids of a representative batch
        (packed documents), or None: one document per row. With them, compute is the
        busiest device's computed tiles at every ring step, each tile classified per
        row (causal within documents), as the kernels compute them.
      layout: the batch's token order (:data:`jax_seqpar.core.layout.LAYOUTS`), or None: the package's default
        (:func:`jax_seqpar.strategies.registry.default_layout`: zigzag for causal rings,
        hybrids and all-gathers whose mask's reach is not bounded; else contiguous).
        ``"per_document"`` needs ``segment_ids`` and is laid out with ``tile``.
      bidirectional_ids: ``int[B', S]`` natural-order ids of the same batch (a
        prefix-LM prompt, an image: tokens that see each other both ways under a causal
        mask), or None. With them (or ``shape.chunk_size``), compute counts that mask,
        and ``"per_document"`` is balanced by it.

    Returns:
      A dict, per device:

      * ``seconds``: the layer's forward (+ backward), overlap included;
      * ``compute_seconds``: its attention compute (busiest device, whole tiles);
      * ``comm_seconds``: every collective's ``latency + bytes / bandwidth``, as if
        nothing overlapped;
      * ``exposed_comm_seconds``: ``seconds - compute_seconds``, the communication
        not hidden behind compute;
      * ``bytes``: what it sends (:func:`jax_seqpar.comm_bytes`), of which
        ``ici_bytes`` on the fast link class and ``dcn_bytes`` on the slow one, and
        ``hidden_bytes`` sent while a kernel computes (as
        :func:`jax_seqpar.tools.schedule.bytes_hidden` counts them in a compiled program);
      * ``memory``: its peak bytes.

    Raises:
      ValueError: the candidate cannot run the layer (heads, divisibility), with
        :func:`jax_seqpar.comm_bytes`' message.

    >>> shape = LayerShape(1, 32768, 32, 8, 128, causal=True)
    >>> result = predict(Candidate("ring", 8, 1), shape, "h100")
    >>> result["seconds"] >= result["compute_seconds"]
    True
    """
    hardware = hardware_lib.get(hardware)
    spec = shape.mask
    documents = packed.documents(shape, Tokens(None, segment_ids, bidirectional_ids), layout,
                                 spec)
    result = _seconds(candidate, shape, hardware, tile, documents)
    result["memory"] = _memory(candidate, shape, tile)
    return result

