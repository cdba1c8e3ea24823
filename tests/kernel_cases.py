"""The kernel matrix: attention problems every local kernel is held to, as one test helper.

A :class:`Case` is one attention problem written for 16-token tiles (the smallest Triton
takes), so a few dozen tokens give several tiles, ``EMPTY`` tiles and a ragged tail.
:func:`check` runs it on a kernel of :data:`KERNELS` at that kernel's tile
(:data:`TILES`): the Mosaic kernel's tile is the TPU lane width, 128, so its copy of a
case is :meth:`Case.scaled` by 8 (the same tiles, the same ragged tail, the same
``EMPTY`` tiles). The Pallas and Mosaic kernels run in the Pallas interpreter on CPU.
Each check compares ``out``, ``lse`` and the gradients of a random-weighted sum of both
(so the ``lse`` cotangent path runs) w.r.t. q, k and v against
:func:`jax_seqpar.core.reference.attention`, shapes and dtypes first; :func:`matrix`
turns cases into test parameters, one per kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checks
from jax_seqpar import kernels
from jax_seqpar.core import reference
from jax_seqpar.core.masks import PAD_SEGMENT, MaskSpec, Tokens
from jax_seqpar.kernels.options import Options
from jax_seqpar.kernels import make_options

KERNELS = ("xla", "pallas", "mosaic")
#: The tile every case runs with, per kernel: Triton's smallest, and the TPU lane width.
TILES = {"xla": 16, "pallas": 16, "mosaic": 128}
BASE_TILE = 16


class Case(NamedTuple):
    """One attention problem; its tokens (:func:`tokens`) and inputs are a function of it."""

    batch: int = 2
    q_len: int = 32
    kv_len: Optional[int] = None  # None: self-attention (kv_len = q_len)
    heads: int = 2
    kv_heads: int = 2
    d_qk: int = 16
    d_v: int = 16
    causal: bool = False
    window: Optional[tuple[int, int]] = None
    segments: bool = False  # documents ending at different tokens in each row
    q_start: Optional[int] = None  # first query position; None: the last q_len keys
    hole: bool = False  # key tile 1 is a document that no query belongs to
    softcap: Optional[float] = None
    chunk_size: Optional[int] = None  # Llama 4's chunked attention (tokens, scaled)
    # Bidirectional ids (causal only): "prefix", a prefix-LM prompt per document (its first
    # 6 tokens); "spans", several spans (images) with their own ids in one causal row.
    bidirectional: Optional[str] = None
    mask_fn: Optional[Callable] = None  # a module-level predicate (same object: one compile)
    pad: bool = False  # the last 3 tokens of every row are padding (PAD_SEGMENT)
    tile: int = BASE_TILE  # the tile the lengths above are written for

    @property
    def keys(self) -> int:
        return self.kv_len or self.q_len

    def scaled(self, tile: int) -> "Case":
        """The same problem for ``tile``-token tiles: every length and window times
        ``tile / self.tile``."""
        factor = tile // self.tile

        def times(n):
            return None if n is None else n * factor

        return self._replace(
            q_len=self.q_len * factor, kv_len=times(self.kv_len), q_start=times(self.q_start),
            window=None if self.window is None else tuple(w * factor for w in self.window),
            chunk_size=times(self.chunk_size), tile=tile)

    @property
    def spec(self) -> MaskSpec:
        return MaskSpec.make(self.causal, self.window, self.chunk_size, self.mask_fn)


def for_kernel(case: Case, kernel: str) -> Case:
    """``case`` at ``kernel``'s tile."""
    return case.scaled(TILES[kernel])


def matrix(cases, kernels_=KERNELS, marks=None):
    """``pytest.param(kernel, case)`` for every kernel and case (cases given as
    ``pytest.param(Case, id=...)``); ``marks(kernel, id)`` adds marks to one of them."""
    return [pytest.param(kernel, param.values[0], id=f"{kernel}-{param.id}",
                         marks=[*param.marks, *((marks or (lambda *_: ()))(kernel, param.id))])
            for param in cases for kernel in kernels_]


