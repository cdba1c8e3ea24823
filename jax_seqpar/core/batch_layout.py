"""Put a whole training batch into a token order once, and back.

A layout is a property of the token order (see :mod:`jax_seqpar.core.layout`). Models
apply it ONCE per batch, to every per-token array (tokens, labels, segment ids,
loss weights) together, and hand the resulting ``positions`` to every attention
layer (``sequence_parallel_attention(..., positions=)``, RoPE): no layer then
moves tokens, and each sends exactly what its strategy needs. A loss that is a
(weighted) mean over tokens does not depend on their order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_seqpar.core import layout as layouts

_PERMUTE = {"zigzag": layouts.zigzag_permute, "striped": layouts.striped_permute}
_UNPERMUTE = {"zigzag": layouts.zigzag_unpermute, "striped": layouts.striped_unpermute}


def _check(batch, layout: str, axis: int):
    if layout not in layouts.LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {layouts.LAYOUTS}.")
    shapes = {x.shape[:axis + 1] for x in jax.tree.leaves(batch)}
    if len(shapes) != 1:
        raise ValueError(f"every array of the batch must share its leading [batch, seq] dims "
                         f"(up to axis {axis}). Got {sorted(shapes)}.")
    return shapes.pop()


def permute_batch(batch, layout: str, num_shards: int, *, axis: int = 1):
    """Reorder every array of ``batch`` into ``layout`` along the sequence ``axis``.

    Args:
      batch: a pytree of arrays that share ``[B, S]`` leading dims (e.g. ``tokens
        int32[B, S]``, ``targets``, ``segment_ids``, ``weights``, ``[B, S, d]``
        embeddings), in natural token order.
      layout: ``"contiguous"`` (nothing moves), ``"zigzag"`` or ``"striped"``.
      num_shards: ``P``, the number of sequence shards the layout is for.
      axis: the sequence axis (default 1).

    Returns:
      ``(batch, positions)``: the batch in layout order, and ``int32[B, S]`` the global
      position of every token in that order, for ``positions=`` and RoPE.

    Raises:
      ValueError: an unknown layout, arrays that disagree on ``[B, S]``, or a
        sequence the layout cannot split (zigzag needs ``S % 2P == 0``).

    >>> batch, positions = permute_batch({"tokens": tokens, "targets": targets},
    ...                                  "zigzag", num_shards=8)
    """
    lead = _check(batch, layout, axis)
    seq_len = lead[axis]
    arange = jnp.arange(seq_len, dtype=jnp.int32)
    if layout != "contiguous":
        batch = jax.tree.map(lambda x: _PERMUTE[layout](x, num_shards, axis=axis), batch)
        arange = _PERMUTE[layout](arange, num_shards, axis=0)
    return batch, jnp.broadcast_to(arange, (*lead[:axis], seq_len))


def unpermute_batch(batch, layout: str, num_shards: int, *, axis: int = 1):
    """Inverse of :func:`permute_batch`: arrays in ``layout`` order back to natural order.

    Args:
      batch: a pytree of arrays sharing ``[B, S]`` leading dims (e.g. logits).
      layout, num_shards, axis: as given to :func:`permute_batch`.

    Returns:
      The batch in natural token order.
    """
    _check(batch, layout, axis)
    if layout == "contiguous":
        return batch
    return jax.tree.map(lambda x: _UNPERMUTE[layout](x, num_shards, axis=axis), batch)
