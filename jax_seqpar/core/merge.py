"""The online-softmax merge of partial attention results: one implementation for all.

Attention sinks (gpt-oss; Xiao et al., arXiv:2309.17453) are one more merge: a
virtual key per head with logit ``sinks[h]`` and value zero, folded into a
finished ``(out, lse)`` by :func:`with_sinks`, once, whatever strategy made it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_sinks", "merge", "merge_across", "merge_results", "with_sinks"]


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array):
    """Combine attention over two disjoint sets of keys into attention over their union.

    Args:
      out_a, out_b: ``float32[B, S, H, Dv]`` normalized partial outputs.
      lse_a, lse_b: ``float32[B, S, H]`` their log-sum-exps (``EMPTY_LSE`` where a
        row saw no key; such a side gets weight exactly 0).
    Returns:
      ``(out float32[B, S, H, Dv], lse float32[B, S, H])``, exact and differentiable.
    """
    lse = jnp.maximum(lse_a, lse_b)
    weight_a = jnp.exp(lse_a - lse)
    weight_b = jnp.exp(lse_b - lse)
    total = weight_a + weight_b
    out = (out_a * (weight_a / total)[..., None] + out_b * (weight_b / total)[..., None])
    return out, lse + jnp.log(total)


def merge_results(a: tuple, b: tuple) -> tuple:
    """:func:`merge` of two partial results ``(out, lse)``, or ``(out, lse, max_logit)``
    where the call returns the max logit (QK-Clip): the third, ``float32[B, S, H]`` row
    maxima of the visible logits (``-inf``: none), merges by ``maximum`` (never
    differentiated)."""
    if len(a) != len(b) or len(a) not in (2, 3):
        raise ValueError(f"merge_results merges two (out, lse) or two (out, lse, max_logit) "
                         f"results. Got {len(a)} and {len(b)} arrays.")
    merged = merge(a[0], a[1], b[0], b[1])
    return merged if len(a) == 2 else (*merged, jnp.maximum(a[2], b[2]))


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array | None):
    """Add a zero-valued virtual key of logit ``sinks[h]`` to every row of a result.

    ``p_j = exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k))``: the output shrinks by
    ``exp(lse - lse')`` with ``lse' = logaddexp(lse, sinks[h])``. Differentiable
    in all three (kernels accept the ``(out, lse)`` cotangents this produces).

    Args:
      out: ``float32[B, S, H, Dv]`` normalized attention output.
      lse: ``float32[B, S, H]`` its log-sum-exp (``EMPTY_LSE``: the row saw no key
        and gets zeros).
      sinks: ``[H]`` per-head sink logits (any float dtype; used in float32), or
        None (returns the inputs).
    Returns:
      ``(out float32[B, S, H, Dv], lse float32[B, S, H])`` including the sink.
    """
    if sinks is None:
        return out, lse
    sinks = sinks.astype(jnp.float32).reshape(1, 1, -1)  # [1, 1, H] against [B, S, H]
    new_lse = jnp.logaddexp(lse, sinks)
    return out * jnp.exp(lse - new_lse)[..., None], new_lse


def check_sinks(sinks: jax.typing.ArrayLike | None,
                num_heads: int) -> jax.Array | None:
    """``sinks`` as a float ``[num_heads]`` array, or None; ``ValueError`` otherwise.

    One logit per head: a scalar is refused (it would not say whether every head shares
    it), and so are integer or bool arrays (logits are real numbers). Array-likes
    (lists, numpy) are converted.
    """
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)  # lists, numpy (a jax array or tracer is kept as is)
    shape = tuple(sinks.shape)
    if shape != (num_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        hint = (f"; for one logit shared by every head pass jnp.full(({num_heads},), "
                "value)" if shape == () else "")
        raise ValueError(f"sinks must be a float array of shape [num_heads]=({num_heads},). "
                         f"Got shape {shape} and dtype {sinks.dtype}: one logit per query "
                         f"head{hint}.")
    return sinks


def merge_across(out: jax.Array, lse: jax.Array, axis_name: str | tuple[str, ...],
                 sinks: jax.Array | None = None):
    """:func:`merge` of one partial result per device along ``axis_name``, in one reduction.

    Args:
      out: ``float32[B, S, H, Dv]`` this device's normalized partial output.
      lse: ``float32[B, S, H]`` its log-sum-exp.
      sinks: optional ``[H]`` sink logits, folded in after the merge (:func:`with_sinks`).
    Returns:
      ``float32[B, S, H, Dv]``, the same on every device (one ``pmax``, two ``psum`` s).
    """
    top = jax.lax.pmax(lse, axis_name)
    weight = jnp.exp(lse - top)
    total = jax.lax.psum(weight, axis_name)
    merged = jax.lax.psum(out * weight[..., None], axis_name) / total[..., None]
    if sinks is None:
        return merged
    return with_sinks(merged, top + jnp.log(total), sinks)[0]