def stripes(q: Tokens, kv: Tokens):
    """A ``mask_fn``: every third run of 4 keys hidden, except a query's own position."""
    return ((kv.positions // 4) % 3 != 1) | (kv.positions == q.positions)


def skewed(q: Tokens, kv: Tokens):
    """A ``mask_fn`` that is not symmetric in queries and keys (holds the transposed
    orientation of the Mosaic dk/dv kernel)."""
    return (q.positions - 2 * kv.positions) % 7 != 0


def _bidirectional(case: Case, positions, segments):
    """Bidirectional ids ``int32[B, S]`` of a case's keys (see :class:`Case`)."""
    factor = case.tile // BASE_TILE
    if case.bidirectional == "prefix":  # the first 6 tokens of each document, id doc + 1
        starts = np.zeros_like(positions)
        if segments is not None:
            new = np.concatenate([np.ones_like(segments[:, :1], bool),
                                  segments[:, 1:] != segments[:, :-1]], axis=1)
            starts = np.maximum.accumulate(np.where(new, positions, 0), axis=1)
            doc = np.cumsum(new, axis=1)
        else:
            doc = np.ones_like(positions)
        return np.where(positions - starts < 6 * factor, doc, 0).astype(np.int32)
    spans = [(3, 9, 1), (13, 20, 2), (26, 30, 3)]  # "spans": images inside one causal row
    ids = np.zeros_like(positions)
    for lo, hi, value in spans:
        ids = np.where((positions >= lo * factor) & (positions < hi * factor), value, ids)
    return ids.astype(np.int32)


def tokens(case: Case):
    """``(q_tokens, kv_tokens)`` of a case (made on the host)."""
    kv_positions = np.broadcast_to(np.arange(case.keys, dtype=np.int32), (case.batch, case.keys))
    start = case.keys - case.q_len if case.q_start is None else case.q_start
    q_positions = np.broadcast_to(np.arange(start, start + case.q_len, dtype=np.int32),
                                  (case.batch, case.q_len))
    kv_segments = q_segments = None
    if case.hole:
        kv_segments = (kv_positions >= case.tile) & (kv_positions < 2 * case.tile)
        q_segments = np.zeros_like(q_positions)
    elif case.segments or case.pad:
        ends = np.array([[case.keys // 3], [case.keys // 2]])[:case.batch]
        kv_segments = ((kv_positions >= ends).astype(np.int32) + (kv_positions >= case.keys - 5)
                       if case.segments else np.zeros_like(kv_positions))
        if case.pad:
            kv_segments = np.where(kv_positions >= case.keys - 3 * case.tile // BASE_TILE,
                                   PAD_SEGMENT, kv_segments)
        q_segments = kv_segments[:, start:start + case.q_len]
    kv_bids = q_bids = None
    if case.bidirectional:
        kv_bids = _bidirectional(case, kv_positions, kv_segments)
        q_bids = kv_bids[:, start:start + case.q_len]

    def make(*fields):
        return Tokens(*(None if x is None else jnp.asarray(x, jnp.int32) for x in fields))

    return make(q_positions, q_segments, q_bids), make(kv_positions, kv_segments, kv_bids)


def inputs(case: Case, dtype):
    """``(q, k, v)`` in ``dtype`` and float32 weights for ``out`` and ``lse``."""
    q, k, v = checks.normals([(case.batch, case.q_len, case.heads, case.d_qk),
                              (case.batch, case.keys, case.kv_heads, case.d_qk),
                              (case.batch, case.keys, case.kv_heads, case.d_v)], dtype)
    weights = checks.normals([(case.batch, case.q_len, case.heads, case.d_v),
                              (case.batch, case.q_len, case.heads)], seed=1)
    return (q, k, v), tuple(weights)


def block_sizes(kernel: str, tile: int):
    """Every tile of ``kernel`` (forward and backward) ``tile`` tokens."""
    del kernel  # one tile-size class for every kernel
    return kernels.BlockSizes(**{f.name: tile for f in dataclasses.fields(kernels.BlockSizes)})


class Lowered:
    """The kernel contract's functions (``options`` after the operands), run through
    :mod:`jax_seqpar.kernels.lowering`: the kernel ``options.kernel`` chooses."""

    @staticmethod
    def forward(q, k, v, q_tokens, kv_tokens, options, accumulate=None):
        return kernels.forward(options, q, k, v, q_tokens, kv_tokens, accumulate)

    @staticmethod
    def backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, options, accumulate=None):
        return kernels.backward(options, q, k, v, q_tokens, kv_tokens, lse, delta, dout,
                                accumulate)

    @staticmethod
    def attention(q, k, v, q_tokens, kv_tokens, options):
        return kernels.attention(options, q, k, v, q_tokens, kv_tokens)


def value_and_grads(attend, inputs_, weights):
    """``(out, lse, (dq, dk, dv))`` of ``sum(out * w_out) + sum(lse * w_lse)``, one program."""
    out_weights, lse_weights = weights

    def loss(q, k, v):
        out, lse = attend(q, k, v)
        value = jnp.sum(out.astype(jnp.float32) * out_weights) + jnp.sum(lse * lse_weights)
        return value, (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*inputs_)
    return out, lse, grads


@functools.cache
def expected(case: Case, dtype):
    """Reference results on the case's inputs (bf16 inputs upcast), shared by kernels."""
    q_tokens, kv_tokens = tokens(case)

    def attend(q, k, v):
        return reference.attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), causal=case.causal,
            window=case.window, chunk_size=case.chunk_size, mask_fn=case.mask_fn,
            scale=case.d_qk**-0.5, softcap=case.softcap,
            positions=q_tokens.positions, segment_ids=q_tokens.segment_ids,
            kv_positions=kv_tokens.positions, kv_segment_ids=kv_tokens.segment_ids,
            bidirectional_ids=q_tokens.bidirectional_ids,
            kv_bidirectional_ids=kv_tokens.bidirectional_ids, return_lse=True)

    return value_and_grads(attend, *inputs(case, dtype))


def options(kernel: str, case: Case) -> Options:
    """The case's kernel options on ``kernel`` at the case's tile."""
    q = jax.ShapeDtypeStruct((case.batch, case.q_len, case.heads, case.d_qk), jnp.float32)
    return make_options(q, case.spec, scale=case.d_qk**-0.5, kernel=kernel,
                        block_sizes=block_sizes(kernel, case.tile), softcap=case.softcap)


def run(kernel: str, case: Case, dtype, poison: Optional[slice] = None):
    """``kernel``'s results on the case's inputs, keys/values in ``poison`` set to NaN."""
    q_tokens, kv_tokens = tokens(case)
    (q, k, v), weights = inputs(case, dtype)
    if poison is not None:
        k, v = k.at[:, poison].set(jnp.nan), v.at[:, poison].set(jnp.nan)
    call = options(kernel, case)

    def attend(q, k, v):
        return kernels.attention(call, q, k, v, q_tokens, kv_tokens)

    return value_and_grads(attend, (q, k, v), weights)


def check(kernel: str, case: Case, dtype, tolerances, poison: Optional[slice] = None):
    """Shapes and dtypes first, then out, lse and the gradients against the reference."""
    results = run(kernel, case, dtype, poison)
    out, lse, grads = results
    assert out.shape == (case.batch, case.q_len, case.heads, case.d_v)
    assert lse.shape == (case.batch, case.q_len, case.heads)
    assert out.dtype == lse.dtype == jnp.float32
    assert [g.shape for g in grads] == [x.shape for x in inputs(case, dtype)[0]]
    assert [g.dtype for g in grads] == [dtype] * 3
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, wanted in zip(names, jax.tree.leaves(results),
                                 jax.tree.leaves(expected(case, dtype))):
        kind = "grad" if name.startswith("d") else "out"
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(wanted, np.float32),
                                   err_msg=name, **tolerances(dtype, kind))
    return results
