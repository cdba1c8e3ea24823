"""Shared pieces of the TPU (Mosaic) kernels: tiles, layouts, schedule and the call itself.

TPU tiling decides the layouts. A block's last two dims must be multiples of
``(8, 128)`` or span the whole array, so the kernels work heads-first
(``[B, H, S, D]``: a block is ``[tile, D]`` for any head dim, 64 to 576) and read
token metadata as a column ``[B, S, 1]`` (one value per sublane, for the tile's
rows) or a row ``[B, 1, S]`` (one value per lane, for its columns). Key-side tiles
are therefore multiples of 128 tokens, and so are query tiles, which are the lanes
of the transposed scores in the ``dk, dv`` kernel. Per-row statistics (``lse``,
``delta``) live in HBM lane-dense as ``[B, H, 1, S]`` (a trailing dim of 1 would be
padded to 128 lanes there) and are transposed in VMEM where a tile needs a column.

The schedule of a call is one ``int32[B, rows, cols]`` table in SMEM (scalar prefetch),
one plan per batch row (packed rows hold different documents):
``plan = fetch << 2 | class``, where ``class`` is the tile's
:func:`jax_seqpar.core.blocks.classify` class and ``fetch`` the tile the pipeline loads at
that step: the tile itself when it is not ``EMPTY``, else the last non-``EMPTY``
tile before it (or the first after it), so an ``EMPTY`` step repeats the previous
block index and the pipeline issues no copy for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_seqpar.core import blocks, compat as _compat, masks
from jax_seqpar.kernels import tiling as _tiling
from jax_seqpar.kernels.tiling import Tiling, pad_seq
from jax_seqpar.core.masks import Tokens

F32 = jnp.float32
LANES = 128
#: The dtypes the kernels take (the MXU inputs).
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
#: Low bits of a plan entry that hold the tile class (EMPTY / PARTIAL / FULL).
_CLASS_BITS = 2


def _tile_size(block: int, length: int) -> int:
    # Whole lanes even for short runs: per-row statistics are stored lane-dense
    # (``[.., 1, S]``) and transposed in VMEM, which needs 128-aligned tiles.
    return block if length > block else -(-length // LANES) * LANES


def tiling(q, k, block_q: int, block_k: int) -> Tiling:
    """Geometry of a call: whole blocks, or one tile when a sequence is shorter."""
    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    return Tiling(batch, kv_heads, heads // kv_heads, q_len, kv_len,
                  _tile_size(block_q, q_len), _tile_size(block_k, kv_len))


def heads_first(x, length):
    """``[B, S, H, D] -> [B, H, S_pad, D]``, the sequence zero-padded to ``length``."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))


def tokens_first(x, length):
    """Inverse of :func:`heads_first`: ``[B, H, S_pad, ...] -> [B, S, H, ...]``."""
    return jnp.swapaxes(x[:, :, :length], 1, 2)


def column(tokens: Tokens) -> Tokens:
    """Metadata ``[B, S]`` as ``[B, S, 1]``: one value per row of a tile."""
    return jax.tree.map(lambda x: x[:, :, None], tokens)


def row(tokens: Tokens) -> Tokens:
    """Metadata ``[B, S]`` as ``[B, 1, S]``: one value per column of a tile."""
    return jax.tree.map(lambda x: x[:, None, :], tokens)


def token_specs(tokens: Tokens, block_shape, index_map) -> Tokens:
    """One BlockSpec per metadata field ``tokens`` has (positions, segment and
    bidirectional ids)."""
    return _tiling.per_field(tokens, pl.BlockSpec(block_shape, index_map))


def plan(classes):
    """``int32[B, rows, cols]`` schedule (module docstring) from tile classes of that
    shape (per batch row)."""
    cols = jnp.arange(classes.shape[-1], dtype=jnp.int32)
    nonempty = classes != blocks.EMPTY
    last_before = lax.cummax(jnp.where(nonempty, cols, -1), axis=classes.ndim - 1)
    first = jnp.argmax(nonempty, axis=-1).astype(jnp.int32)[..., None]
    fetch = jnp.where(last_before >= 0, last_before, first)
    return (fetch << _CLASS_BITS) | classes.astype(jnp.int32)


def fetched(plan_ref, batch_index, row_index, col_index):
    """The tile index the pipeline loads at step ``(row_index, col_index)`` of batch row
    ``batch_index``."""
    # Shifts and masks: Mosaic lowers them on scalars without the device's generation.
    # The shift is int32 like the plan (a Python int is int64 under jax_enable_x64).
    return lax.shift_right_logical(plan_ref[batch_index, row_index, col_index],
                                   jnp.int32(_CLASS_BITS))


def run_tile(plan_ref, batch_index, row_index, col_index, tile_fn):
    """Run ``tile_fn(masked)`` on ``PARTIAL`` (masked) and ``FULL`` tiles of batch row
    ``batch_index``; skip ``EMPTY``."""
    tile_class = plan_ref[batch_index, row_index, col_index] & ((1 << _CLASS_BITS) - 1)
    pl.when(tile_class == blocks.PARTIAL)(lambda: tile_fn(True))
    pl.when(tile_class == blocks.FULL)(lambda: tile_fn(False))


