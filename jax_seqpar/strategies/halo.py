"""Halo exchange: a device receives only what the mask reaches.

The reach of a mask (:func:`jax_seqpar.core.reach.mask_reach`) is the tokens ``(left,
right)`` beyond a shard that some query of it can see: a window or chunks on the
contiguous split (positions ``r*L .. r*L+L-1`` on shard ``r``, ``L = S/P``), or
``max_document_shards=D`` in any order (``(D-1)*L`` either side). Shard ``r`` then needs
the last ``left`` tokens before its own and the first ``right`` after: ``ceil(left/L)``
hops from the lower neighbours and ``ceil(right/L)`` from the higher ones, the far hop
carrying only the remainder. Each hop forwards the needed suffix (prefix) of what the
previous hop brought, so a device sends exactly ``left + right`` tokens of K/V, whatever
P; a reach of ``(0, 0)`` sends nothing, forward or backward. On the contiguous split the
positions of the halo are known, so only K/V and segment ids (and bidirectional ids)
travel; where documents bound the reach the positions travel too. With bidirectional
ids a causal query also sees later keys of its id, so the halo keeps the right side
then. Permutations do not wrap around the sequence ends: shard 0 gets zeros from "the
left", at positions (mod S) that no query sees (:func:`mask_reach` refuses a reach where
one would), and with segment ids those slots are padding.

Used only when ``left + right < S - L`` (else the mask reaches nearly every
shard and the full ring is as cheap).

:func:`pull` and :func:`send_back` are the exchange and its transpose for a caller
that schedules them itself (the hybrid's sequence pieces,
:mod:`jax_seqpar.strategies.ring_pieces`, whose gathered keys are not in position order:
``rows``). ``halo_attention`` is the ring's form (a ``custom_vjp``: the backward sends
float32 dK/dV back along the same hops); ``window_attention`` is the
all-gather form (one kernel call over ``[left halo, own, right halo]``; its backward
sends the halo's float32 dK/dV back the same way); :func:`local_or_none` is the
``(0, 0)`` case Ulysses and the hybrid route to.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar import kernels
from jax_seqpar.core import compat as _compat
from jax_seqpar.strategies.inputs import axis_size
from jax_seqpar.strategies.wire import Wire
from jax_seqpar.core.masks import PAD_SEGMENT, Tokens
from jax_seqpar.core.merge import merge_results
from jax_seqpar.core.reach import is_local, mask_reach

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.kernels.options import Options

__all__ = ["exchange", "halo_attention", "is_local", "local_or_none", "mask_reach", "pull",
           "send_back", "window_attention"]


#: Strategies whose causal work zigzag balances (Ulysses is balanced by construction).
def _hops(tokens: int, local_len: int) -> list[int]:
    """Tokens carried by each hop: whole shards, then the remainder (farthest last)."""
    return [min(local_len, tokens - start) for start in range(0, tokens, local_len)]


def _pull(tree, tokens: int, axis_name, from_lower: bool, rows=None):
    """The ``tokens`` tokens just before (``from_lower``) or after this shard's, in order.

    Args:
      tree: arrays ``[B, L, ...]`` (None leaves are kept None).
      tokens: how many to bring; ``from_lower``: from shards ``r-1, r-2, ..``
        (their suffixes) or from ``r+1, r+2, ..`` (their prefixes).
      rows: as in :func:`exchange`.
    Returns:
      ``tree`` of ``[B, tokens, ...]`` in position order (zeros past the sequence ends).
    """
    size = axis_size(axis_name)
    perm = ([(i, i + 1) for i in range(size - 1)] if from_lower
            else [(i + 1, i) for i in range(size - 1)])
    in_order = np.arange(_seq_len(tree)) if rows is None else np.asarray(rows)

    def hop(x, n, order):
        taken = order[len(order) - n:] if from_lower else order[:n]
        piece = jnp.concatenate([x[:, start:stop] for start, stop in _runs(taken)],
                                axis=1)  # [B, n, ...]
        return jax.lax.ppermute(piece, axis_name, perm)

    pieces, current, order = [], tree, in_order
    for n in _hops(tokens, _seq_len(tree)):
        current = jax.tree.map(functools.partial(hop, n=n, order=order), current)
        order = np.arange(n)  # what a hop brought is in position order
        pieces.append(current)
    if from_lower:
        pieces.reverse()  # the farthest hop holds the earliest positions
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *pieces)


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """``rows`` (static ints) as runs of consecutive rows, ``[(start, stop), ...]``: the
    slices that take them in order."""
    breaks = [int(i) for i in np.flatnonzero(np.diff(rows) != 1) + 1]
    starts, stops = [0, *breaks], [*breaks, len(rows)]
    return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(starts, stops)]


def _seq_len(tree) -> int:
    """Sequence length (axis 1) shared by the arrays of ``tree``."""
    return jax.tree.leaves(tree)[0].shape[1]


def _halo_positions(reach, local_len: int, axis_name, batch: int):
    """``int32[B, left + right]`` positions of the halo (mod S: wrapped zeros stay unseen)."""
    left, right = reach
    seq_len = local_len * axis_size(axis_name)
    start = jax.lax.axis_index(axis_name) * local_len
    offsets = jnp.concatenate([jnp.arange(-left, 0), local_len + jnp.arange(right)])
    positions = ((start + offsets) % seq_len).astype(jnp.int32)
    return jnp.broadcast_to(positions, (batch, left + right))


def exchange(axis_name: str | tuple[str, ...], reach: tuple[int, int], tree: Any, *,
             rows: Optional[np.ndarray] = None):
    """The halo of ``tree`` (``[B, L, ...]`` arrays): ``[B, left + right, ...]``, left then right.

    ``rows``: where the arrays' tokens are not in position order (the hybrid's keys,
    gathered piece by piece: :meth:`jax_seqpar.strategies.pieces.Pieces.kv_rows`), the
    row of each position, ``L`` static ints (a numpy array); the halo still comes in
    position order."""
    left, right = reach
    parts = []
    if left:
        parts.append(_pull(tree, left, axis_name, from_lower=True, rows=rows))
    if right:
        parts.append(_pull(tree, right, axis_name, from_lower=False, rows=rows))
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *parts)


def pull(axis_name: str | tuple[str, ...], options: Options, reach: tuple[int, int],
         k: jax.Array, v: jax.Array, tokens: Tokens, *, rows: Optional[np.ndarray] = None
         ) -> tuple[jax.Array, jax.Array, Tokens]:
    """The halo's K/V and metadata, ``(k [B, left+right, Hkv, Dqk], v [.., Dv], Tokens)``,
    K and V joined along their features: one transfer a hop (XLA:GPU runs one
    asynchronous collective at a time, so a second would wait for the first). ``k``,
    ``v``: ``[B, L, Hkv, D]`` of one dtype; ``tokens``: their ``[B, L]`` metadata, in the
    arrays' row order; ``rows``: as in :func:`exchange`."""
    travelling = _travelling(options, tokens)
    wire = Wire.of(options.compute, k.dtype, saved=True)
    joined = jnp.concatenate([wire.encode(k), wire.encode(v)], axis=-1)
    joined, ids = exchange(axis_name, reach, (joined, travelling), rows=rows)
    split = wire.width(k.shape[-1])
    return (wire.decode(joined[..., :split]), wire.decode(joined[..., split:]),
            _arrived(axis_name, options, reach, tokens, ids))


