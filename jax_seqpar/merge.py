"""The online-softmax merge of partial attention results: one implementation for all."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge(out_a, lse_a, out_b, lse_b):
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


def merge_across(out, lse, axis_name):
    """:func:`merge` of one partial result per device along ``axis_name``, in one reduction.

    Args:
      out: ``float32[B, S, H, Dv]`` this device's normalized partial output.
      lse: ``float32[B, S, H]`` its log-sum-exp.
    Returns:
      ``float32[B, S, H, Dv]``, the same on every device (one ``pmax``, two ``psum`` s).
    """
    top = jax.lax.pmax(lse, axis_name)
    weight = jnp.exp(lse - top)
    total = jax.lax.psum(weight, axis_name)
    return jax.lax.psum(out * weight[..., None], axis_name) / total[..., None]
