"""Long-context inference: a KV cache sharded along the sequence, prefill and decode.

A million-token KV cache does not fit one chip, and one new token has nothing to
split, so the cache is what is sharded: every device holds ``C/P`` slots of a
cache of capacity ``C``, attends the new queries to them and the partial results
merge exactly (:func:`jax_seqpar.strategies.decode.decode_attention`: one ``pmax`` and two
``psum`` s, arXiv:2408.04093).

Placement is round-robin: position ``p`` lives on shard ``p % P`` in local slot
``p // P``. Every shard therefore holds ``length/P`` tokens (+-1) of
every row however long the rows are, a new token lands on exactly one shard, and
the shards that hold a sliding window's keys are all of them, each with ``1/P``
of the window. Every slot carries its token's position, so attention is exact
whatever the placement; empty slots hold
:data:`~jax_seqpar.strategies.decode.EMPTY_POSITION` and are never seen.

Capacity is a contract: a row holds at most ``C`` tokens. A :func:`decode` that would
take a row past ``C`` is refused and writes nothing (the cache stays as it was): called
eagerly it raises ``ValueError`` before any work, naming the capacity, the row's length
and the tokens asked for; traced under ``jax.jit`` the compiled step checks the lengths
on the device and a host callback on every shard raises the same message when the step
runs: the step fails, and reading any of its outputs raises
``jax.errors.JaxRuntimeError`` whose text ends with that ``ValueError`` (with
asynchronous dispatch, at the first read). A step jitted with ``donate_argnums`` on the
cache has given its input buffers away when it starts, so after a refused donated step
the old cache is gone too: keep ``cache.length + T <= capacity`` (or call without
donating) to recover from a refusal. A prompt longer than ``C`` is refused by
:func:`prefill` from its shape. Give the cache the capacity of the longest sequence. A
sliding window lifts the limit only where the cache is made for it, by opting in:
``KVCache.create(..., window=W)`` is a ring (position ``p`` overwrites ``p - C``) that
keeps each row's latest ``C`` tokens, exact for decodes that see at most ``W`` keys back
(``window=(left <= W, 0)``) with ``T <= C - W`` new tokens a step, which it checks.

.. code-block:: python

    mesh = jax.make_mesh((8,), ("sp",))
    cache = KVCache.create(mesh, batch=1, capacity=4096, num_kv_heads=8, head_dim=128)
    out, cache = prefill(q, k, v, cache, strategy="ring")  # q [1, S, 32, 128]
    out, cache = decode(q_new, k_new, v_new, cache)        # q_new [1, 1, 32, 128]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_seqpar.core import checks, masks
from jax_seqpar.core.merge import check_sinks
from jax_seqpar.core.quant import ComputeLike
from jax_seqpar.kernels import tiling
from jax_seqpar.kernels.options import Options, make_options
from jax_seqpar.strategies.inputs import Metadata, check_qkv, check_self_attention
from jax_seqpar.api import attention, placement as _placement, prompts
from jax_seqpar.api.placement import place as _place
from jax_seqpar.api.program import axis_name_of, can_check_vma
from jax_seqpar.api.dot_product import without_segment_ids
from jax_seqpar.api import kv_cache
from jax_seqpar.api.kv_cache import KVCache, check_against_cache
from jax_seqpar.strategies import decode as decode_steps
from jax_seqpar.api.attention import LayoutChoice, StrategyChoice
from jax_seqpar.kernels.options import KernelName

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.kernels.options import BlockSizes

__all__ = ["KVCache", "decode", "decode_described", "prefill", "prefill_described"]


def prefill(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, *, causal: bool = True,
            strategy: StrategyChoice = "auto", seq_lengths: Optional[jax.Array] = None,
            window: int | tuple[int, int] | None = None, scale: Optional[float] = None,
            layout: LayoutChoice = "auto", kernel: KernelName = "auto",
            block_sizes: BlockSizes | None = None, softcap: Optional[float] = None,
            compute_dtype: ComputeLike = None,
            sinks: Optional[jax.Array] = None, chunk_size: Optional[int] = None,
            bidirectional_ids: Optional[jax.Array] = None, mask_fn: Optional[Callable] = None,
            return_max_logit: bool = False):
    """Attend over the prompts sequence-parallel and write their K/V into an emptied cache.

    Args:
      q: ``[B, S, H, Dqk]``; k: ``[B, S, Hkv, Dqk]``; v: ``[B, S, Hkv, Dv]`` the
        prompts at positions ``0 .. S-1`` (rows shorter than ``S`` padded at the end).
      cache: the :class:`KVCache` to fill (``S <= capacity``, its dtype q's); its content
        is replaced.
      causal, window, scale, layout, kernel, block_sizes, strategy, softcap, compute_dtype,
        sinks: as in :func:`jax_seqpar.sequence_parallel_attention` (``strategy="hybrid"``
        needs a cache over ``(outer, inner)`` axes).
      seq_lengths: ``int32[B]`` true prompt lengths (default ``S``; a negative one is a
        ``ValueError``, under ``jit`` when the program runs, except beside a split-axis
        hybrid, where it reads as 0): later tokens are padding,
        not written to the cache, and (with ``causal=False``) not attended.
      chunk_size: tokens see each other only inside one chunk ``position // chunk_size``
        (Llama 4's chunked layers); decode with the same ``chunk_size``.
      bidirectional_ids: ``int32[B, S]`` (needs ``causal``): prompt tokens that carry
        the same non-zero id see each other in both directions, e.g. a prefix-LM
        prompt (PaliGemma: image and prefix one id, then decode causally); padding
        past ``seq_lengths`` is never seen whatever its id.
      mask_fn: ``mask_fn(q_tokens, kv_tokens) -> bool`` on the tokens' global
        ``positions`` (and ``bidirectional_ids``, zeros when not given; reading ``segment_ids`` is a
        ``ValueError``), ANDed with
        the rest (see :class:`jax_seqpar.core.masks.MaskSpec`); decode with the same one.
      return_max_logit: refused (``ValueError``) when True: the max logit is a training
        statistic (QK-Clip); call :func:`jax_seqpar.sequence_parallel_attention`.

    Returns:
      ``(out [B, S, H, Dv] in q.dtype, cache)``; ``out`` of padding tokens is
      meaningless, the cache's ``length`` is ``seq_lengths``.

    Raises:
      ValueError: shapes or a dtype that do not match the cache, a prompt longer than it.

    .. code-block:: python

        cache = KVCache.create(mesh, batch=2, capacity=8192, num_kv_heads=8, head_dim=128)
        out, cache = prefill(q, k, v, cache, seq_lengths=jnp.array([4000, 17]))
    """
    prompts.refuse_max_logit("prefill", return_max_logit)
    spec = masks.MaskSpec.make(checks.flag("causal", causal), window, chunk_size, mask_fn)
    options = make_options(q, without_segment_ids(spec), scale=scale, kernel=kernel,
                           block_sizes=block_sizes, softcap=softcap,
                           compute_dtype=kv_cache.cache_compute(compute_dtype, cache))
    return prefill_described(q, k, v, cache, options,
                             Metadata(bidirectional_ids=bidirectional_ids, sinks=sinks),
                             strategy=strategy, layout=layout, seq_lengths=seq_lengths)


def prefill_described(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
                      options: Options, metadata: Metadata, *,
                      strategy: StrategyChoice = "auto", layout: LayoutChoice = "auto",
                      seq_lengths: Optional[jax.Array] = None):
    """:func:`prefill` of a call already described by ``options`` (its mask's predicate
    sees no segment ids: :func:`~jax_seqpar.api.dot_product.without_segment_ids`) and
    ``metadata`` (the prompts' ``bidirectional_ids`` and the ``sinks``; no other field):
    the path :func:`prefill` and :class:`jax_seqpar.flax.SelfAttention` take. The arrays
    and the cache are checked here."""
    bidirectional_ids, sinks = metadata.bidirectional_ids, metadata.sinks
    check_self_attention(q, k, v)
    check_against_cache(q, k, v, cache)
    options = _against(options, q, cache)
    batch, seq_len = q.shape[:2]
    if seq_len > cache.capacity:
        raise ValueError(f"the prompt has {seq_len} tokens but the cache holds only "
                         f"capacity={cache.capacity} per row (prefill replaces its content: "
                         f"length 0 + {seq_len} tokens asked); create a larger KVCache.")
    seq_lengths = checks.lengths("seq_lengths", seq_lengths, batch)  # int32[B] or None
    # Concrete lengths are read here; traced ones are checked by the program (a host
    # error when it runs, as decode's capacity check).
    check_on_device = not checks.nonnegative_lengths("seq_lengths", seq_lengths)
    if seq_lengths is not None:
        seq_lengths = jnp.asarray(seq_lengths, jnp.int32)
    # Eager arrays replicated onto the cache's mesh: left on one device, the programs'
    # inputs would take whatever sharding the partitioner propagates back to them, which
    # no mesh spec may name.
    q, k, v, seq_lengths, sinks = _placement.onto(cache.mesh, q, k, v, seq_lengths,
                                                  None if sinks is None else jnp.asarray(sinks))
    causal = options.spec.causal
    bidirectional_ids = checks.bidirectional_ids(bidirectional_ids, batch, seq_len, causal)
    checks.mask_fn(options.spec, batch, seq_len, seq_len,
                   given=() if bidirectional_ids is None else ("bidirectional_ids",))
    given = seq_lengths
    seq_lengths = prompts.prompt_lengths(seq_lengths, batch=batch, seq_len=seq_len)
    segment_ids = None
    if not causal:  # causal prompts never see their own later padding; others must not
        segment_ids = prompts.padding_segments(seq_lengths, seq_len=seq_len)
    if bidirectional_ids is not None:  # padding carries no id: causality hides it then
        (placed_ids,) = _placement.onto(cache.mesh, bidirectional_ids)
        bidirectional_ids = prompts.without_padding(placed_ids, seq_lengths)
    seq_axes = cache.seq_axes if len(cache.seq_axes) > 1 else cache.seq_axes[0]
    # The attention is its own staged program (the global call's), the cache write
    # another: each compiles once, and what the attention builds inside stays there.
    metadata = Metadata(segment_ids, None, None, bidirectional_ids,
                        check_sinks(sinks, q.shape[2]))
    where = attention.placement(q, k, v, options, metadata, mesh=cache.mesh,
                                seq_axes=seq_axes, strategy=strategy, layout=layout)
    out = attention.attend(q, k, v, options, metadata, where)  # [B, S, H, Dv], like q
    if check_on_device and (where is None or where.ulysses_size is None):  # (a host callback cannot share a
        # program with a split-axis hybrid: there a negative length reads as 0)
        seq_lengths = prompts.refuse_negative(seq_lengths, given, mesh=cache.mesh)
    return out, _write_prompt(k, v, cache, seq_lengths)


def _against(options: Options, q: jax.Array, cache: KVCache) -> Options:
    """``options`` computing as ``cache`` requires (:func:`~jax_seqpar.api.kv_cache.
    cache_compute`: an FP8 cache's dtype where none was asked; a ``ValueError`` for
    another)."""
    compute = kv_cache.cache_compute(options.compute, cache)
    if compute == options.compute:
        return options
    return make_options(q, options.spec, scale=options.scale, kernel=options.kernel,
                        block_sizes=options.block_sizes, softcap=options.softcap,
                        return_lse=options.return_lse, compute_dtype=compute)


# One program per signature (eagerly: one program, compiled once, not a program per
# operation with a fresh shard_map each call).
@jax.jit
def _write_prompt(k, v, cache: KVCache, lengths):
    """The cache holding the prompts' ``k, v [B, S, Hkv, D]`` (as it stores them:
    :func:`~jax_seqpar.api.kv_cache.stored`), dealt round-robin."""
    # Whole shards are dealt: the prompt padded to a length they divide (the padding is
    # past ``lengths``, so it is never written).
    padded = _placement.padded_length(k.shape[1], cache.num_shards)
    k, v = jax.tree.map(lambda x: tiling.pad_seq(x, padded),
                        kv_cache.stored(cache, k, v))  # [B, S', Hkv, D] (FP8: and scales)
    axis_name = axis_name_of(cache.seq_axes)
    seq = P(None, axis_name)
    k, v = jax.tree.map(lambda x: _place(x, cache.mesh, seq), (k, v))
    lengths = _place(lengths, cache.mesh, P())
    write = jax.shard_map(functools.partial(decode_steps.deal_round_robin, axis_name=axis_name),
                          mesh=cache.mesh, in_specs=(seq, seq, P(), seq, seq),
                          out_specs=cache._specs())
    new_k, new_v, positions = write(k, v, lengths, *cache._placed()[:2])
    return cache._with(new_k, new_v, positions, lengths)


def decode(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, *,
           window: int | tuple[int, int] | None = None, scale: Optional[float] = None,
           kernel: KernelName = "auto", block_sizes: BlockSizes | None = None,
           softcap: Optional[float] = None, sinks: Optional[jax.Array] = None,
           compute_dtype: ComputeLike = None, check_capacity: bool = True,
           chunk_size: Optional[int] = None,
           bidirectional_ids: Optional[jax.Array] = None, mask_fn: Optional[Callable] = None,
           return_max_logit: bool = False):
    """Append ``T >= 1`` new tokens per row and attend them to the whole cache.

    Row ``b``'s new tokens take positions ``length[b] .. length[b]+T-1`` (rows may
    have different lengths) and see every cached token before them, and each
    other causally. Each token is written on one shard only (round-robin); the
    only communication is the merge of the partial results.

    Args:
      q: ``[B, T, H, Dqk]``; k: ``[B, T, Hkv, Dqk]``; v: ``[B, T, Hkv, Dv]`` the new
        tokens, in the cache's dtype (softmax in float32).
      cache: the :class:`KVCache` (``length + T <= capacity`` in every row).
      window: ``(left, right)`` or one int: query ``i`` sees keys ``i-left .. i``;
        key blocks outside every window are skipped.
      scale, kernel, block_sizes, softcap, compute_dtype, sinks: as in
        :func:`jax_seqpar.strategies.decode.decode_attention`.
      check_capacity: under ``jit``, raise (from a host callback) when a step is refused.
        False only for a caller that has sized the cache for every step it runs (as
        ``generate`` does): a refused step still writes nothing, but says nothing under
        ``jit``. (A program holding a host callback cannot also hold a split-axis
        hybrid prefill: JAX then requires one mesh across the whole program.)
      chunk_size: a new token sees only the cached (and new) tokens of its own chunk
        ``position // chunk_size`` (Llama 4's chunked layers).
      bidirectional_ids: ``int32[B, T]`` the new tokens' ids: new tokens that carry
        the same non-zero id see each other in both directions (an image or a prompt
        appended in one step). Every cached token is earlier than every new one and
        seen anyway, so the cache's ids are never needed (nothing is stored): the
        outputs equal attention over the sequence so far (cached and new tokens) with
        these ids. A span continued in a later step is seen whole only from there (the
        outputs already returned stay as they were: decode them in one step).
      mask_fn: ``mask_fn(q_tokens, kv_tokens) -> bool`` on global ``positions`` (and
        ``bidirectional_ids``, zeros when not given; reading ``segment_ids`` is a
        ``ValueError``), as in :func:`prefill`.
      return_max_logit: refused when True, as in :func:`prefill`.

    Returns:
      ``(out [B, T, H, Dv] in q.dtype, replicated; cache with length + T)``.

    Raises:
      ValueError: shapes or a dtype that do not match the cache or each other; a step that would
        take a row past the capacity (nothing is written). Under ``jit`` the capacity
        check runs with the step and raises ``jax.errors.JaxRuntimeError`` carrying
        the same message (see the module docstring, donation included).

    .. code-block:: python

        step = jax.jit(decode, donate_argnums=3)  # donated: the cache updates in place
        out, cache = step(q_new, k_new, v_new, cache)  # q_new [B, 1, H, Dqk]
    """
    prompts.refuse_max_logit("decode", return_max_logit)
    spec = masks.MaskSpec.make(True, window, chunk_size, mask_fn)
    options = make_options(q, without_segment_ids(spec), scale=scale, kernel=kernel,
                           block_sizes=block_sizes, softcap=softcap,
                           compute_dtype=kv_cache.cache_compute(compute_dtype, cache))
    return decode_described(q, k, v, cache, options,
                            Metadata(bidirectional_ids=bidirectional_ids, sinks=sinks),
                            check_capacity=check_capacity)


def decode_described(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
                     options: Options, metadata: Metadata, *,
                     check_capacity: bool = True):
    """:func:`decode` of a call already described by ``options`` (causal, its mask's
    predicate blind to segment ids) and ``metadata`` (the new tokens'
    ``bidirectional_ids`` and the ``sinks``; no other field): the path :func:`decode` and
    :class:`jax_seqpar.flax.SelfAttention` take. The arrays and the cache are checked
    here."""
    bidirectional_ids, sinks = metadata.bidirectional_ids, metadata.sinks
    check_qkv(q, k, v)
    check_against_cache(q, k, v, cache)
    options = _against(options, q, cache)
    window = options.spec.window
    new_tokens = q.shape[1]
    if k.shape[1] != new_tokens:
        raise ValueError(f"q and k/v must hold the same new tokens. Got q seq={new_tokens}, "
                         f"k seq={k.shape[1]}.")
    if new_tokens > cache.capacity:
        raise ValueError(f"{new_tokens} new tokens do not fit a cache of capacity="
                         f"{cache.capacity}; decode them in parts or create a larger cache.")
    if cache.window is not None:
        left, right = masks.normalize_window(window) or (None, 0)
        if left is None or left > cache.window or right:
            raise ValueError(f"this cache keeps only each row's latest {cache.capacity} tokens "
                             f"(KVCache window={cache.window}); decode must attend with "
                             f"window=(left <= {cache.window}, 0). Got window={window!r}.")
        if new_tokens + cache.window > cache.capacity:
            raise ValueError(f"{new_tokens} new tokens would overwrite keys the window of "
                             f"{cache.window} still sees in a cache of capacity="
                             f"{cache.capacity}; decode at most "
                             f"{cache.capacity - cache.window} tokens a step.")
    cache.check_room(new_tokens)
    batch = q.shape[0]
    bidirectional_ids = checks.bidirectional_ids(bidirectional_ids, batch, new_tokens, True)
    checks.mask_fn(options.spec, batch, new_tokens, cache.capacity,
                   given=() if bidirectional_ids is None else ("bidirectional_ids",))
    if cache.fp8 and options.compute is not None:  # (always: _against) the keys come
        # rotated or not from the cache, the queries as they: kv_cache.rotated
        options = dataclasses.replace(options, compute=dataclasses.replace(
            options.compute, hadamard=False))
    call = _Decode(options=options,
                   check_capacity=checks.flag("check_capacity", check_capacity),
                   check_vma=can_check_vma(options.kernel))
    step = decode_steps.Step(*_placement.onto(
        cache.mesh, q, k, v, bidirectional_ids,
        None if sinks is None else jnp.asarray(sinks)))  # as prefill
    return _forward_only(step, cache, call)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _forward_only(step: decode_steps.Step, cache: KVCache, call: _Decode):
    """:func:`_decode`, whose backward is a ``ValueError``: decoding against a cache is
    inference (the cache's keys are stored, not traced), with no gradient."""
    return _decode(step, cache, call=call)


def _forward_only_fwd(step, cache, call):  # primals wrapped: symbolic zeros on
    step, cache = jax.tree.map(lambda primal: primal.value, (step, cache))
    return _decode(step, cache, call=call), None


def _forward_only_bwd(call, residuals, cotangents):
    raise ValueError("decode is inference against a KV cache and has no gradient (jax.grad, "
                     "jax.vjp or a training step of a loss through decode); train with "
                     "sequence_parallel_attention or SelfAttention(x) without decode=True, or "
                     "wrap decode in jax.lax.stop_gradient.")


# symbolic zeros: JAX does not build zero cotangents for the outputs a loss ignores (the
# cache's), which outside ``jax.set_mesh`` it could not place on an Explicit mesh.
_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd, symbolic_zeros=True)


@dataclasses.dataclass(frozen=True)
class _Decode:
    """The static options of a decode step (hashable: the key of its compiled program).

    Attributes:
      options: the kernel's options (:class:`jax_seqpar.kernels.options.Options`, an
        always causal :class:`~jax_seqpar.core.masks.MaskSpec`).
      check_capacity: a refused step raises (see :func:`decode`).
      check_vma: whether ``shard_map`` may check varying manual axes (not for kernels
        the Pallas interpreter runs).
    """

    options: Options
    check_capacity: bool
    check_vma: bool


@functools.partial(jax.jit, static_argnames="call")
def _decode(step: decode_steps.Step, cache: KVCache, *, call: _Decode):
    new_tokens = step.q.shape[1]
    new_length = cache.length + new_tokens  # [B]
    fits = jnp.all(new_length <= cache.capacity) | (cache.window is not None)  # a ring fits
    axis_name = axis_name_of(cache.seq_axes)
    attend = jax.shard_map(
        functools.partial(decode_steps.append_and_attend, axis_name=axis_name,
                          options=call.options, ring=cache.window is not None,
                          check=call.check_capacity),
        mesh=cache.mesh, in_specs=(P(),) + cache._specs() + (P(), P()),
        out_specs=(P(),) + cache._specs(), check_vma=call.check_vma)
    out_dtype = step.q.dtype
    if cache.fp8:  # queries rotated as the keys were, new tokens as the cache stores them
        k, v = kv_cache.stored(cache, step.k, step.v)
        step = dataclasses.replace(step, q=kv_cache.rotated(cache, step.q), k=k, v=v)
    step = jax.tree.map(lambda x: _place(x, cache.mesh, P()), step)  # replicated
    length, fits = (_place(x, cache.mesh, P()) for x in (cache.length, fits))
    k_cache, v_cache, cache_positions = cache._placed()
    out, new_k, new_v, positions = attend(step, k_cache, v_cache, cache_positions, length, fits)
    return out.astype(out_dtype), cache._with(new_k, new_v, positions,
                                              jnp.where(fits, new_length, cache.length))