def _exchange_kv(axis_name, options: Options, reach, k: jax.Array, v: jax.Array) -> tuple:
    """The halo's ``(k, v)`` (:func:`exchange`), travelling in the call's compute dtype
    (:class:`~jax_seqpar.strategies.wire.Wire`; the backward re-uses them, so in one
    that serves both passes)."""
    wire = Wire.of(options.compute, k.dtype, saved=True)
    return tuple(wire.decode(x) for x in exchange(axis_name, reach,
                                                  (wire.encode(k), wire.encode(v))))


def _halo_tokens(axis_name, options: Options, reach, tokens: Tokens) -> Tokens:
    """The halo's metadata: the ids exchanged with K/V (:func:`_travelling`), positions
    computed on the contiguous split (:func:`_arrived`)."""
    travelling = _travelling(options, tokens)
    if any(x is not None for x in travelling):
        travelling = exchange(axis_name, reach, travelling)
    return _arrived(axis_name, options, reach, tokens, travelling)


def _travelling(options: Options, tokens: Tokens) -> tuple:
    """The metadata that travels with the halo's K/V: the ids, and the positions where
    documents bound the reach (any order: what travels is the same whatever the order);
    on the contiguous split the positions are computed instead (None)."""
    moved = options.spec.max_document_shards is not None
    return (tokens.segment_ids, tokens.bidirectional_ids, tokens.positions if moved else None)


def _arrived(axis_name, options: Options, reach, tokens: Tokens, ids: tuple) -> Tokens:
    """The halo's Tokens from the ``ids`` :func:`_travelling` sent. Past the sequence ends
    the exchange brings zeros: the window reaches no query there, and the segment ids
    are made padding (a zero id is a real document)."""
    batch, local_len = tokens.positions.shape
    moved = options.spec.max_document_shards is not None
    positions = ids[2] if moved else _halo_positions(reach, local_len, axis_name, batch)
    segment_ids = ids[0]
    if segment_ids is not None:
        segment_ids = jnp.where(_past_ends(reach, local_len, axis_name), PAD_SEGMENT, segment_ids)
    return Tokens(positions, segment_ids, ids[1])


