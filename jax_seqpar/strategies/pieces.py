"""The sequence pieces of Ulysses' exchange: how they are cut, sent and gathered.

Each device cuts its ``L = S/P`` local tokens twice (``u = L/2^(c-1)``,
:func:`jax_seqpar.strategies.heads.piece_sizes`): its K/V into ``2^(c-1)`` pieces of ``u``
tokens, its queries into pieces ``u, L/4, L/4, L/4, L/8, ..., 2u, u``. A piece's
all-to-all brings the ``P`` devices' piece for this device's ``H/P`` heads (their positions
and segment ids travel with them: any token order is exact). The pipelines that send them
(:mod:`jax_seqpar.strategies.seq_pipeline` around the kernel,
:mod:`jax_seqpar.strategies.ring_pieces` around the hybrid's ring) share what is here: the
packed exchange of pieces going both ways (:func:`send`) and the keys-first opening of
the forward (:func:`keys_first`). What each of the pipelines' kernel calls receives, in the
token order the all-to-alls give it, is listed here too, beside the cut
(:func:`kernel_calls`): the time model counts the tiles the kernels compute from it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_seqpar import kernels
from jax_seqpar.core.masks import Tokens
from jax_seqpar.strategies.head_pipeline import (heads_to_seq, seq_to_heads, sink_cotangents,
                                                 sink_gradient)
from jax_seqpar.strategies.wire import Wire, as_bytes, from_bytes
from jax_seqpar.strategies.inputs import Operands, Options, axis_size

#: A mesh axis name, or a tuple of them.
_Axes = str | tuple[str, ...]

__all__ = ["KernelCall", "Pieces", "RowCotangents", "concat", "cut_positions", "exchange",
           "kernel_calls", "keys_first", "local", "put", "send"]


def send(to_heads: list[jax.Array], to_seq: list[jax.Array], axis_name: _Axes,
         size: int) -> tuple[list[jax.Array], Any]:
    """ONE all-to-all for pieces going both ways (XLA runs one asynchronous all-to-all at
    a time: two around a kernel would leave one exposed):
    :func:`~jax_seqpar.strategies.head_pipeline.seq_to_heads` of each ``[B, s, n, D]`` of
    ``to_heads`` (``-> [B, P*s, n/P, D]``) and
    :func:`~jax_seqpar.strategies.head_pipeline.heads_to_seq` of each ``[B, P*s, n, D]``
    of ``to_seq`` (``-> [B, s, P*n, D]``), every piece flattened per destination device
    and packed along the features. Pieces of different dtypes (FP8 pieces encoded as
    bytes beside bf16 outputs: :mod:`jax_seqpar.strategies.wire`) travel as their bytes,
    still one all-to-all.

    Returns ``(raw, unpack)``: what the all-to-all returned and ``unpack(raw) -> (heads,
    seq)``. The pipelines pass ``raw`` through the barrier that closes a step and unpack
    after it: nothing reads the transfer before the barrier, so its end is scheduled
    after the step's kernel.
    """
    arrays = [*to_heads, *to_seq]
    if not arrays:
        return [], lambda raw: ([], [])
    dtypes = [x.dtype for x in arrays]
    if len(set(dtypes)) > 1:
        raw, unpack_bytes = send([as_bytes(x) for x in to_heads],
                                 [as_bytes(x) for x in to_seq], axis_name, size)

        def unpack_typed(raw):
            heads, seq = unpack_bytes(raw)
            typed = [from_bytes(x, d) for x, d in zip([*heads, *seq], dtypes)]
            return typed[:len(heads)], typed[len(heads):]

        return raw, unpack_typed
    b = arrays[0].shape[0]
    flat = [jnp.moveaxis(x.reshape(b, x.shape[1], size, -1), 2, 1).reshape(b, size, -1)
            for x in to_heads]  # [B, P (destination), s * n/P * D]
    flat += [x.reshape(b, size, -1) for x in to_seq]  # [B, P (destination), s * n * D]
    widths = [x.shape[-1] for x in flat]
    shapes = [x.shape for x in to_heads], [x.shape for x in to_seq]
    # Sent as [P, rows, 128]: the buffers tile without padding on TPU (a [B, P, width]
    # buffer with B = 1 pads its unit dimension there).
    packed = jnp.moveaxis(jnp.concatenate(flat, axis=-1), 1, 0)  # [P, B, sum of widths]
    lanes = 128 if packed[0].size % 128 == 0 else packed.shape[-1]
    packed = jax.lax.all_to_all(packed.reshape(size, -1, lanes), axis_name, split_axis=0,
                                concat_axis=0, tiled=True)  # [P (source), rows, lanes]

    def unpack(raw):
        got = jnp.moveaxis(raw[0].reshape(size, b, -1), 0, 1)  # [B, P (source), widths]
        parts = jnp.split(got, [sum(widths[:i]) for i in range(1, len(widths))], axis=-1)
        heads = [part.reshape(b, size * x[1], x[2] // size, x[3])
                 for part, x in zip(parts, shapes[0])]  # source-major: the device order
        seq = [jnp.moveaxis(part.reshape(b, size, x[1] // size, *x[2:]), 1, 2)
               .reshape(b, x[1] // size, size * x[2], x[3])
               for part, x in zip(parts[len(shapes[0]):], shapes[1])]
        return heads, seq

    return [packed], unpack


def exchange(to_heads: list[jax.Array], to_seq: list[jax.Array], axis_name: _Axes,
             size: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """:func:`send`, unpacked at once: ``(heads, seq)``."""
    raw, unpack = send(to_heads, to_seq, axis_name, size)
    return unpack(raw)


def _offsets(sizes: tuple[int, ...]) -> list[int]:
    """Where each piece of ``sizes`` starts."""
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _cut(x, size, sizes):
    """``[B, P*L, ...]`` in device order -> every piece's ``[B, P * s_i, ...]``: the order
    piece ``i``'s all-to-all concatenates the devices' tokens in."""
    b, rest = x.shape[0], x.shape[2:]
    x = x.reshape(b, size, -1, *rest)  # [B, P, L, ...]
    return [x[:, :, o:o + s].reshape(b, size * s, *rest) for o, s in zip(_offsets(sizes), sizes)]


def _piece_tokens(tokens, size, sizes):
    """Every piece's ``[B, P * s_i]`` metadata from the ``[B, P*L]`` device-ordered one."""
    parts = jax.tree.map(lambda x: _cut(x, size, sizes), tokens)
    return [jax.tree.map(lambda p, i=i: p[i], parts, is_leaf=lambda x: isinstance(x, list))
            for i in range(len(sizes))]


