"""The sentences a plan gives for its choice, with the numbers behind them.

:func:`bytes_reason` says why the choice by bytes picked a strategy (against the best of
the others); :func:`predicted_reason` why the prediction (or a measurement) did, and
names the candidates it tied with (:data:`TIE`) or beat.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from jax_seqpar.core.shape import LayerShape
from jax_seqpar.strategies import registry
from jax_seqpar.strategies.entry import Strategy
from jax_seqpar.core.reach import mask_reach
from jax_seqpar.strategies.traffic import replicated_kv_heads

__all__ = ["TIE", "binary_size", "bytes_reason", "gib", "predicted_reason", "rank", "tied"]


def _ratio(numerator: float, denominator: float) -> float:
    return 1.0 if numerator == denominator else numerator / denominator


def rank(entry: Strategy) -> int:
    """``entry``'s rank among the choice by bytes (a tie goes to the lower)."""
    if entry.preference is None:  # _by_bytes keeps only ranked strategies
        raise ValueError(f"strategy {entry.name!r} has no preference rank (Strategy."
                         "preference=None): the choice by bytes never weighs it.")
    return entry.preference


def bytes_reason(chosen: Strategy, candidates: Mapping[str, float], blocked: list[Strategy],
                  shape: LayerShape, names: tuple[str, ...], sizes: tuple[int, ...]) -> str:
    """One sentence with the numbers behind the choice by bytes of ``chosen``: against
    the best of the others (those that split heads, where ``chosen`` splits none)."""
    num_heads, num_kv_heads = shape.num_heads, shape.num_kv_heads
    devices = math.prod(sizes)
    reach = mask_reach(shape.mask, shape.seq_len // devices, devices)
    if reach == (0, 0) and devices > 1:
        return (f"{chosen.name}: every query's keys are on its own device (the mask's reach "
                f"on the contiguous split is (0, 0)), so no strategy sends anything and "
                f"{chosen.name} attends locally")
    layout = registry.default_layout(chosen.name, shape.mask, seq_len=shape.seq_len,
                                     num_shards=devices)
    balance = ("; zigzag layout balances causal work" if layout == "zigzag" else
               f"; contiguous layout: only the mask's reach {reach} travels"
               if reach is not None else "")
    rivals = [registry.get(name) for name in candidates if name != chosen.name]
    if not chosen.splits_heads:
        rivals = [entry for entry in rivals if entry.splits_heads] or rivals
    rival = min(rivals, key=lambda entry: (candidates[entry.name], rank(entry)),
                default=None)
    splitter = rival if rival is not None and rival.splits_heads else None
    if len(sizes) == 1:
        (size,) = sizes
        if chosen.splits_heads:
            kv_heads = replicated_kv_heads(num_kv_heads, size)
            replicated = (f" ({num_kv_heads} KV heads replicated to {kv_heads})"
                          if kv_heads != num_kv_heads else "")
            reason = f"{chosen.name}: {num_heads} heads divisible by {size}{replicated}"
            if rival is None:
                return reason
            return (f"{reason} and a2a traffic "
                    f"{_ratio(candidates[chosen.name], candidates[rival.name]):.2f}x of "
                    f"{rival.name}")
        if splitter is None and blocked:
            return (f"{chosen.name}: num_heads={num_heads} is not divisible by the axis size "
                    f"{size}, so {blocked[0].name} cannot split heads{balance}")
        if rival is None:
            return f"{chosen.name}: the only strategy for this layer{balance}"
        factor = _ratio(candidates[rival.name], candidates[chosen.name])
        why = ("only 1 KV head (MQA/MLA)" if num_kv_heads == 1
               else f"only {num_kv_heads} of {num_heads} heads are K/V heads")
        return f"{chosen.name}: {why} and {rival.name} would move {factor:.1f}x more bytes{balance}"
    (outer, inner), (_, inner_size) = names, sizes
    if chosen.num_seq_axes == 2:
        if chosen.parts is None:  # Strategy refuses a two-axis entry without its parts
            raise ValueError(f"strategy {chosen.name!r} runs over two axes but names no "
                             "(outer, inner) parts.")
        outer_part, inner_part = chosen.parts
        reason = (f"{chosen.name}: {inner_part} over {inner!r} ({inner_size} divides "
                  f"{num_heads} heads) and {outer_part} over {outer!r}")
        if rival is None:
            return reason
        return (f"{reason} send {_ratio(candidates[chosen.name], candidates[rival.name]):.2f}x "
                f"the bytes of a {rival.name} over both axes")
    where = f"{chosen.name} over ({outer!r}, {inner!r})"
    if splitter is None and blocked:
        inner_part = blocked[0].parts[1] if blocked[0].parts else "its head split"
        return (f"{where}: num_heads={num_heads} is not divisible by the inner axis size "
                f"{inner_size}, so {blocked[0].name} cannot use {inner_part}{balance}")
    if rival is None:
        return f"{where}: the only strategy for this layer{balance}"
    return (f"{where}: {rival.name} would move "
            f"{_ratio(candidates[rival.name], candidates[chosen.name]):.1f}x more bytes{balance}")


_GIB = 2.0**30


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def binary_size(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps it at 1 or more."""
    for unit, size in (("GiB", _GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def gib(num_bytes: float) -> str:
    return f"{num_bytes / _GIB:.3g} GiB"


#: The fraction of the fastest predicted time within which candidates tie (the model
#: does not tell them apart); the tie goes to the candidate that sends fewest bytes.
TIE = 0.01


def tied(seconds: Mapping[str, float]) -> list[str]:
    """The labels of ``seconds`` within :data:`TIE` of the fastest, fastest first."""
    best = min(seconds.values())
    return sorted((label for label, s in seconds.items() if s <= best * (1 + TIE)),
                  key=seconds.__getitem__)


def predicted_reason(chosen: str, seconds: Mapping[str, float],
                     measured: Mapping[str, float], rejected: Mapping[str, str],
                     hardware: Any, sent: Mapping[str, float]) -> str:
    """One sentence for the candidate label ``chosen``: fastest measured (``measured``,
    ``{label: seconds}``), tied (within :data:`TIE`, the tie going to the fewest bytes
    ``sent``) or fastest predicted (``seconds``), then the others and those over the
    memory budget (``rejected``)."""
    if measured:
        others = sorted((s, label) for label, s in measured.items() if label != chosen)
        text = (f"{chosen}: fastest measured on this mesh, {_ms(measured[chosen])} per layer "
                f"(predicted {_ms(seconds[chosen])})")
        timed = "measured"
    elif len(ties := tied(seconds)) > 1 and chosen in ties:
        others = sorted((s, label) for label, s in seconds.items() if label not in ties)
        text = (f"{chosen}: a tie on {hardware.name}, {len(ties)} candidates predicted within "
                f"{TIE:.0%} of {_ms(seconds[ties[0]])} per layer ("
                + ", ".join(f"{label} {_ms(seconds[label])}" for label in ties)
                + "); the tie goes to the fewest bytes sent: "
                + ", ".join(f"{label} {binary_size(sent[label])}"
                            for label in sorted(ties, key=sent.__getitem__)))
        timed = "slower predicted"
    else:
        others = sorted((s, label) for label, s in seconds.items() if label != chosen)
        text = f"{chosen}: fastest predicted on {hardware.name}, {_ms(seconds[chosen])} per layer"
        timed = "predicted"
    if others:
        text += f"; {timed}: " + ", ".join(f"{label} {_ms(s)}" for s, label in others)
    if rejected:
        text += "; over the memory budget: " + ", ".join(sorted(rejected))
    return text
