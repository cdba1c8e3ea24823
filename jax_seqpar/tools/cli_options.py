"""What the ``jax-seqpar`` subcommands share: the help layout, the layer's shape options
(``bench`` and ``tune`` define them here, once, with one default each) and where files go.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from jax_seqpar.core.shape import LayerShape
from jax_seqpar.tools.bench import DEFAULT_SHAPE, DTYPES

__all__ = ["HelpFormatter", "SHAPE_OPTIONS", "add_shape_arguments", "comma_list", "default_out_dir", "positive_int", "shape_from_args"]

#: The options :func:`add_shape_arguments` defines (the same defaults in every subcommand).
SHAPE_OPTIONS = ("--batch", "--seq", "--heads", "--kv-heads", "--head-dim", "--v-head-dim",
                 "--dtype", "--causal")


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help once, and only where it tells something.

    Left out when the help already says its default, for required options, flags
    (default False) and options without a default (None: the help says what happens);
    list defaults are written the way they are typed, comma-separated.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default:" in text or action.required or default is None or default is False
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        if isinstance(default, (list, tuple)):
            default = ",".join(str(value) for value in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def comma_list(convert: Callable[[str], Any]) -> Callable[[str], list]:
    """An ``argparse`` type: ``"a,b"`` -> ``[convert("a"), convert("b")]``."""
    return lambda text: [convert(v.strip()) for v in text.split(",") if v.strip()]


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The attention layer's options (global sizes), defaulting to ``bench.DEFAULT_SHAPE``."""
    add = parser.add_argument
    shape = DEFAULT_SHAPE
    add("--batch", type=positive_int, default=shape.batch, help="sequences per call (B)")
    add("--seq", type=comma_list(positive_int), default=[shape.seq_len],
        help="global sequence length(s) S, comma-separated for a sweep, e.g. 1024,2048,4096")
    add("--heads", type=positive_int, default=shape.num_heads, help="query heads H")
    add("--kv-heads", type=positive_int, default=shape.num_kv_heads,
        help="key/value heads Hkv (H %% Hkv == 0)")
    add("--head-dim", type=positive_int, default=shape.head_dim, help="q/k head dim Dqk")
    add("--v-head-dim", type=positive_int, default=None,
        help="v head dim Dv (default: the q/k head dim)")
    add("--dtype", choices=DTYPES, default=shape.dtype, help="q/k/v dtype")
    add("--causal", action=argparse.BooleanOptionalAction, default=shape.causal,
        help="causal mask")


def shape_from_args(args: argparse.Namespace, seq_len: int, **fields: Any) -> LayerShape:
    """The :class:`~jax_seqpar.core.shape.LayerShape` of :func:`add_shape_arguments`' options at ``seq_len``."""
    return LayerShape(args.batch, seq_len, args.heads, args.kv_heads, args.head_dim,
                      args.v_head_dim, dtype=args.dtype, causal=args.causal, **fields)


def default_out_dir() -> str:
    """Where ``demo`` and ``generate`` write unless ``--out`` says: ``$XDG_CACHE_HOME/
    jax_seqpar`` (``~/.cache/jax_seqpar`` when unset), never the working directory."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "jax_seqpar")
