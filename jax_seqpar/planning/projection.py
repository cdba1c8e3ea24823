"""Large-mesh projection: the time model on meshes of nodes, a MODEL, not a measurement.

Nothing here runs on a device, and nothing here models time of its own: every row
is the breakdown :func:`jax_seqpar.planning.predict.predict` gives for one strategy
on one mesh, the model the planner ranks by. Bytes come from
:func:`jax_seqpar.comm_bytes` (which tests hold against compiled HLO on 8 emulated
devices); their time from the hardware's two link classes (alpha-beta:
``steps * latency + bytes / bandwidth``), ``ici`` inside a node (NVLink/NVSwitch:
every GPU of a node reaches every other at full rate) and ``dcn`` between nodes
(InfiniBand, one NIC per GPU); the compute from its peak and attention efficiency.

A mesh of ``chips`` devices is ``nodes x chips_per_node``. Ulysses, the ring and the
all-gather run over all chips; the hybrid (on meshes of more than one node) puts
Ulysses on the chips of a node and the ring over the nodes. Per strategy, forward +
backward (the default):

* Ulysses and all-gather: the share of each collective that stays in the node,
  ``(I-1)/(P-1)``, goes at ICI speed and the rest at DCN speed, concurrently; an
  ``all_to_all`` is one latency step, an ``all_gather`` or ``psum_scatter`` ``P-1``
  (ring algorithm, as NCCL runs them);
* the ring over all chips: every step waits for its slowest hop, which crosses a
  node boundary as soon as there are two nodes: DCN for all bytes, ``2P-1`` steps;
* the hybrid: the Ulysses part (``comm_bytes("ulysses")`` over ``I`` on ``S/O``) at
  ICI speed, then the ring part (the rest of ``comm_bytes("hybrid")``) at DCN speed.

``comm_ms`` is the communication unhidden (every collective as if nothing
overlapped), ``compute_ms`` the attention compute next to it, and ``predicted_ms``
the whole layer with the ring's hops hidden behind compute where the hardware
overlaps. What the model leaves out: congestion, NIC sharing,
message-size-dependent bandwidth, the latency of small messages beyond one
``latency`` per step. The tables are :func:`jax_seqpar.tools.report.format_projection`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from jax_seqpar.core.shape import LayerShape, dtype_of_size
from jax_seqpar.planning import hardware as hardware_lib, plan as planner, predict
from jax_seqpar.strategies import registry

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.planning.hardware import Hardware

__all__ = ["project"]


def project(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: Optional[int] = None,
            *, batch: int = 1, chips: Sequence[int] = (8, 64, 256, 1024),
            seq_lens: Sequence[int] = (32768, 131072, 1048576),
            chips_per_node: Optional[int] = None, dtype_bytes: float = 2, causal: bool = True,
            backward: bool = True, hardware: Hardware | str | None = "h100") -> list[dict]:
    """MODELLED time per attention layer for large meshes, one row per strategy.

    Args:
      num_heads, num_kv_heads, head_dim, v_head_dim: the layer (``q [B, S, H, Dqk]``,
        ``k [B, S, Hkv, Dqk]``, ``v [B, S, Hkv, Dv]``).
      batch: sequences per step; chips: mesh sizes; seq_lens: global tokens.
      chips_per_node: devices on one ICI domain (default: the hardware's
        ``devices_per_domain``); meshes are ``nodes x chips_per_node`` (a mesh smaller
        than a node is one node).
      dtype_bytes, causal, backward: as in :func:`jax_seqpar.planning.plan.plan`.
      hardware: a :class:`~jax_seqpar.planning.hardware.Hardware` or a preset name: the
        model's constants (links, peak FLOP/s, attention efficiency).

    Returns:
      One dict per (chips, seq_len, strategy): ``chips, nodes, inner, outer, seq_len,
      strategy``; from :func:`~jax_seqpar.planning.predict.predict`:
      ``bytes_per_device, ici_bytes, dcn_bytes, comm_ms, compute_ms,
      exposed_comm_ms, predicted_ms`` (None, with a ``reason``, where the strategy
      cannot run the layer); and ``planned``: True on the row
      :func:`jax_seqpar.planning.plan.plan` (by bytes) picks for the
      ``{"dcn": nodes, "ici": chips_per_node}`` mesh.

    >>> rows = project(64, 8, 128, chips=(64,), seq_lens=(131072,))
    >>> sorted({r["strategy"] for r in rows})
    ['allgather', 'hybrid', 'ring', 'ulysses']
    """
    model = hardware_lib.get(hardware)
    if chips_per_node is None:
        chips_per_node = model.devices_per_domain
    if isinstance(chips_per_node, bool) or not isinstance(chips_per_node, int) or (
            chips_per_node < 1):
        raise ValueError(f"chips_per_node must be a positive int. Got {chips_per_node!r}.")
    model = model.replace(devices_per_domain=chips_per_node)
    rows = []
    for size in chips:
        inner = min(size, chips_per_node)
        if size % inner:
            raise ValueError(f"chips={size} is not a whole number of {chips_per_node}-chip "
                             f"nodes; use a multiple of {chips_per_node} (or fewer chips).")
        mesh = {"dcn": size // inner, "ici": inner} if size > inner else {"ici": size}
        for seq_len in seq_lens:
            shape = LayerShape(batch, seq_len, num_heads, num_kv_heads, head_dim, v_head_dim,
                               dtype=dtype_of_size(dtype_bytes), causal=causal,
                               backward=backward)
            try:
                chosen = planner.plan_layer(shape, mesh).strategy
            except ValueError:
                chosen = None
            for name, entry in registry.STRATEGIES.items():
                if entry.num_seq_axes == 2 and size <= inner:  # one node: no ring of nodes
                    continue
                rows.append(_row(name, shape, size, inner, chips_per_node, model, chosen))
    return rows


def _row(name: registry.StrategyName, shape: LayerShape, size: int, inner: int,
         chips_per_node: int, model, chosen) -> dict:
    """One strategy on ``size`` chips (Ulysses groups of ``inner`` for the hybrid)."""
    entry = registry.STRATEGIES[name]
    row = dict(chips=size, nodes=max(1, size // chips_per_node), inner=inner,
               outer=size // inner, seq_len=shape.seq_len, strategy=entry.name,
               planned=entry.name == chosen, bytes_per_device=None, ici_bytes=None,
               dcn_bytes=None, comm_ms=None, compute_ms=None, exposed_comm_ms=None,
               predicted_ms=None, reason="")
    candidate = predict.Candidate(name, *entry.factorization(size, inner))
    try:
        result = predict.predict(candidate, shape, model)
    except ValueError as error:
        row["reason"] = str(error)
        return row
    row.update(bytes_per_device=result["bytes"], ici_bytes=result["ici_bytes"],
               dcn_bytes=result["dcn_bytes"], comm_ms=result["comm_seconds"] * 1e3,
               compute_ms=result["compute_seconds"] * 1e3,
               exposed_comm_ms=result["exposed_comm_seconds"] * 1e3,
               predicted_ms=result["seconds"] * 1e3)
    return row
