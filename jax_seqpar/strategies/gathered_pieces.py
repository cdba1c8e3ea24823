"""How many pieces the all-gather (:mod:`jax_seqpar.strategies.allgather`) gathers K/V
in: each piece's gather travels while the kernel attends to the piece before it."""

from __future__ import annotations

from typing import Literal

__all__ = ["MAX_AUTO_PIECES", "MIN_PIECE_TOKENS", "default_pieces", "piece_counts",
           "resolve_gathered_pieces"]

#: ``pieces="auto"`` takes at most this many pieces: 16 hide fifteen sixteenths of the
#: gathered bytes (B=1, S=16384, H=16, Hkv=4, D=128, bf16, causal, 8 devices, compiled
#: for h100:8 and v5p:2x2x2: 93.6 % of the forward's bytes and 90.3 % of the forward +
#: backward's hidden, against 87 % with 8 pieces, with less temp memory than one
#: gather); each further piece is one more kernel call that re-reads and re-writes the
#: float32 running result (the Mosaic kernel continues it in place).
MAX_AUTO_PIECES = 16
#: ``pieces="auto"`` keeps at least this many of a device's tokens in each piece (a
#: Mosaic tile is 128 tokens; smaller slices make the pieces' key tiles span more
#: devices' positions, so fewer causal tiles are skipped).
MIN_PIECE_TOKENS = 128


def piece_counts(local_len: int) -> tuple[int, ...]:
    """Every chunk count :func:`~jax_seqpar.strategies.allgather.allgather_attention` takes for ``local_len`` tokens per
    device: the divisors of ``local_len``."""
    return tuple(c for c in range(1, local_len + 1) if local_len % c == 0)


def default_pieces(local_len: int) -> int:
    """What ``pieces="auto"`` takes: the largest power of two up to
    :data:`MAX_AUTO_PIECES` dividing ``local_len`` that leaves every device's slice
    of a piece :data:`MIN_PIECE_TOKENS` tokens or more (1 when none does).

    .. code-block:: python

        default_pieces(2048), default_pieces(1024), default_pieces(256), default_pieces(64)
        # (16, 8, 2, 1)
    """
    pieces = 1
    while (2 * pieces <= MAX_AUTO_PIECES and local_len % (2 * pieces) == 0
           and local_len // (2 * pieces) >= MIN_PIECE_TOKENS):
        pieces *= 2
    return pieces


def resolve_gathered_pieces(pieces: int | Literal['auto'], local_len: int) -> int:
    """``pieces`` checked against ``local_len`` (``"auto"``: :func:`default_pieces`)."""
    if pieces == "auto":
        return default_pieces(local_len)
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1 or (
            local_len % pieces):
        raise ValueError(f"pieces={pieces!r} must be a positive divisor of the {local_len} "
                         f"tokens each device holds: one of {piece_counts(local_len)} "
                         "(or 'auto').")
    return pieces
