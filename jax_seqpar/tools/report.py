"""Plain-text tables: the one table writer of the reports (bench, tune, projection,
experiments), and the table of the large-mesh projection
(:func:`jax_seqpar.planning.projection.project`)."""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["format_projection", "text_table"]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table: columns of words left-aligned, numbers right-aligned;
    None cells print as ``-``.

    >>> print(text_table(["strategy", "ms"], [["ring", 1.5], ["ulysses", None]]))
    strategy   ms
    --------  ---
    ring      1.5
    ulysses     -
    """
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


def _tokens(seq_len: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if seq_len % size == 0:
            return f"{seq_len // size}{unit}"
    return str(seq_len)


def format_projection(rows: Sequence[dict]) -> str:
    """One line per (chips, seq_len) of :func:`~jax_seqpar.planning.projection.project`'s
    rows: modelled comm ms per strategy (unhidden), compute ms, the least communication.

    ``*`` marks :func:`jax_seqpar.planning.plan.plan`'s choice (fewest bytes); ``compute
    ms`` is the least of the strategies' (they differ only by load balance and tiles);
    the ``fastest`` column is the model's lowest communication time.
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["chips"], row["seq_len"]), []).append(row)
    strategies = list(dict.fromkeys(row["strategy"] for row in rows))
    lines = []
    for (chips, seq_len), group in groups.items():
        by_strategy = {r["strategy"]: r for r in group}
        cells = [chips, f"{group[0]['nodes']}x{min(chips, group[0]['inner'])}",
                 _tokens(seq_len)]
        for strategy in strategies:
            found = by_strategy.get(strategy)
            cell = "-" if found is None else _ms(found["comm_ms"])
            if found is not None and found["planned"]:
                cell += "*"
            cells.append(cell)
        feasible = [r for r in group if r["comm_ms"] is not None]
        fastest = min(feasible, key=lambda r: r["comm_ms"])["strategy"] if feasible else "-"
        compute = min((r["compute_ms"] for r in feasible), default=None)
        cells += [_ms(compute), fastest]
        lines.append(cells)
    headers = (["chips", "nodes x I", "seq"] + [f"{s} ms" for s in strategies]
               + ["compute ms", "fastest"])
    title = ("MODEL (planning.predict, not a measurement): attention communication per "
             "layer and device, unhidden; * = plan.plan's pick (fewest bytes)")
    return title + "\n" + text_table(headers, lines)