def local(x: jax.Array, sizes: tuple[int, ...], i: int) -> jax.Array:
    """Piece ``i`` of a local ``[B, L, ...]`` shard: ``[B, s_i, ...]``."""
    o = _offsets(sizes)[i]
    return x[:, o:o + sizes[i]]


def concat(pieces: list[Any]) -> Any:
    """Pieces along the sequence (axis 1), arrays or Tokens pytrees of them."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *pieces)


def put(full: Any, part: slice, piece: Any) -> Any:
    """``piece`` written into rows ``part`` (axis 1) of ``full`` (pytrees alike), in place:
    the pieces' buffers die as they are written, never a second whole-sequence copy (as
    :func:`concat` of pieces kept until the end would make). Measured, not assumed: the
    hybrid's float32 dq pieces are joined with :func:`concat` instead, because XLA:TPU
    kept two copies of a ``put`` accumulator (:mod:`jax_seqpar.strategies.ring_pieces`)."""
    return jax.tree.map(lambda f, p: f.at[:, part].set(p.astype(f.dtype)), full, piece)


class Pieces(NamedTuple):
    """How one exchange is cut: the query pieces' local ``sizes``, the K/V pieces'
    (``2^(c-1)`` of ``sizes[0]``), and every piece's ``[B, P*s]`` metadata after its
    all-to-all."""

    sizes: tuple
    kv_sizes: tuple
    q_tokens: list[Tokens]
    kv_tokens: list[Tokens]

    @classmethod
    def of(cls, axis_name: _Axes, sizes: tuple, operands: Operands,
           local_len: int) -> Pieces:
        if sum(sizes) != local_len:
            raise ValueError(f"chunk sizes {sizes} do not sum to the {local_len} local tokens.")
        kv_sizes = (sizes[0],) * (local_len // sizes[0])
        size = axis_size(axis_name)
        return cls(tuple(sizes), kv_sizes, _piece_tokens(operands.q_tokens, size, sizes),
                   _piece_tokens(operands.kv_tokens, size, kv_sizes))

    def parts(self, size: int) -> list[slice]:
        """Each query piece's rows in the gathered ``[B, P*L, ...]`` (piece-major: the
        order of ``concat(q_tokens)``), over ``size = P`` devices."""
        return [slice(size * o, size * (o + s)) for o, s in zip(_offsets(self.sizes), self.sizes)]

    def kv_rows(self, size: int) -> np.ndarray:
        """Where each of the ``P*L`` gathered keys lies in the piece-major ``[B, P*L, ...]``
        (:func:`keys_first`'s order), in device order (on the contiguous split: position
        order), over ``size = P`` devices: ``P*L`` static ints."""
        unit, local_len = self.kv_sizes[0], sum(self.kv_sizes)
        device, token = np.divmod(np.arange(size * local_len), local_len)
        piece, offset = np.divmod(token, unit)
        return piece * size * unit + device * unit + offset

    def rows(self, x: jax.Array, size: int) -> list[jax.Array]:
        """``[B, P*L, ...]`` in device order (a row statistic sent whole) -> every query
        piece's rows."""
        return _cut(x, size, self.sizes)