def _past_ends(reach, local_len: int, axis_name):
    """``bool[1, left + right]``: the halo slots past the sequence ends (zeros)."""
    left, right = reach
    seq_len = local_len * axis_size(axis_name)
    start = jax.lax.axis_index(axis_name) * local_len
    slots = start + jnp.concatenate([jnp.arange(-left, 0), local_len + jnp.arange(right)])
    return ((slots < 0) | (slots >= seq_len))[None]


def _around(reach, own, pulled):
    """``[left halo, own shard, right halo]`` along axis 1 (``pulled``: the halo)."""
    left = reach[0]
    return jnp.concatenate([pulled[:, :left], own, pulled[:, left:]], axis=1)


def send_back(axis_name: str | tuple[str, ...], reach: tuple[int, int], halo_dkv: tuple,
              like: tuple, *, rows: Optional[np.ndarray] = None) -> tuple:
    """The halo's float32 dK/dV (``[B, left+right, ...]`` each) sent back along the hops
    that brought it (the exchange's transpose; a hop that forwards what an earlier one
    brought sums in float32), as float32 arrays shaped like ``like``'s local shards
    (``[B, L, ...]``, in the row order ``rows`` gives, as in :func:`exchange`)."""
    like = tuple(x.astype(jnp.float32) for x in like)
    transpose = jax.linear_transpose(functools.partial(exchange, axis_name, reach, rows=rows),
                                     like)
    (returned,) = transpose(tuple(halo_dkv))
    return returned


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def window_attention(axis_name: str | tuple[str, ...], options: Options, reach: tuple[int, int],
                     q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens):
    """Windowed all-gather attention: one kernel call over ``[left halo, own shard, right
    halo]`` (all a window can see), ``(out float32, lse float32)``.

    Args: as ``halo_attention``.
    Returns:
      ``out float32[B, L, H, Dv]``, ``lse float32[B, L, H]`` (and the row max logits
      ``float32[B, L, H]`` with ``options.return_max_logit``); the backward takes
      cotangents of both, computes dK/dV of the whole ``[B, left+L+right, ..]`` window
      in float32 and sends the halo's part back in float32.
    """
    return _window_forward(axis_name, options, reach, q, k, v, q_tokens, kv_tokens)[0]


def _window_forward(axis_name, options, reach, q, k, v, q_tokens, kv_tokens):
    if sum(reach):
        halo_kv = _exchange_kv(axis_name, options, reach, k, v)
        halo_tokens = _halo_tokens(axis_name, options, reach, kv_tokens)
        k, v = (_around(reach, own, pulled) for own, pulled in zip((k, v), halo_kv))
        kv_tokens = jax.tree.map(functools.partial(_around, reach), kv_tokens, halo_tokens)
    return kernels.forward(options, q, k, v, q_tokens, kv_tokens), (k, v, kv_tokens)  # [B, W+L, ..]


def _window_fwd(axis_name, options, reach, q, k, v, q_tokens, kv_tokens):
    result, window = _window_forward(axis_name, options, reach, q, k, v, q_tokens, kv_tokens)
    out, lse = result[:2]  # a third result, the row max logits, has no gradient
    return result, (q, q_tokens, window, out.astype(q.dtype), lse)


def _window_bwd(axis_name, options, reach, residuals, cotangents):
    q, q_tokens, (k, v, kv_tokens), out, lse = residuals
    dout, dlse = cotangents[:2]
    zeros = _zeros_like((q, k, v), q)
    dq, dk, dv = kernels.backward(options, q, k, v, q_tokens, kv_tokens, lse, _delta(out, dout, dlse),
                                  dout.astype(q.dtype), accumulate=zeros)  # float32
    left, right = reach
    own = slice(left, dk.shape[1] - right)
    dk_own, dv_own = dk[:, own], dv[:, own]  # [B, L, Hkv, D] float32
    if left + right:
        halo = tuple(jnp.concatenate([x[:, :left], x[:, own.stop:]], axis=1)
                     for x in (dk, dv))  # [B, left+right, Hkv, D]
        returned = send_back(axis_name, reach, halo, (dk_own, dv_own))
        dk_own, dv_own = dk_own + returned[0], dv_own + returned[1]
    no_grad = jax.tree.map(lambda _: None, (q_tokens, kv_tokens))
    return dq.astype(q.dtype), dk_own.astype(k.dtype), dv_own.astype(v.dtype), *no_grad


window_attention.defvjp(_window_fwd, _window_bwd)


