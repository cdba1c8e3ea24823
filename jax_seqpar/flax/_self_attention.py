"""``SelfAttention``: a Flax NNX layer with q/k/v/o projections, GQA, RoPE and
sequence-parallel exact attention."""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from jax_seqpar.flax._attention_fn import attend
from jax_seqpar.flax._rope import apply_rope


class SelfAttention(nnx.Module):
    """Multi-head self-attention whose sequence may be split over a device mesh.

    ``x [B, S, d_model] -> q [B, S, H, Dh], k/v [B, S, Hkv, Dh]`` (RoPE on q and
    k at the tokens' positions) ``->`` exact attention ``-> [B, S, d_model]``.
    Models put each batch into a layout once (:func:`jax_seqpar.permute_batch`)
    and pass its ``positions`` to every layer, so no layer moves tokens; without
    ``positions`` the tokens are in natural order and each call relayouts them for
    load balance internally and back. Attention
    is Ulysses (arXiv:2309.14509), ring (arXiv:2310.01889), hybrid USP
    (arXiv:2405.07719) or all-gather; see
    :func:`jax_seqpar.sequence_parallel_attention`.

    Packed documents: pass ``segment_ids`` and tokens attend only within their
    document. RoPE positions stay global within the row; RoPE scores depend only
    on the distance between two tokens, so this equals restarting positions per
    document.

    Attributes:
      d_model: width of the input and output features.
      num_heads: ``H``, query heads.
      num_kv_heads: ``Hkv``, key/value heads (``H % Hkv == 0``; GQA, MQA); defaults
        to ``num_heads`` (MHA).
      head_dim: ``Dh``, features per head (even, for RoPE); defaults to
        ``d_model // num_heads``.
      mesh: the ``jax.sharding.Mesh`` to split the sequence over, or ``None``
        (default): unsharded, the local blockwise kernel.
      seq_axes: the mesh axis (or ``(outer, inner)`` for ``"hybrid"``) splitting
        the sequence; default ``"sp"``.
      strategy: ``"auto"`` (default), ``"ulysses"``, ``"ring"``, ``"hybrid"`` or
        ``"allgather"``.
      causal: decoder (causal) masking; default ``False``.
      window: sliding window ``(left, right)`` or one int, or ``None`` (default).
      layout: token order for the sharded call; ``"auto"`` (default) is zigzag
        where it balances causal work.
      kernel: local kernel, ``"auto"`` (default: Pallas on GPU, XLA elsewhere),
        ``"xla"`` or ``"pallas"``.
      rope_base: wavelength base of RoPE; default 10000.
      q_proj, k_proj, v_proj, o_proj: the ``nnx.LinearGeneral`` projections.

    >>> mesh = jax.make_mesh((8,), ("sp",))
    >>> layer = SelfAttention(256, 8, num_kv_heads=2, mesh=mesh, strategy="ring",
    ...                       causal=True, rngs=nnx.Rngs(0))
    >>> y = layer(x, segment_ids=documents)  # x: [B, S, 256], documents: int32[B, S]
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        mesh: Optional[jax.sharding.Mesh] = None,
        seq_axes: Union[str, tuple] = "sp",
        strategy: str = "auto",
        causal: bool = False,
        window=None,
        layout: str = "auto",
        kernel: str = "auto",
        rope_base: float = 10000.0,
        use_bias: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of "
                             f"num_kv_heads={num_kv_heads} (MHA, GQA or MQA).")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                                 "pass head_dim= explicitly.")
            head_dim = d_model // num_heads
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim. Got {head_dim=}.")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.mesh, self.seq_axes, self.strategy = mesh, seq_axes, strategy
        self.causal, self.window, self.layout, self.kernel = causal, window, layout, kernel
        self.rope_base = rope_base

        def projection(in_features, out_features, axis=-1):
            return nnx.LinearGeneral(in_features, out_features, axis=axis, use_bias=use_bias,
                                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.q_proj = projection(d_model, (num_heads, head_dim))
        self.k_proj = projection(d_model, (num_kv_heads, head_dim))
        self.v_proj = projection(d_model, (num_kv_heads, head_dim))
        self.o_proj = projection((num_heads, head_dim), d_model, axis=(-2, -1))

    def __call__(self, x: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                 positions: Optional[jax.Array] = None) -> jax.Array:
        """Attend.

        Args:
          x: ``[B, S, d_model]`` (sequence-sharded or not).
          segment_ids: ``int32[B, S]`` document ids of packed sequences, or None.
          positions: ``int32[B, S]`` global positions of the tokens as given (RoPE
            and masks use them, and no layer relayouts: see
            :func:`jax_seqpar.permute_batch`), or None for natural order.

        Returns:
          ``[B, S, d_model]``.
        """
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [batch, seq, d_model={self.d_model}]. "
                             f"Got x.shape={x.shape}.")
        rope_positions = jnp.arange(x.shape[1], dtype=jnp.int32) if positions is None \
            else positions  # [S] natural order, or [B, S] as given
        q = apply_rope(self.q_proj(x), rope_positions, base=self.rope_base)  # [B, S, H, Dh]
        k = apply_rope(self.k_proj(x), rope_positions, base=self.rope_base)  # [B, S, Hkv, Dh]
        v = self.v_proj(x)  # [B, S, Hkv, Dh]
        out = attend(q, k, v, mesh=self.mesh, seq_axes=self.seq_axes, strategy=self.strategy,
                     causal=self.causal, segment_ids=segment_ids, positions=positions,
                     window=self.window, layout=self.layout, kernel=self.kernel)  # [B, S, H, Dh]
        return self.o_proj(out)  # [B, S, d_model]