class KernelCall(NamedTuple):
    """One kernel call of a pipeline, as the time model counts it (host numpy):
    ``q_positions int[Sq]``, the positions of the call's queries in the order it takes
    them; ``kv_positions int[Sk]``, its keys' likewise; ``computes``, ``"forward"`` or the
    backward results the pipeline reads: ``"dq"``, ``"dkv"`` (dK and dV) or ``"all"``
    (priced by :attr:`jax_seqpar.planning.hardware.Hardware.split_backward`)."""

    q_positions: np.ndarray
    kv_positions: np.ndarray
    computes: str


def cut_positions(positions: np.ndarray, size: int, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """``int[P*L]`` positions of ``size = P`` devices' local tokens in device order -> every
    piece's ``int[P * s_i]``, in the order its all-to-all gathers them (the cut the pipelines
    run, ``Pieces.of``): device 0's ``s_i`` tokens, then device 1's, ..."""
    return [part[0] for part in _cut(np.asarray(positions)[None], size, sizes)]


def kernel_calls(positions: np.ndarray, size: int, sizes: tuple[int, ...]) -> list[KernelCall]:
    """Every kernel call of Ulysses' sequence pipeline
    (:mod:`jax_seqpar.strategies.seq_pipeline`) over ``size = P`` devices whose local tokens
    have ``int[P*L]`` ``positions`` (device order), cut in query pieces of ``sizes`` local
    tokens (:func:`jax_seqpar.strategies.heads.piece_sizes`; K/V pieces of ``sizes[0]``).

    Forward: the first query piece against each K/V piece (:func:`keys_first`), then every
    further query piece against all the keys (piece-major, the order of
    ``concat(kv_tokens)``). Backward: each query piece's dq against all the keys, then each
    K/V piece's dK/dV against all the queries (piece-major). The gathered order interleaves
    the devices' pieces, so a tile can hold tokens far apart: a window skips fewer tiles
    than in the contiguous order.

    >>> [c.q_positions.size for c in kernel_calls(np.arange(8), 2, (1, 2, 1))[:6]]
    [2, 2, 2, 2, 4, 2]
    """
    kv_sizes = (sizes[0],) * (sum(sizes) // sizes[0])
    queries, keys = cut_positions(positions, size, sizes), cut_positions(positions, size, kv_sizes)
    all_queries, all_keys = np.concatenate(queries), np.concatenate(keys)
    return ([KernelCall(queries[0], kv, "forward") for kv in keys]
            + [KernelCall(q, all_keys, "forward") for q in queries[1:]]
            + [KernelCall(q, all_keys, "dq") for q in queries]
            + [KernelCall(all_queries, kv, "dkv") for kv in keys])


def keys_first(axis_name: _Axes, options: Options, q: jax.Array, k: jax.Array, v: jax.Array,
               pieces: Pieces, wire: Wire) -> tuple[Any, tuple, jax.Array, jax.Array, tuple]:
    """The forward's opening: every K/V piece, each travelling while the first query
    piece attends to the piece before it (the online softmax across pieces), and the
    second query piece while it meets the last.

    Args: the local ``[B, L, ., D]`` shards (K/V in q's dtype), ``wire``-encoded
    (:class:`~jax_seqpar.strategies.wire.Wire`; what arrives is decoded), and their cut.
    Returns ``(acc, (q0, q1), keys, values, local)``: the first query piece's running
    float32 ``(out, lse)`` against every key; the first two query pieces heads-sharded;
    the keys and values ``[B, P*L, h_kv, D]`` (piece-major: every K/V piece's
    ``P * u`` tokens in turn, the order of ``concat(pieces.kv_tokens)``); and the local
    shards as they passed the barriers (read them from there: the next piece's transfer
    cannot start before the previous step's kernels are done, one piece in flight).
    """
    size = axis_size(axis_name)
    sizes, kv_sizes = pieces.sizes, pieces.kv_sizes
    shards = (q, k, v)
    q0, k0, v0 = (wire.decode(x) for x in exchange(
        [local(q, sizes, 0), local(k, kv_sizes, 0), local(v, kv_sizes, 0)], [], axis_name,
        size)[0])
    ks, vs, q1 = [k0], [v0], None
    acc: Any = None
    for m in range(len(kv_sizes)):
        last = m + 1 == len(kv_sizes)
        raw, unpack = send([local(x, kv_sizes, m + 1) for x in shards[1:]] if not last
                           else [local(shards[0], sizes, 1)], [], axis_name, size)
        acc = kernels.forward(options, q0, ks[m], vs[m], pieces.q_tokens[0], pieces.kv_tokens[m],
                              accumulate=acc)
        acc, raw, shards = jax.lax.optimization_barrier((acc, raw, shards))
        upcoming = [wire.decode(x) for x in unpack(raw)[0]]
        if last:
            q1 = upcoming[0]
        else:
            ks.append(upcoming[0])
            vs.append(upcoming[1])
    return acc, (q0, q1), concat(ks), concat(vs), shards


class RowCotangents:
    """The backward's float32 row statistics of every query piece: ``<dout, out>`` of the
    rows and the lse's cotangent, computed sequence-sharded (``out`` as returned) and sent
    in ONE small exchange ahead of the first piece's ``dout``; and the sinks' gradient,
    summed over the pieces as they are taken."""

    def __init__(self, rows: list[jax.Array], operands: Operands, lses: list[jax.Array],
                 return_lse: bool):
        self._rows, self._operands, self._lses = rows, operands, lses
        self._return_lse = return_lse
        self._dsinks: list[jax.Array] = []

    @classmethod
    def of(cls, axis_name: _Axes, pieces: Pieces, operands: Operands, out: jax.Array,
           dout: jax.Array, dlse: Optional[jax.Array], lses: list[jax.Array],
           return_lse: bool) -> RowCotangents:
        """From the sequence-sharded ``out``, ``dout [B, L, H, Dv]`` and ``dlse [B, L, H]``;
        ``lses``: every query piece's float32 ``[B, P*s, h]`` log-sum-exp (without sinks)."""
        rowdot = jnp.einsum("bshd,bshd->bsh", dout.astype(jnp.float32),
                            out.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        stats = jnp.stack([rowdot] + ([dlse] if return_lse and dlse is not None else []),
                          axis=-1)  # [B, L, H, n]
        rows = pieces.rows(seq_to_heads(stats, axis_name), axis_size(axis_name))
        return cls(rows, operands, lses, return_lse)  # rows: [B, P*s_j, h, n] each

    def of_piece(self, j: int, dout_j: jax.Array, *, dtype: Any) -> tuple[jax.Array, jax.Array]:
        """Query piece ``j``'s ``(dout in dtype, delta)`` for the kernel (sinks taken out)."""
        rowdot = self._rows[j][..., 0]
        dlse = self._rows[j][..., 1] if self._return_lse else jnp.zeros_like(rowdot)
        if self._operands.sinks is None:
            return dout_j.astype(dtype), rowdot - dlse
        dout_j, _, delta, dsinks = sink_cotangents(dout_j, dlse, rowdot, self._lses[j],
                                                   self._operands)
        self._dsinks.append(dsinks)
        return dout_j.astype(dtype), delta

    def sinks_gradient(self) -> Optional[jax.Array]:
        """The sinks' gradient over every piece taken (None without sinks)."""
        if self._operands.sinks is None:
            return None
        return sink_gradient(sum(self._dsinks[1:], self._dsinks[0]), self._operands)