def precision(dtype):
    # The MXU multiplies float32 in bfloat16 passes by default; the contract promises float32.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def dot(a, b, *, transpose_b=False, precision=None):
    """``a @ b`` (or ``a @ b.T``) of 2-D tiles, accumulated in float32."""
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def scaled_products(a, b, options, precision, scales=None):
    """float32 logits ``scale * a @ b.T`` before any soft-cap; ``scales``: FP8 operands'
    per-token ``(a's [n, 1], b's [1, m])`` float32 scales, applied to the products."""
    s = dot(a, b, transpose_b=True, precision=precision) * options.scale
    if scales is not None:
        s = s * scales[0] * scales[1]
    return s


def logits(a, b, options, precision, scales=None):
    """``(s, t)``: scaled (and soft-capped, ``options.softcap``) scores ``a @ b.T`` in
    float32, and ``t = tanh(raw / softcap)`` for the backward (``None`` without cap).
    ``scales``: FP8 operands' per-token ``(a's [n, 1], b's [1, m])`` float32 scales,
    applied to the float32 products."""
    return capped(scaled_products(a, b, options, precision, scales), options)


def capped(s, options):
    """``(s, t)`` of :func:`logits` from its uncapped logits ``s``."""
    cap = options.softcap
    if cap is None:
        return s, None
    t = jnp.tanh(s / cap)
    return cap * t, t


def visible(spec, rows: Tokens, cols: Tokens, *, rows_are_queries: bool):
    """The tile's ``bool[n, m]`` mask (:func:`jax_seqpar.core.masks.visible`), None
    where the spec masks nothing.

    ``rows`` / ``cols``: Tokens-of-refs of the tile's rows (``[n, 1]``) and columns
    (``[1, m]``); ``rows_are_queries=False`` is the transposed ``[key, query]`` tile of
    the dk/dv kernel: the predicate still gets the queries first (causality,
    bidirectional ids and ``mask_fn`` are not symmetric)."""
    row, col = _tiling.loaded(rows), _tiling.loaded(cols)
    q, kv = (row, col) if rows_are_queries else (col, row)
    return masks.visible(spec, q, kv)


def masked(s, spec, rows: Tokens, cols: Tokens, *, rows_are_queries: bool):
    """``s`` with invisible pairs (:func:`visible`) at ``-inf``."""
    mask = visible(spec, rows, cols, rows_are_queries=rows_are_queries)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def cost(*, flops, transcendentals, arrays):
    """The :class:`pl.CostEstimate` of a call that reads or writes ``arrays`` once each
    (arrays or shape structs). XLA:TPU's scheduler reads it: a custom call without one
    looks free, which changes what it overlaps and which buffers it keeps live at once
    (measured: the ring's forward + backward at S=32768 on v5p needs 20 % more memory
    without it)."""
    accessed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(arrays))
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                           bytes_accessed=int(accessed))


def pallas(body, *, name, grid, in_specs, out_specs, out_shape, scratch_shapes,
           semantics, like, cost_estimate=None, input_output_aliases=None):
    """``pallas_call`` with a scalar-prefetched plan, compiled by Mosaic when the program
    is lowered for TPU and run by the Pallas interpreter everywhere else.

    ``cost_estimate``: :func:`cost`; ``input_output_aliases``: ``{operand: output}``,
    operands counted as the call's flattened arguments (0: the plan), for results
    written in place of an input.

    The choice follows the LOWERING platform (``lax.platform_dependent``), so a
    program compiled ahead of time for TPU from a CPU host gets the Mosaic kernel.
    The interpreter is ``interpret=True`` (TPU grid, scalar prefetch and VMEM
    scratch semantics): ``pltpu.InterpretParams()`` also simulates DMAs and
    semaphores, which these kernels do not use, and is far slower inside an
    8-device ``shard_map`` on CPU.
    """
    out_shape = jax.tree.map(lambda s: _compat.shape_struct(s.shape, s.dtype, like), out_shape)

    def build(interpret):
        return pl.pallas_call(
            body,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs,
                scratch_shapes=scratch_shapes),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            interpret=interpret,
            name=name,
            cost_estimate=cost_estimate,
            input_output_aliases=input_output_aliases or {},
        )

    def call(*args):
        return lax.platform_dependent(*args, tpu=build(False),
                                      default=build(True))

    return call


def widened(x):
    """An FP8 tile in bfloat16 for the MXU (v5p has no FP8 matrix unit; every FP8 value
    is a bfloat16 one, so nothing is rounded); other tiles as they are."""
    return x.astype(jnp.bfloat16) if jnp.dtype(x.dtype).itemsize == 1 else x


def scale_rows(scales, lengths):
    """FP8 per-token scales ``float32[B, S, H]`` each, as lane-dense rows ``[B, H, 1,
    S_pad]`` (``lengths``: each one's padded length), like the statistics."""
    return [jnp.swapaxes(pad_seq(x, n), 1, 2)[:, :, None] for x, n in zip(scales, lengths)]


def vmem(shape):
    return pltpu.VMEM(shape, F32)


def row_to_column(x):
    """``[1, n] -> [n, 128]`` (every lane a copy): a lane-dense row of per-row
    statistics turned into the sublane-major form a ``[n, m]`` tile broadcasts."""
    return jnp.broadcast_to(x, (LANES, x.shape[1])).T


def column_to_row(x):
    """``[n, 128]`` lane-replicated statistics -> ``[1, n]``, lane-dense for HBM
    (a ``[n, 1]`` array would be padded to 128 lanes there)."""
    return x.T[:1]
