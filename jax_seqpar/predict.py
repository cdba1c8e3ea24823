"""Predicted time and memory of every way to split one attention layer over a mesh.

A candidate is a strategy and a factorization of the sequence devices
``P = ring x ulysses``: ``ulysses`` is ``1 x P``, ``ring`` and ``allgather``
``P x 1``, and ``hybrid`` every ``O x I`` with ``1 < I < P`` dividing the query
heads (USP, arXiv:2405.07719): Ulysses over ``I`` neighbouring devices, the
ring over the ``O`` groups. One mesh axis can be split that way (see
:func:`jax_seqpar.meshes.split_axis`), so the hybrid is not limited to the
mesh's own two axes.

Per layer, forward + backward, on one device (:class:`Hardware` figures):

* compute: attention FLOPs ``2 B H (Dqk + Dv)`` per visible (query, key) pair,
  the backward ``(3 Dqk + 2 Dv) / (Dqk + Dv)`` times the forward, causal and
  window masks counting only visible pairs, split evenly over the ``P`` devices
  (zigzag balances causal rings; Ulysses is balanced by construction), at
  ``peak_flops * attention_efficiency``;
* the ring: ``O`` steps of ``max(compute, hop) + latency`` (``compute + hop +
  latency`` where the hardware cannot overlap), hops of the bytes
  :func:`jax_seqpar.plan.comm_bytes` counts: ``O - 1`` K/V rotations forward,
  ``O`` steps carrying K/V and float32 dK/dV backward;
* all-to-all and all-gather: not overlapped, ``bytes / bandwidth`` plus one
  latency per collective (``P - 1`` for all-gather / reduce-scatter: ring
  algorithm); a group that spans domains sends its remote share on the slow link;
* memory: q, k, v, out and their gradients, Ulysses' K/V heads replicated to
  ``lcm(Hkv, I)``, the ring's K/V and float32 dK/dV in flight, all-gather's
  O(S) K/V and its cotangent, float32 accumulators and score tiles.

Bytes always come from :func:`~jax_seqpar.plan.comm_bytes` (tests hold it
against the compiled HLO), so this module models time, not traffic.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Optional

from jax_seqpar import plan as planner
from jax_seqpar.hardware import Hardware

__all__ = ["Candidate", "Shape", "candidates", "predict", "visible_pairs"]

_TILE = 256  # the kernels' default tile: score scratch per step
_ALL_TO_ALLS = 9  # q, k, v, out forward; dout, dq, dk, dv backward; positions gather


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention layer: global ``q [batch, seq_len, num_heads, head_dim]``,
    ``k [.., num_kv_heads, head_dim]``, ``v [.., num_kv_heads, v_head_dim]``."""

    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype_bytes: float = 2
    causal: bool = False
    window: Optional[tuple[int, int]] = None
    backward: bool = True

    def traffic(self) -> dict:
        """The shape keywords of :func:`jax_seqpar.plan.comm_bytes`."""
        return dict(batch=self.batch, seq_len=self.seq_len, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    v_head_dim=self.v_head_dim, dtype_bytes=self.dtype_bytes)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A strategy over ``ring x ulysses`` devices (``label`` names it in a plan)."""

    strategy: str
    ring: int
    ulysses: int

    @property
    def label(self) -> str:
        if self.strategy == "hybrid":
            return f"hybrid {self.ring}x{self.ulysses}"
        return self.strategy


def candidates(devices: int, num_heads: int) -> list[Candidate]:
    """Every strategy and factorization of ``devices`` the heads allow."""
    found = [Candidate("ring", devices, 1), Candidate("allgather", devices, 1)]
    if num_heads % devices == 0:
        found.insert(0, Candidate("ulysses", 1, devices))
    for inner in range(2, devices):
        if devices % inner == 0 and num_heads % inner == 0:
            found.append(Candidate("hybrid", devices // inner, inner))
    return found


def visible_pairs(seq_len: int, causal: bool, window: Optional[tuple[int, int]]) -> float:
    """(query, key) pairs a causal and/or ``(left, right)`` window mask keeps (exact)."""
    left = seq_len - 1 if window is None else min(window[0], seq_len - 1)
    right = 0 if causal else (seq_len - 1 if window is None else min(window[1], seq_len - 1))

    def clipped_sum(limit):  # sum over i < seq_len of min(i, limit)
        return limit * (limit + 1) / 2 + (seq_len - 1 - limit) * limit

    return float(seq_len + clipped_sum(left) + clipped_sum(right))


def _comm_bytes(strategy, shape: Shape, axis_sizes, backward):
    """:func:`~jax_seqpar.plan.comm_bytes`, window-aware where it takes a window."""
    extra = {}
    if shape.window is not None and "window" in inspect.signature(
            planner.comm_bytes).parameters:
        extra["window"] = shape.window
    return planner.comm_bytes(strategy, axis_sizes=axis_sizes, backward=backward,
                              **shape.traffic(), **extra)


def _collective_seconds(hardware: Hardware, num_bytes: float, size: int, steps: int) -> float:
    """An all-to-all style collective over ``size`` consecutive devices, not overlapped.

    Within one domain it runs at the fast link's collective bandwidth; across
    domains the share bound for other domains, ``(size - D) / (size - 1)``,
    goes on the slow link while the rest goes on the fast one.
    """
    if size == 1 or num_bytes == 0:
        return 0.0
    link = hardware.link(size)
    if link is hardware.ici:
        return link.seconds(num_bytes, steps, collective=True)
    local = min(hardware.devices_per_domain, size)
    remote = num_bytes * (size - local) / (size - 1)
    return steps * link.latency + max(
        (num_bytes - remote) / hardware.ici.collective_bandwidth,
        remote / hardware.dcn.collective_bandwidth)


def _ring_seconds(hardware: Hardware, link, steps: int, compute: float, hop_bytes: float,
                  hops: int) -> float:
    """``steps`` ring steps of ``compute`` each, ``hops`` of them with a hop of ``hop_bytes``."""
    hop = hop_bytes / link.bandwidth
    if hardware.overlap:
        stepped = max(compute, hop) + link.latency
    else:
        stepped = compute + hop + link.latency
    return hops * stepped + (steps - hops) * compute


def _ring_part(hardware, shape: Shape, ring: int, stride: int, ring_bytes, compute_fwd,
               compute_bwd) -> float:
    """The ring over ``ring`` groups ``stride`` devices apart, forward and backward."""
    link = hardware.link(ring, stride)
    fwd_bytes, bwd_bytes = ring_bytes
    seconds = _ring_seconds(hardware, link, ring, compute_fwd / ring,
                            fwd_bytes / max(ring - 1, 1), ring - 1)
    if shape.backward:
        seconds += _ring_seconds(hardware, link, ring, compute_bwd / ring, bwd_bytes / ring,
                                 ring)
    return seconds


def _seconds(candidate: Candidate, shape: Shape, hardware: Hardware) -> dict:
    devices = candidate.ring * candidate.ulysses
    pairs = visible_pairs(shape.seq_len, shape.causal, shape.window)
    d_qk, d_v = shape.head_dim, shape.v_head_dim
    fwd_flops = 2 * shape.batch * shape.num_heads * (d_qk + d_v) * pairs / devices
    bwd_flops = fwd_flops * (3 * d_qk + 2 * d_v) / (d_qk + d_v) if shape.backward else 0.0
    compute_fwd, compute_bwd = (f / hardware.attention_flops for f in (fwd_flops, bwd_flops))
    compute = compute_fwd + compute_bwd
    total_bytes = _comm_bytes(candidate.strategy, shape, devices if candidate.strategy != "hybrid"
                              else (candidate.ring, candidate.ulysses), shape.backward)
    if candidate.strategy == "ulysses":
        comm = _collective_seconds(hardware, total_bytes, devices,
                                   _ALL_TO_ALLS if shape.backward else 5)
        return dict(seconds=compute + comm, compute=compute, comm=comm, bytes=total_bytes)
    if candidate.strategy == "allgather":
        steps = (devices - 1) * (5 if shape.backward else 3)
        comm = _collective_seconds(hardware, total_bytes, devices, steps)
        return dict(seconds=compute + comm, compute=compute, comm=comm, bytes=total_bytes)
    inner, ring = candidate.ulysses, candidate.ring
    a2a_bytes = 0.0
    if inner > 1:
        inner_shape = dataclasses.replace(shape, seq_len=shape.seq_len // ring)
        a2a_bytes = _comm_bytes("ulysses", inner_shape, inner, shape.backward)
    fwd_total = _comm_bytes(candidate.strategy, shape, (ring, inner) if inner > 1 else ring,
                            False)
    fwd_ring = fwd_total - (_comm_bytes("ulysses", dataclasses.replace(
        shape, seq_len=shape.seq_len // ring), inner, False) if inner > 1 else 0.0)
    ring_bytes = (fwd_ring, total_bytes - a2a_bytes - fwd_ring)
    a2a = _collective_seconds(hardware, a2a_bytes, inner, _ALL_TO_ALLS if shape.backward else 5)
    if ring == 1:
        ring_time = compute
    else:
        ring_time = _ring_part(hardware, shape, ring, inner, ring_bytes, compute_fwd,
                               compute_bwd)
    return dict(seconds=a2a + ring_time, compute=compute, comm=a2a + ring_time - compute,
                bytes=total_bytes)


def _memory(candidate: Candidate, shape: Shape) -> float:
    """Per-device bytes the layer holds at its peak (forward + backward)."""
    b, s, h, h_kv = shape.batch, shape.seq_len, shape.num_heads, shape.num_kv_heads
    d_qk, d_v, size = shape.head_dim, shape.v_head_dim, shape.dtype_bytes
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
    kv_local = tokens * kv_heads * (d_qk + d_v)
    if candidate.strategy == "allgather":
        memory += b * s * (kv * size + 4) + (b * s * kv * 4 if shape.backward else 0.0)
    elif candidate.ring > 1:
        memory += 2 * kv_local * size  # the K/V being computed on and the next
        memory += 2 * kv_local * 4 if shape.backward else 0.0  # dK/dV accumulators
    memory += tokens * heads * (d_v + (d_qk if shape.backward else 0)) * 4  # f32 carries
    memory += b * heads * min(_TILE, s) ** 2 * 4 * (4 if shape.backward else 2)  # score tiles
    return float(memory)


def predict(candidate: Candidate, shape: Shape, hardware: Hardware) -> dict:
    """``{seconds, compute, comm, bytes, memory}`` of ``candidate`` on ``hardware``.

    ``seconds`` is one layer's forward (+ backward with ``shape.backward``) on
    one device; ``compute`` its attention compute, ``comm`` the time beyond it
    (unhidden communication), ``bytes`` what one device sends, ``memory`` its
    peak per-device bytes.
    """
    result = _seconds(candidate, shape, hardware)
    result["memory"] = _memory(candidate, shape)
    return result
