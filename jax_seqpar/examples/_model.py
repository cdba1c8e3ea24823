"""A small decoder-only byte-level Transformer in Flax NNX with sequence-parallel attention."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from jax_seqpar.api.attention import StrategyChoice
from jax_seqpar.core.layout import LayoutName
from jax_seqpar.core.masks import Tokens
from jax_seqpar.kernels import KernelName
from jax_seqpar.examples._data import VOCAB_SIZE
from jax_seqpar.flax import SelfAttention


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`TransformerLM`.

    Attributes:
      vocab_size: token vocabulary (256: bytes).
      d_model: residual stream width.
      num_layers: Transformer blocks.
      num_heads: query heads (Ulysses needs it divisible by the sequence axis size).
      num_kv_heads: key/value heads (GQA).
      mlp_hidden: hidden width of the MLP.
      local_window: with a value W, layers are local (causal sliding window of W
        past tokens) except every ``global_every``-th, which attends globally
        (Gemma 3's 5 local : 1 global is ``global_every=6``); None: all global.
      global_every: the period of global layers among local ones.
      softcap: attention logit soft-cap (Gemma 2), or None.
      sinks: learnable per-head attention sinks in every layer (gpt-oss).
      chunk_size: with a value C, the local layers (all but every ``global_every``-th)
        attend causally within chunks of C tokens (Llama 4's chunked attention, 3
        chunked : 1 global is ``global_every=4``); None: no chunks.
      compute_dtype: the dtype of the attention's matrix products in every layer (for
        example ``"float8_e4m3fn"``: FP8 scaled per token, the softmax and every sum in
        float32; :class:`jax_seqpar.Compute`), or None: the activations' own dtype.
    """

    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    mlp_hidden: int = 512
    local_window: Optional[int] = None
    global_every: int = 2
    softcap: Optional[float] = None
    sinks: bool = False
    chunk_size: Optional[int] = None
    compute_dtype: Optional[str] = None

    def is_local(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) is local: all but every ``global_every``-th."""
        return (layer + 1) % self.global_every != 0

    def window_of(self, layer: int):
        """The attention window of block ``layer`` (0-based): ``(W, 0)`` or None (global)."""
        if self.local_window is None or not self.is_local(layer):
            return None
        return (self.local_window, 0)

    def chunk_of(self, layer: int) -> Optional[int]:
        """The chunk size of block ``layer`` (0-based), or None (one chunk)."""
        return self.chunk_size if self.is_local(layer) else None


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Where and how attention splits the sequence (see :class:`jax_seqpar.flax.SelfAttention`).

    Attributes:
      mesh: the device mesh, or ``None`` for no sequence parallelism.
      seq_axes: the mesh axis splitting the sequence, or ``(outer, inner)`` for hybrid.
      strategy: ``"auto"``, ``"ulysses"``, ``"ring"``, ``"hybrid"`` or ``"allgather"``.
      kernel: the local attention kernel, ``"auto"``, ``"xla"``, ``"pallas"`` or ``"mosaic"``.
      fsdp: also shard parameters and optimizer state over the mesh's devices
        (ZeRO-3 / FSDP on the devices that split the sequence).
      per_document: put each batch in the per-document order of its segment ids
        (balanced causal work within packed documents) instead of zigzag.
    """

    mesh: Optional[jax.sharding.Mesh] = None
    seq_axes: Union[str, tuple] = "sp"
    strategy: StrategyChoice = "auto"
    kernel: KernelName = "auto"
    fsdp: bool = False
    per_document: bool = False

    @property
    def layout(self) -> LayoutName:
        """The token order each batch is put in once. ``"zigzag"`` balances the causal
        work of ring, hybrid and all-gather; Ulysses keeps ``"contiguous"`` (it attends
        to the whole sequence); ``"per_document"`` balances packed documents (when
        asked); ``"contiguous"`` without a mesh."""
        if self.mesh is None:
            return "contiguous"
        if self.per_document:
            return "per_document"
        return "contiguous" if self.strategy == "ulysses" else "zigzag"

    @property
    def num_shards(self) -> int:
        """The number of sequence shards, the product of the ``seq_axes`` sizes (1 without a mesh)."""
        if self.mesh is None:
            return 1
        axes = (self.seq_axes,) if isinstance(self.seq_axes, str) else self.seq_axes
        return math.prod(self.mesh.shape[a] for a in axes)


class Block(nnx.Module):
    """Pre-norm Transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, parallelism: Parallelism, *, layer: int,
                 rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.attention = SelfAttention(
            config.d_model, config.num_heads, num_kv_heads=config.num_kv_heads,
            mesh=parallelism.mesh, seq_axes=parallelism.seq_axes,
            strategy=parallelism.strategy, kernel=parallelism.kernel, causal=True,
            window=config.window_of(layer), chunk_size=config.chunk_of(layer),
            softcap=config.softcap, sinks=config.sinks, compute_dtype=config.compute_dtype,
            rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(config.d_model, config.mlp_hidden, rngs=rngs)
        self.mlp_out = nnx.Linear(config.mlp_hidden, config.d_model, rngs=rngs)

    def __call__(self, x, tokens: Tokens):
        """``x [B, S, d_model]``, ``tokens`` the batch's ``[B, S]`` metadata (positions
        None: natural order)."""
        x = x + self.attention(self.attention_norm(x), segment_ids=tokens.segment_ids,
                               positions=tokens.positions,
                               bidirectional_ids=tokens.bidirectional_ids)
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class TransformerLM(nnx.Module):
    """Decoder-only language model: bytes in, next-byte logits out.

    The parameters do not depend on ``parallelism``: one seed gives the same
    model whatever the mesh or strategy, so runs can be compared step by step.

    Attributes:
      config: the :class:`ModelConfig`.
      embed: token embedding, tied with the output projection.
      blocks: the Transformer blocks.
      final_norm: RMSNorm before the output projection.

    .. code-block:: python

        model = TransformerLM(ModelConfig(), Parallelism(mesh, strategy="ring"),
                              rngs=nnx.Rngs(0))
        logits = model(tokens, segment_ids=documents)  # [B, S, 256] float32
    """

    def __init__(self, config: ModelConfig, parallelism: Parallelism = Parallelism(), *,
                 rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(config, parallelism, layer=i, rngs=rngs)
                                for i in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                 positions: Optional[jax.Array] = None,
                 bidirectional_ids: Optional[jax.Array] = None):
        """``int32[B, S]`` tokens (document ids, global positions of the tokens as
        given: see :func:`jax_seqpar.permute_batch`, and bidirectional ids: a prefix or
        an image seen in both directions) -> ``float32[B, S, vocab]`` logits."""
        x = self.embed(tokens)  # [B, S, d_model]
        metadata = Tokens(positions, segment_ids, bidirectional_ids)
        for block in self.blocks:
            x = block(x, metadata)
        return self.embed.attend(self.final_norm(x)).astype(jnp.float32)  # [B, S, vocab]
