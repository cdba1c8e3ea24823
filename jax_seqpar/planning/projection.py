"""Large-mesh projection of attention communication time: a MODEL, not a measurement.

Nothing here runs on a device. The bytes one device sends come from
:func:`jax_seqpar.comm_bytes` (which tests hold against compiled HLO on 8
emulated devices); the time to send them comes from an alpha-beta link model:

    time = steps * latency + bytes / bandwidth

over two link classes, :data:`ICI` inside a node (NVLink/NVSwitch: every GPU of a
node reaches every other at full rate) and :data:`DCN` between nodes (InfiniBand,
one NIC per GPU). A mesh of ``chips`` devices is factorized as
``nodes x chips_per_node``; the hybrid puts Ulysses on ``inner`` chips of a node
and the ring over the ``outer = chips / inner`` groups.

Per strategy, forward + backward (the default):

* ``ulysses`` / ``allgather`` over all chips: the share of each collective that
  stays in the node, ``(I-1)/(P-1)``, goes at ICI speed and the rest at DCN speed,
  concurrently; an ``all_to_all`` is one latency step, an ``all_gather`` or
  ``psum_scatter`` ``P-1`` (ring algorithm, as NCCL does);
* ``ring`` over all chips: every step waits for its slowest hop, which crosses a
  node boundary as soon as there are two nodes: DCN for all bytes and
  ``2P-1`` steps (``P-1`` forward rotations, ``P`` in the backward);
* ``hybrid``: the Ulysses part (``comm_bytes("ulysses")`` over ``I`` on ``S/O``)
  at ICI speed, then the ring part (the rest of ``comm_bytes("hybrid")``) at
  DCN speed (ICI when ``outer`` fits in one node).

The ring and hybrid rotations can hide behind attention compute; ``comm_ms``
reports them unhidden and gives the attention compute time next to them
(``FLOPs / (PEAK_FLOPS * EFFICIENCY)``) so the reader can judge, and
``predicted_ms`` is the planner's whole-layer prediction with that overlap
(:func:`jax_seqpar.planning.predict.predict`). The link and compute constants are those
of the :data:`jax_seqpar.planning.hardware.H100` preset: one set of figures for the
projection and the planner. What the model leaves out: congestion, NIC
sharing, message-size-dependent bandwidth, the latency of small messages
beyond one ``latency`` per step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from jax_seqpar.planning import hardware, plan as planner, predict
from jax_seqpar.planning.hardware import Link
from jax_seqpar.strategies.registry import comm_bytes

__all__ = ["DCN", "ICI", "Link", "Links", "format_table", "project", "text_table"]


#: NVLink through NVSwitch and InfiniBand NDR per GPU (see :data:`jax_seqpar.planning.hardware.H100`).
ICI = hardware.H100.ici
DCN = hardware.H100.dcn
#: Dense bf16 peak of an H100 SXM, and the fraction attention kernels reach.
PEAK_FLOPS = hardware.H100.peak_flops
EFFICIENCY = hardware.H100.attention_efficiency


@dataclasses.dataclass(frozen=True)
class Links:
    """The two link classes of a node-based cluster (override either to model another)."""

    ici: Link = ICI
    dcn: Link = DCN


def _attention_seconds(batch, seq_len, num_heads, head_dim, v_head_dim, chips, causal,
                       backward, peak_flops, efficiency) -> float:
    """Attention FLOPs per device (QK^T and PV; backward 2.5x) at ``peak * efficiency``."""
    flops = 2 * batch * num_heads * seq_len * seq_len * (head_dim + v_head_dim)
    flops *= (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
    return flops / chips / (peak_flops * efficiency)


def _strategy_seconds(strategy, shape, chips, inner, links) -> tuple[float, float, float]:
    """``(seconds, ici_bytes, dcn_bytes)`` of one strategy on ``chips = outer * inner``."""
    outer = chips // inner
    total = comm_bytes(strategy, seq_axes=(outer, inner) if strategy == "hybrid"
                               else chips, **shape)
    steps_fwd_bwd = 2 if shape["backward"] else 1
    if strategy == "hybrid":
        ulysses_shape = dict(shape, seq_len=shape["seq_len"] // outer)
        ulysses = comm_bytes("ulysses", seq_axes=inner, **ulysses_shape)
        ring = total - ulysses
        # 4 all_to_alls (q, k, v, out) per pass and one all_gather of positions.
        a2a_steps = 4 * steps_fwd_bwd + (inner - 1)
        ring_steps = (2 * outer - 1) if shape["backward"] else (outer - 1)
        ring_link = links.dcn if outer > 1 else links.ici
        return (links.ici.seconds(ulysses, a2a_steps) + ring_link.seconds(ring, ring_steps),
                ulysses, ring)
    nodes_span = chips > inner  # more than one node
    if strategy == "ring":
        steps = (2 * chips - 1) if shape["backward"] else (chips - 1)
        link = links.dcn if nodes_span else links.ici
        return link.seconds(total, steps), (0.0 if nodes_span else total), (
            total if nodes_span else 0.0)
    # ulysses / allgather over all chips: split by destination.
    intra = total * (inner - 1) / (chips - 1) if chips > 1 else 0.0
    inter = total - intra
    if strategy == "ulysses":
        steps = 4 * steps_fwd_bwd + (chips - 1)
    else:  # all_gather k, v, positions; backward psum_scatter dk, dv
        steps = (chips - 1) * (3 + (2 if shape["backward"] else 0))
    latency = (links.dcn if nodes_span else links.ici).latency * steps
    seconds = latency + max(intra / links.ici.bandwidth, inter / links.dcn.bandwidth)
    return seconds, intra, inter


def project(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: Optional[int] = None,
            *, batch: int = 1, chips: Sequence[int] = (8, 64, 256, 1024),
            seq_lens: Sequence[int] = (32768, 131072, 1048576), chips_per_node: int = 8,
            dtype_bytes: float = 2, causal: bool = True, backward: bool = True,
            links: Links = Links(), peak_flops: float = PEAK_FLOPS,
            efficiency: float = EFFICIENCY) -> list[dict]:
    """MODELLED communication time per attention layer for large meshes.

    Args:
      num_heads, num_kv_heads, head_dim, v_head_dim: the layer (``q [B, S, H, Dqk]``,
        ``k [B, S, Hkv, Dqk]``, ``v [B, S, Hkv, Dv]``).
      batch: sequences per step; chips: mesh sizes; seq_lens: global tokens.
      chips_per_node: devices on one ICI domain; meshes are ``nodes x chips_per_node``
        (a mesh smaller than a node is one node).
      dtype_bytes: 2 for bf16; causal: halves the compute estimate only.
      backward: forward + backward (default) or forward only.
      links, peak_flops, efficiency: the model's constants (see module docstring).

    Returns:
      One dict per (chips, seq_len, strategy, inner): ``chips, nodes, inner,
      outer, seq_len, strategy, bytes_per_device, ici_bytes, dcn_bytes,
      comm_ms`` and ``predicted_ms`` (None with a ``reason`` when infeasible),
      ``compute_ms``, and
      ``planned``: True on the row :func:`jax_seqpar.planning.plan.plan` picks for the
      ``{"dcn": nodes, "ici": chips_per_node}`` mesh.

    >>> rows = project(64, 8, 128, chips=(64,), seq_lens=(131072,))
    >>> sorted({r["strategy"] for r in rows})
    ['allgather', 'hybrid', 'ring', 'ulysses']
    """
    if not isinstance(chips_per_node, int) or chips_per_node < 1:
        raise ValueError(f"chips_per_node must be a positive int. Got {chips_per_node!r}.")
    model = hardware.H100.replace(ici=links.ici, dcn=links.dcn, peak_flops=peak_flops,
                                  attention_efficiency=efficiency,
                                  devices_per_domain=chips_per_node)
    rows = []
    for size in chips:
        inner = min(size, chips_per_node)
        if size % inner:
            raise ValueError(f"chips={size} is not a whole number of {chips_per_node}-chip "
                             f"nodes; use a multiple of {chips_per_node} (or fewer chips).")
        for seq_len in seq_lens:
            shape = dict(batch=batch, seq_len=seq_len, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                         dtype_bytes=dtype_bytes, backward=backward)
            mesh = {"dcn": size // inner, "ici": inner} if size > inner else {"ici": size}
            try:
                chosen = planner.plan(seq_len, num_heads, num_kv_heads, head_dim, mesh,
                                      batch=batch, v_head_dim=v_head_dim,
                                      dtype_bytes=dtype_bytes, backward=backward).strategy
            except ValueError:
                chosen = None
            compute = _attention_seconds(batch, seq_len, num_heads, head_dim,
                                         v_head_dim or head_dim, size, causal, backward,
                                         peak_flops, efficiency)
            strategies = ("ulysses", "ring", "allgather") + (("hybrid",) if size > inner else ())
            for strategy in strategies:
                row = dict(chips=size, nodes=max(1, size // chips_per_node), inner=inner,
                           outer=size // inner, seq_len=seq_len, strategy=strategy,
                           compute_ms=compute * 1e3, planned=strategy == chosen,
                           bytes_per_device=None, ici_bytes=None, dcn_bytes=None,
                           comm_ms=None, predicted_ms=None, reason="")
                try:
                    seconds, ici, dcn = _strategy_seconds(strategy, shape, size, inner, links)
                except ValueError as error:
                    row["reason"] = str(error)
                else:
                    row.update(bytes_per_device=ici + dcn, ici_bytes=ici, dcn_bytes=dcn,
                               comm_ms=seconds * 1e3)
                    row["predicted_ms"] = _predicted_seconds(strategy, shape, size, inner, causal,
                                                        model) * 1e3
                rows.append(row)
    return rows


def _predicted_seconds(strategy, shape, chips, inner, causal, model) -> float:
    """The planner's whole-layer seconds (overlap included) for this row."""
    ring, ulysses = {"ulysses": (1, chips), "hybrid": (chips // inner, inner)}.get(
        strategy, (chips, 1))
    layer = predict.Shape(**dict(shape, v_head_dim=shape["v_head_dim"] or shape["head_dim"]),
                          causal=causal)
    return predict.predict(predict.Candidate(strategy, ring, ulysses), layer, model)["seconds"]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table: columns of words left-aligned, numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [not any(row[i][:1].isalpha() for row in cells[1:]) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.rjust(w) if n else c.ljust(w)
                         for c, w, n in zip(row, widths, numeric)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _ms(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def format_table(rows: Sequence[dict]) -> str:
    """One line per (chips, seq_len): modelled comm ms per strategy, compute ms, picks.

    ``*`` marks :func:`jax_seqpar.planning.plan.plan`'s choice (fewest bytes); the
    ``fastest`` column is the model's lowest communication time.
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["chips"], row["seq_len"]), []).append(row)
    strategies = ("ulysses", "ring", "hybrid", "allgather")
    lines = []
    for (chips, seq_len), group in groups.items():
        by_strategy = {r["strategy"]: r for r in group}
        cells = [chips, f"{group[0]['nodes']}x{min(chips, group[0]['inner'])}",
                 _tokens(seq_len)]
        for strategy in strategies:
            row = by_strategy.get(strategy)
            cell = "-" if row is None else _ms(row["comm_ms"])
            if row is not None and row["planned"]:
                cell += "*"
            cells.append(cell)
        feasible = [r for r in group if r["comm_ms"] is not None]
        fastest = min(feasible, key=lambda r: r["comm_ms"])["strategy"] if feasible else "-"
        cells += [_ms(group[0]["compute_ms"]), fastest]
        lines.append(cells)
    headers = ["chips", "nodes x I", "seq", "ulysses ms", "ring ms", "hybrid ms",
               "allgather ms", "compute ms", "fastest"]
    title = ("MODEL (alpha-beta links, not a measurement): attention communication per "
             "layer and device; * = plan.plan's pick (fewest bytes)")
    return title + "\n" + text_table(headers, lines)


def _tokens(seq_len: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if seq_len % size == 0:
            return f"{seq_len // size}{unit}"
    return str(seq_len)
