"""``SelfAttention``: a Flax NNX layer with q/k/v/o projections, GQA, optional RoPE and
QK-norm, and sequence-parallel exact attention; Flax's decode convention and explicit
prefill / decode against a sequence-sharded KV cache."""

from __future__ import annotations

from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx


from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.api import attention, inference, kv_cache
from jax_seqpar.api.attention import LayoutChoice, StrategyChoice
from jax_seqpar.strategies.inputs import Metadata, describe
from jax_seqpar.core import checks, masks, quant
from jax_seqpar.flax._rope import apply_rope
from jax_seqpar.api.dot_product import without_segment_ids
from jax_seqpar.kernels.options import KernelName, Options, check_softcap, make_options


class SelfAttention(nnx.Module):
    """Multi-head self-attention whose sequence may be split over a device mesh.

    ``x [B, S, d_model] -> q [B, S, H, Dh], k/v [B, S, Hkv, Dh]`` (QK-norm, then RoPE
    on q and k at the tokens' positions, each where enabled) ``->`` exact attention
    ``-> [B, S, d_model]``.
    Models put each batch into a layout once (:func:`jax_seqpar.permute_batch`)
    and pass its ``positions`` to every layer, so no layer moves tokens; without
    ``positions`` the tokens are in natural order and each call relayouts them for
    load balance internally and back. Attention
    is Ulysses (arXiv:2309.14509), ring (arXiv:2310.01889), hybrid USP
    (arXiv:2405.07719) or all-gather; see
    :func:`jax_seqpar.sequence_parallel_attention`.

    Packed documents: pass ``segment_ids`` and tokens attend only within their
    document. Prefix-LM and vision-language masks: pass ``bidirectional_ids`` (with
    ``causal=True``) and tokens that carry the same non-zero id see each other in
    both directions. RoPE positions stay global within the row; RoPE scores depend only
    on the distance between two tokens, so this equals restarting positions per
    document.

    Decoding, Flax's convention (as ``nnx.MultiHeadAttention``): :meth:`init_cache`,
    then ``layer(x, decode=True)``. The first such call takes the prompts ``[B, S,
    d_model]`` and prefills the cache sequence-parallel (:meth:`prefill`); every later
    one appends ``T >= 1`` tokens per row (:meth:`decode`). The cache and its lengths
    live in the layer (``self.cache``, an ``nnx.Cache``; ``self.prefilled``), so no call
    passes positions or lengths. ``prefill`` / ``decode`` stay available for ragged
    prompts (``seq_lengths``).

    Attributes:
      d_model: width of the input and output features.
      num_heads: ``H``, query heads.
      num_kv_heads: ``Hkv``, key/value heads (``H % Hkv == 0``; GQA, MQA); defaults
        to ``num_heads`` (MHA).
      head_dim: ``Dh``, features per head (even, for RoPE); defaults to
        ``d_model // num_heads``.
      scale: the score multiplier, ``1/sqrt(head_dim)`` unless given (Gemma's
        ``query_pre_attn_scalar**-0.5``), as in
        :func:`jax_seqpar.sequence_parallel_attention`.
      mesh: the ``jax.sharding.Mesh`` to split the sequence over, or ``None``
        (default): unsharded, the local blockwise kernel.
      seq_axes: the mesh axis (or ``(outer, inner)`` for ``"hybrid"``) splitting
        the sequence; default ``"sp"``.
      strategy: ``"auto"`` (default), ``"ulysses"``, ``"ring"``, ``"hybrid"`` or
        ``"allgather"``.
      ulysses_size: with ``strategy="hybrid"`` on one sequence axis, Ulysses over
        groups of this many neighbouring devices and the ring across them (as in
        :func:`jax_seqpar.sequence_parallel_attention`); training calls only (decode
        mode refuses it).
      causal: decoder (causal) masking; default ``False``.
      window: sliding window ``(left, right)`` or one int, or ``None`` (default).
      chunk_size: tokens see each other only inside one chunk ``position //
        chunk_size`` (Llama 4's chunked layers), or ``None`` (default); decode mode
        keeps it.
      mask_fn: a jittable elementwise predicate ``mask_fn(q_tokens, kv_tokens) ->
        bool`` on :class:`jax_seqpar.core.masks.Tokens`, ANDed with the rest (see
        :class:`jax_seqpar.core.masks.MaskSpec`; in decode mode its tokens carry
        ``positions`` and ``bidirectional_ids``, no ``segment_ids``), or ``None``.
      layout: token order for the sharded call; ``"auto"`` (default) is zigzag
        where it balances causal work.
      kernel: local kernel, ``"auto"`` (default: Triton on GPU, Mosaic on TPU, XLA
        elsewhere), ``"xla"``, ``"pallas"`` or ``"mosaic"``.
      rope_base: wavelength base of RoPE; default 10000. ``None``: no rotary
        embedding (NoPE, Llama 4's global layers); positions then reach only the masks.
      qk_norm: a learned RMSNorm over each head's ``Dh`` features of q and of k
        (``q_norm``, ``k_norm``: ``nnx.RMSNorm``, scale ``[Dh]`` initialized to 1,
        epsilon 1e-6), before RoPE, as Gemma 3, Qwen 3 and OLMo 2 do; default ``False``.
      softcap: logit soft-cap (Gemma 2), or ``None`` (default).
      compute_dtype: the dtype of the attention's matrix products (FP8 scaled per block,
        :class:`jax_seqpar.Compute`), or ``None`` (default): the projections' dtype.
      sinks: learn one attention-sink logit per head (gpt-oss), an ``nnx.Param``
        ``float32[H]`` initialized to zero; default ``False``.
      q_proj, k_proj, v_proj, o_proj: the ``nnx.LinearGeneral`` projections.
      q_norm, k_norm: the QK-norm layers (``None`` without ``qk_norm``).
      dtype, param_dtype: the projections' computation and parameter dtypes (as in
        ``nnx.LinearGeneral``); the KV cache's default dtype is ``dtype``, else
        ``param_dtype``.
      cache: decode mode's ``nnx.Cache`` holding a sequence-sharded
        :class:`~jax_seqpar.api.inference.KVCache` (``None`` until :meth:`init_cache`);
        :meth:`prefill` fills it, :meth:`decode` appends to it.
      prefilled: whether the cache holds prompts (static: set by the first
        ``decode=True`` call, :meth:`prefill` or :meth:`decode`; cleared by
        :meth:`init_cache`), so the next ``decode=True`` call appends. Being static, a
        jitted call that sets it is traced again when next called: start every request
        with :meth:`init_cache` (then the prompt's program and the step's each compile
        once).

    .. code-block:: python

        mesh = jax.make_mesh((8,), ("sp",))
        layer = SelfAttention(256, 8, num_kv_heads=2, mesh=mesh, strategy="ring",
                              causal=True, qk_norm=True, rngs=nnx.Rngs(0))
        y = layer(x, segment_ids=documents)  # x: [B, S, 256], documents: int32[B, S]
        layer.init_cache(batch=B, capacity=1024)
        y = layer(prompts, decode=True)       # [B, S, 256]: prefill
        y = layer(next_token, decode=True)    # [B, 1, 256]: append
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
        strategy: StrategyChoice = "auto",
        ulysses_size: Optional[int] = None,
        causal: bool = False,
        window: int | tuple[int, int] | None = None,
        chunk_size: Optional[int] = None,
        mask_fn: Optional[Callable] = None,
        layout: LayoutChoice = "auto",
        kernel: KernelName = "auto",
        rope_base: Optional[float] = 10000.0,
        qk_norm: bool = False,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        compute_dtype: ComputeLike = None,
        sinks: bool = False,
        use_bias: bool = False,
        dtype: jax.typing.DTypeLike | None = None,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        # refused before any call
        masks.MaskSpec.make(checks.flag("causal", causal), window, chunk_size, mask_fn)
        check_softcap(softcap)
        quant.compute(compute_dtype, jnp.float32)
        checks.scale(scale)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of "
                             f"num_kv_heads={num_kv_heads} (MHA, GQA or MQA).")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; "
                                 "pass head_dim= explicitly.")
            head_dim = d_model // num_heads
        if rope_base is not None and head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim. Got {head_dim=}; pass an even "
                             "head_dim, or rope_base=None for no rotary embedding.")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.mesh, self.seq_axes, self.strategy = mesh, seq_axes, strategy
        self.ulysses_size = ulysses_size
        self.causal, self.window, self.layout, self.kernel = causal, window, layout, kernel
        self.chunk_size, self.mask_fn = chunk_size, mask_fn
        self.rope_base, self.softcap, self.scale = rope_base, softcap, scale
        self.compute_dtype = compute_dtype
        self.dtype, self.param_dtype = dtype, param_dtype
        self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32)) if sinks else None

        def projection(in_features, out_features, axis=-1):
            return nnx.LinearGeneral(in_features, out_features, axis=axis, use_bias=use_bias,
                                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.q_proj = projection(d_model, (num_heads, head_dim))
        self.k_proj = projection(d_model, (num_kv_heads, head_dim))
        self.v_proj = projection(d_model, (num_kv_heads, head_dim))
        self.o_proj = projection((num_heads, head_dim), d_model, axis=(-2, -1))
        norm = lambda: nnx.RMSNorm(head_dim, epsilon=1e-6, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
        qk_norm = checks.flag("qk_norm", qk_norm)
        self.q_norm: Optional[nnx.RMSNorm] = nnx.data(norm() if qk_norm else None)
        self.k_norm: Optional[nnx.RMSNorm] = nnx.data(norm() if qk_norm else None)
        # decode mode: an nnx.Cache of a KVCache, see init_cache
        self.cache: Optional[nnx.Cache[inference.KVCache]] = nnx.data(None)
        self.prefilled = False

    def __call__(self, x: jax.Array, *, segment_ids: Optional[jax.Array] = None,
                 positions: Optional[jax.Array] = None,
                 bidirectional_ids: Optional[jax.Array] = None,
                 decode: bool = False, return_max_logit: bool = False):
        """Attend.

        Args:
          x: ``[B, S, d_model]`` (sequence-sharded or not).
          segment_ids: ``int32[B, S]`` document ids of packed sequences, or None.
          bidirectional_ids: ``int32[B, S]`` (a causal layer): tokens of one non-zero id
            see each other in both directions (a document's prefix, an image), or None.
          positions: ``int32[B, S]`` global positions of the tokens as given (RoPE
            and masks use them, and no layer relayouts: see
            :func:`jax_seqpar.permute_batch`), or None for natural order.
          decode: Flax's decode convention (after :meth:`init_cache`): the first call
            prefills the cache with the prompts ``x`` (:meth:`prefill`, every row ``S``
            tokens long), later calls append ``x [B, T, d_model]`` after the cached
            tokens (:meth:`decode`). The layer tracks positions and lengths itself:
            ``segment_ids`` and ``positions`` are refused; ``bidirectional_ids`` pass on.
          return_max_logit: also return ``float32[H]``, the layer's max logit per head
            for QK-Clip (as in :func:`jax_seqpar.sequence_parallel_attention`; not with
            ``decode``).

        Returns:
          ``[B, S, d_model]``; with ``return_max_logit``, ``(y, max_logit)``.
        """
        if checks.flag("decode", decode):
            if checks.flag("return_max_logit", return_max_logit):
                raise ValueError("decode=True does not return the max logit (a training "
                                 "statistic, QK-Clip): call the layer without decode.")
            if segment_ids is not None or positions is not None:
                raise ValueError("decode=True tracks the tokens' positions in the layer's cache "
                                 "and takes no segment_ids or positions; pass only x (and "
                                 "bidirectional_ids).")
            metadata = self._decode_metadata(bidirectional_ids)
            if self.prefilled:
                return self._decode(x, metadata)
            return self._prefill(x, None, metadata)
        rope_positions = jnp.arange(x.shape[1], dtype=jnp.int32) if positions is None \
            else positions  # [S] natural order, or [B, S] as given
        q, k, v = self._projected_qkv(x, rope_positions)  # [B, S, H | Hkv, Dh]
        options, metadata = describe(
            q, k, v, local=False, causal=self.causal, window=self.window, chunk_size=self.chunk_size,
            mask_fn=self.mask_fn, scale=self.scale, kernel=self.kernel, softcap=self.softcap,
            compute_dtype=self.compute_dtype, segment_ids=segment_ids, positions=positions, bidirectional_ids=bidirectional_ids,
            sinks=self._sink_logits(), return_max_logit=return_max_logit)
        where = attention.placement(q, k, v, options, metadata, mesh=self.mesh,
                                    seq_axes=self.seq_axes, strategy=self.strategy,
                                    layout=self.layout, ulysses_size=self.ulysses_size)
        out = attention.attend(q, k, v, options, metadata, where)  # [B, S, H, Dh] (, [H])
        if options.return_max_logit:
            return self.o_proj(out[0]), out[1]
        return self.o_proj(out)  # [B, S, d_model]

    # --- decode mode: prefill and decode against a sequence-sharded KV cache ---------

    def init_cache(self, batch: int, capacity: int, *,
                   dtype: jax.typing.DTypeLike | None = None) -> None:
        """Enter decode mode: an empty :class:`~jax_seqpar.api.inference.KVCache` as NNX state.

        The cache is an ``nnx.Cache`` variable (``self.cache``), sharded along
        ``seq_axes`` of ``mesh`` (without a mesh: on one device), so ``nnx.split``
        / ``nnx.state(layer, nnx.Cache)`` carry it through ``jax.jit``. The next
        ``layer(x, decode=True)`` prefills it.

        Args:
          batch, capacity: rows and token slots per row (a multiple of the shards).
          dtype: storage dtype of the cached keys and values; default the layer's
            ``dtype``, else its ``param_dtype`` (the dtype of its queries for inputs
            no wider than its parameters). Decoding attends in the cache's dtype:
            a cache narrower than the queries (a bfloat16 cache for a float32 layer, to
            halve its memory) casts the new q, k and v to it; the output is the layer's.
            An FP8 cache (``jnp.float8_e4m3fn``, ``float8_e5m2``) stores FP8 values and
            per-token scales and computes in FP8 (the layer's ``compute_dtype`` must be
            None or that dtype); q, k and v stay in the layer's dtype.
        """
        if not self.causal:
            raise ValueError("decode mode needs a causal layer; create SelfAttention(..., "
                             "causal=True).")
        if self.ulysses_size is not None:
            raise ValueError(f"decode mode attends over its cache's axes and cannot split one "
                             f"(ulysses_size={self.ulysses_size}); create the layer without "
                             "ulysses_size= for decoding.")
        mesh, seq_axes = self.mesh, self.seq_axes
        if mesh is None:
            mesh, seq_axes = jax.sharding.Mesh(jax.devices()[:1], ("sp",)), "sp"
        if dtype is None:
            dtype = self.param_dtype if self.dtype is None else self.dtype
        cache = inference.KVCache.create(
            mesh, batch=batch, capacity=capacity, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=dtype, seq_axes=seq_axes)
        kv_cache.cache_compute(self.compute_dtype, cache)  # an FP8 cache's: refused now
        self.cache = nnx.Cache(cache)
        self.prefilled = False

    def _cache_variable(self) -> nnx.Cache[inference.KVCache]:
        if self.cache is None:
            raise ValueError("this SelfAttention has no KV cache; call "
                             "layer.init_cache(batch, capacity) first.")
        return self.cache

    def _kv_cache(self) -> inference.KVCache:
        return self._cache_variable().get_value()

    def _sink_logits(self) -> Optional[jax.Array]:
        return None if self.sinks is None else self.sinks[...]

    def _decode_metadata(self, ids: Optional[jax.Array]) -> Metadata:
        """The per-token data of prefill and decode: the tokens' bidirectional ``ids``
        (``int32[B, S | T]`` or None) and this layer's sinks."""
        return Metadata(bidirectional_ids=ids, sinks=self._sink_logits())

    def _decode_options(self, q: jax.Array) -> Options:
        """What prefill and decode compute: this layer's mask made causal, its predicate
        blind to segment ids (decoding makes its own), its scale, kernel and soft-cap,
        its compute dtype (an FP8 cache's: :func:`~jax_seqpar.api.kv_cache.cache_compute`)."""
        spec = masks.MaskSpec.make(True, self.window, self.chunk_size, self.mask_fn)
        compute_dtype = kv_cache.cache_compute(self.compute_dtype, self._kv_cache())
        return make_options(q, without_segment_ids(spec), scale=self.scale, kernel=self.kernel,
                            softcap=self.softcap, compute_dtype=compute_dtype)

    def _projected_qkv(self, x, positions, cache: Optional[inference.KVCache] = None):
        """``q [B, S, H, Dh], k, v [B, S, Hkv, Dh]`` of ``x`` at ``positions``: projected,
        QK-normed and rotated where enabled; in ``cache``'s dtype when given (not FP8: an
        FP8 cache quantizes them itself)."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [batch, seq, d_model={self.d_model}]. "
                             f"Got x.shape={x.shape}.")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, S, H | Hkv, Dh]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over Dh, per head
        if self.rope_base is not None:
            q = apply_rope(q, positions, base=self.rope_base)
            k = apply_rope(k, positions, base=self.rope_base)
        if cache is not None and not cache.fp8:
            q, k, v = (t.astype(cache.k.dtype) for t in (q, k, v))
        return q, k, v

    def prefill(self, x: jax.Array, *, seq_lengths: Optional[jax.Array] = None,
                bidirectional_ids: Optional[jax.Array] = None) -> jax.Array:
        """Attend over prompts sequence-parallel and fill the cache with their K/V.

        Args:
          x: ``[B, S, d_model]`` prompts at positions ``0 .. S-1``, in natural order.
          seq_lengths: ``int32[B]`` true prompt lengths (rows padded at the end), or None.
          bidirectional_ids: ``int32[B, S]`` the prompts' bidirectional ids (a prefix-LM
            prompt seen in both directions, then decoded causally), or None.

        Returns:
          ``[B, S, d_model]`` (padding rows' outputs are meaningless).
        """
        return self._prefill(x, seq_lengths, self._decode_metadata(bidirectional_ids))

    def decode(self, x: jax.Array, *, bidirectional_ids: Optional[jax.Array] = None,
               check_capacity: bool = True) -> jax.Array:
        """Append ``T`` tokens per row after the cached ones and attend to the cache.

        Args:
          x: ``[B, T, d_model]`` the new tokens; row ``b``'s sit at positions
            ``length[b] .. length[b]+T-1`` (RoPE uses those).
          bidirectional_ids: ``int32[B, T]`` the new tokens' ids (as in
            :func:`jax_seqpar.api.inference.decode`), or None.
          check_capacity: as in :func:`jax_seqpar.api.inference.decode` (False only
            where the caller has sized the cache for every step).

        Returns:
          ``[B, T, d_model]``.

        Raises:
          ValueError: a row of the cache would pass its capacity (nothing is written;
            under ``jit`` the step fails when it runs, see
            :mod:`jax_seqpar.api.inference`).
        """
        return self._decode(x, self._decode_metadata(bidirectional_ids), check_capacity)

    def _prefill(self, x, seq_lengths, metadata: Metadata):
        """:meth:`prefill` (and the first ``decode=True`` call)."""
        cache = self._kv_cache()
        if x.ndim == 3 and x.shape[1] > cache.capacity:  # before any work
            raise ValueError(f"the prompt has {x.shape[1]} tokens but the cache holds only "
                             f"capacity={cache.capacity} per row; call "
                             f"init_cache(batch, capacity >= {x.shape[1]}) first.")
        q, k, v = self._projected_qkv(x, jnp.arange(x.shape[1], dtype=jnp.int32), cache)
        out, cache = inference.prefill_described(
            q, k, v, cache, self._decode_options(q), metadata,
            strategy=self.strategy, layout=self.layout,
            seq_lengths=seq_lengths)  # [B, S, H, Dh]
        self._cache_variable().set_value(cache)
        self.prefilled = True
        return self.o_proj(out)  # [B, S, d_model]

    def _decode(self, x, metadata: Metadata, check_capacity=True):
        """:meth:`decode` (and every later ``decode=True`` call)."""
        cache = self._kv_cache()
        if x.ndim == 3:
            cache.check_room(x.shape[1])  # a full cache refuses before any work
        positions = cache.length[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None]  # [B, T]
        q, k, v = self._projected_qkv(x, positions, cache)
        out, cache = inference.decode_described(
            q, k, v, cache, self._decode_options(q), metadata,
            check_capacity=check_capacity)  # [B, T, H, Dh]
        self._cache_variable().set_value(cache)
        self.prefilled = True
        return self.o_proj(out)  # [B, T, d_model]
