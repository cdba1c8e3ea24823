"""Flax integration: an ``attention_fn`` adapter for Flax's multi-head attention
layers (NNX and Linen) and a ready NNX ``SelfAttention`` layer (extra ``[flax]``)."""

from jax_seqpar.core.extras import require

require("flax", "flax", "jax_seqpar.flax")

from jax_seqpar.flax._attention_fn import make_attention_fn as make_attention_fn
from jax_seqpar.flax._rope import apply_rope as apply_rope
from jax_seqpar.flax._self_attention import SelfAttention as SelfAttention

__all__ = ["SelfAttention", "apply_rope", "make_attention_fn"]
