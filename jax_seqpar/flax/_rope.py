"""Rotary position embeddings (RoPE) on true token positions.

Paper: Su et al., RoFormer, arXiv:2104.09864. The rotate-half form (GPT-NeoX,
Llama): the two halves of each head's features form the complex pairs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """Rotate ``x`` by the angle of each token's position.

    Args:
      x: ``[B, S, heads, head_dim]`` queries or keys, ``head_dim`` even; any float dtype.
      positions: ``int32[B, S]`` (or ``[S]``) global token positions.
      base: the wavelength base of the rotation frequencies.

    Returns:
      ``[B, S, heads, head_dim]`` in ``x.dtype`` (angles and rotation in float32).

    Raises:
      ValueError: if ``head_dim`` is odd.

    .. code-block:: python

        q = apply_rope(q, jnp.arange(q.shape[1]))
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim. Got {head_dim=}.")
    half = head_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [D/2]
    positions = jnp.asarray(positions, jnp.float32)
    angles = positions[..., None] * inv_freq.reshape((1,) * positions.ndim + (half,))  # [B, S, D/2]
    cos = jnp.cos(angles)[..., None, :]  # [B, S, 1, D/2]
    sin = jnp.sin(angles)[..., None, :]
    if cos.ndim < x.ndim:  # positions given as [S]
        cos, sin = (jnp.broadcast_to(a, (1,) * (x.ndim - a.ndim) + a.shape) for a in (cos, sin))
    first, second = (part.astype(jnp.float32) for part in (x[..., :half], x[..., half:]))
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
