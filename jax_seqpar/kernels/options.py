"""The static options of one attention call, the one object kernels take them in.

Built once by :func:`jax_seqpar.kernels.make_options` from the public keywords; strategies
reach every kernel through its :meth:`Options.forward` / :meth:`Options.backward` /
:meth:`Options.attention` (see :mod:`jax_seqpar.kernels.contract` for the contract).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from jax_seqpar.core import compat as _compat
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.kernels import tiling
from jax_seqpar.kernels.contract import BlockSizes, Kernel, check_softcap, resolve_block_sizes

__all__ = ["Options"]


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one attention call (hashable, for custom_vjp), the one
    object the kernels take them in.

    Attributes:
      spec: the mask (:class:`jax_seqpar.core.masks.MaskSpec`).
      scale: score multiplier.
      kernel: the kernel (see :func:`jax_seqpar.kernels.get`); the kernels themselves
        ignore it.
      block_sizes: the tile sizes, or None for the kernel's defaults.
      softcap: logit soft-cap (``softcap * tanh(s / softcap)``), or None.
    """

    spec: MaskSpec
    scale: float
    kernel: Kernel
    block_sizes: Optional[BlockSizes] = None
    softcap: Optional[float] = None

    def resolved(self, defaults: BlockSizes, kernel_name: str) -> "Options":
        """These options as a kernel runs them: tile sizes completed from ``defaults``
        (:func:`~jax_seqpar.kernels.contract.resolve_block_sizes`), the soft-cap checked (:func:`~jax_seqpar.kernels.contract.check_softcap`) and
        the scale a float. Raises ``ValueError`` naming ``kernel_name``."""
        if not isinstance(self.spec, MaskSpec):
            raise ValueError(f"options.spec must be a jax_seqpar.core.masks.MaskSpec (the mask "
                             f"{kernel_name} applies). Got {self.spec!r}.")
        return dataclasses.replace(
            self, scale=float(self.scale), softcap=check_softcap(self.softcap),
            block_sizes=resolve_block_sizes(self.block_sizes, defaults, kernel_name))

    def tiles(self, backward: bool = False) -> tuple[int, int]:
        """``(block_q, block_k)`` of the forward (or the backward) as :meth:`resolved`
        set them; ``ValueError`` on options a kernel has not resolved."""
        sizes = self.block_sizes or BlockSizes()
        block_q, block_k = ((sizes.block_q_bwd, sizes.block_k_bwd) if backward
                            else (sizes.block_q, sizes.block_k))
        if block_q is None or block_k is None:
            raise ValueError(f"the tile sizes are read after Options.resolved fills them in. "
                             f"Got block_sizes={self.block_sizes!r}.")
        return block_q, block_k

    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
                accumulate: tuple[jax.Array, jax.Array] | None = None):
        """The kernel's forward; with ``accumulate`` (the ``(out, lse)`` of earlier keys)
        the result covers both (see :mod:`jax_seqpar.kernels.contract`), and a call in
        which no query may see any key is skipped whole (``_unless_empty``)."""
        if accumulate is None:
            return self.kernel.forward(q, k, v, q_tokens, kv_tokens, self)
        return self._unless_empty(
            lambda: self.kernel.forward(q, k, v, q_tokens, kv_tokens, self, accumulate),
            accumulate, (q, k, v, q_tokens, kv_tokens))

    def backward(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
                 kv_tokens: Tokens, lse: jax.Array, delta: jax.Array, dout: jax.Array,
                 accumulate: tuple[jax.Array, jax.Array] | None = None):
        """The kernel's backward (float32 ``(dq, dk, dv)``, plus ``accumulate``); with
        ``accumulate``, skipped whole like :meth:`forward`."""
        def call():
            return self.kernel.backward(q, k, v, q_tokens, kv_tokens, lse, delta, dout, self,
                                        accumulate)
        if accumulate is None:
            return call()
        return self._unless_empty(call, accumulate, (q, k, v, q_tokens, kv_tokens))

    def may_be_empty(self, q_tokens: Tokens) -> bool:
        """Whether a whole call on these tokens can have no visible pair beyond what
        causality alone rules out cheaply: with documents (segment ids), chunks
        (``spec.chunk_size``) or bidirectional ids, a ring step or a pipeline's pair of
        chunks may share nothing (then ``_unless_empty`` skips its kernel)."""
        return (q_tokens.segment_ids is not None or q_tokens.bidirectional_ids is not None
                or self.spec.chunk_size is not None)

    def _unless_empty(self, call, accumulate, operands):
        """``call()``, or ``accumulate`` unchanged when no query may see any key
        (:func:`jax_seqpar.kernels.tiling.any_visible`, exact-conservative: a call it
        skips has no visible pair): a ring step whose K/V shard holds none of this
        shard's documents or chunks costs no kernel. Only where whole calls can be
        empty (:meth:`may_be_empty`; the test is a few tile summaries, other masks keep
        one kernel call)."""
        q_tokens, kv_tokens = operands[3:]
        if not self.may_be_empty(q_tokens):
            return call()
        like = (operands, accumulate)
        return jax.lax.cond(tiling.any_visible(self.spec, q_tokens, kv_tokens),
                            lambda: _compat.match_varying(tuple(call()), like),
                            lambda: _compat.match_varying(tuple(accumulate), like))

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
                  kv_tokens: Tokens):
        """The kernel's differentiable forward: ``(out float32, lse float32)``."""
        return self.kernel.attention(q, k, v, q_tokens, kv_tokens, self)