def _delta(out, dout, dlse):
    """``<dout, out> - dlse`` per row, float32 ``[B, L, H]`` (the kernels' backward input)."""
    return jnp.einsum("bqhd,bqhd->bqh", dout.astype(jnp.float32),
                      out.astype(jnp.float32)) - dlse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def halo_attention(axis_name: str | tuple[str, ...], options: Options, reach: tuple[int, int],
                   q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens):
    """Windowed ring attention by halo exchange: ``(out float32, lse float32)``.

    Args:
      axis_name: the sequence axis; options: the call's static ``Options``;
      reach: ``(left, right)`` from :func:`mask_reach`.
      q, k, v: ``[B, L, H|Hkv, D]`` local shards of a contiguous split; q_tokens,
        kv_tokens: their metadata.
    Returns:
      ``out float32[B, L, H, Dv]``, ``lse float32[B, L, H]`` (and the row max logits
      ``float32[B, L, H]`` with ``options.return_max_logit``); the backward takes
      cotangents of both, re-uses the received halo (saved, ``left + right``
      tokens) and sends float32 dK/dV back along the hops.
    """
    return _forward(axis_name, options, reach, q, k, v, q_tokens, kv_tokens)[0]


def _forward(axis_name, options, reach, q, k, v, q_tokens, kv_tokens):
    halo_kv = _exchange_kv(axis_name, options, reach, k, v) if sum(reach) else None
    result = kernels.forward(options, q, k, v, q_tokens, kv_tokens)  # hides the exchange
    if halo_kv is None:
        return result, (None, None)
    halo_tokens = _halo_tokens(axis_name, options, reach, kv_tokens)
    halo_k, halo_v = halo_kv
    result = merge_results(result, kernels.forward(options, q, halo_k, halo_v, q_tokens,
                                                   halo_tokens))
    return result, (halo_kv, halo_tokens)


def _halo_fwd(axis_name, options, reach, q, k, v, q_tokens, kv_tokens):
    result, halo = _forward(axis_name, options, reach, q, k, v, q_tokens, kv_tokens)
    out, lse = result[:2]  # a third result, the row max logits, has no gradient
    return result, (q, k, v, q_tokens, kv_tokens, out.astype(q.dtype), lse, halo)


def _halo_bwd(axis_name, options, reach, residuals, cotangents):
    q, k, v, q_tokens, kv_tokens, out, lse, (halo_kv, halo_tokens) = residuals
    dout, dlse = cotangents[:2]
    delta = _delta(out, dout, dlse)
    dout = dout.astype(q.dtype)
    dq = _compat.match_varying(jnp.zeros(q.shape, jnp.float32), q)
    returned = None
    if halo_kv is not None:
        halo_k, halo_v = halo_kv
        dq, *halo_dkv = kernels.backward(options, q, halo_k, halo_v, q_tokens, halo_tokens,
                                         lse, delta, dout,
                                         accumulate=(dq, *_zeros_like(halo_kv, q)))
        # Sent back while the local kernel below runs.
        returned = send_back(axis_name, reach, halo_dkv, (k, v))
    dq, dk, dv = kernels.backward(options, q, k, v, q_tokens, kv_tokens, lse, delta, dout,
                                  accumulate=(dq, *_zeros_like((k, v), q)))
    if returned is not None:
        dk, dv = dk + returned[0], dv + returned[1]
    no_grad = jax.tree.map(lambda _: None, (q_tokens, kv_tokens))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad


def _zeros_like(arrays, like):
    """float32 zeros shaped like ``arrays``, varying like ``like`` (fresh kernel buffers)."""
    return _compat.match_varying(tuple(jnp.zeros(x.shape, jnp.float32) for x in arrays), like)


halo_attention.defvjp(_halo_fwd, _halo_bwd)


def local_or_none(axis_name: str | tuple[str, ...], options: Options, q: jax.Array,
                  k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens, *,
                  contiguous: bool):
    """Attention of the shard's queries to its own keys where the mask's reach is
    ``(0, 0)`` (:func:`is_local`: chunks that fit a shard on the contiguous split, or
    documents on one shard each, ``max_document_shards=1``, in any order), else
    None: ``(out float32[B, L, H, Dv], lse float32[B, L, H])`` with no collective,
    forward or backward (Ulysses and the hybrid route here; the ring and the all-gather
    get the same from their halo forms). ``q, k, v``: ``[B, L, H|Hkv, D]`` shards of
    ``axis_name``; ``contiguous``: their positions are the contiguous split."""
    if not is_local(options.spec, q.shape[1], axis_size(axis_name),
                    bidirectional=q_tokens.bidirectional_ids is not None, contiguous=contiguous):
        return None
    return halo_attention(axis_name, options, (0, 0), q, k, v, q_tokens, kv_tokens)
