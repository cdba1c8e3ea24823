"""Greedy generation from :class:`TransformerLM` with a sequence-sharded KV cache.

The prompt is prefilled sequence-parallel (the model's strategy), then every new
token is decoded against the cache, which stays sharded along the sequence: each
layer appends the token's K/V on one device (round-robin) and merges the
devices' partial attention (:mod:`jax_seqpar.api.inference`). The whole generation
loop is one compiled program (a ``lax.scan`` over the new tokens).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_seqpar.core import checks
from jax_seqpar.examples._model import TransformerLM


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`generate` produced.

    Attributes:
      tokens: ``int32[B, N]`` the generated tokens.
      compile_seconds: wall time of compiling prefill and the decode loop (0 when a
        loop of the same signature was compiled before).
      seconds: wall time of running them (prefill + N-1 decode steps).
      tokens_per_second: ``B * N / seconds``.
    """

    tokens: np.ndarray
    compile_seconds: float
    seconds: float
    tokens_per_second: float


def _forward(model: TransformerLM, tokens, attend: Callable):
    """``model``'s logits ``float32[B, T, vocab]`` with ``attend(layer, x)`` as attention.

    The same blocks as ``TransformerLM.__call__``; ``attend`` is a layer's
    ``prefill`` or ``decode``.
    """
    x = model.embed(tokens)  # [B, T, d_model]
    for block in model.blocks:
        x = x + attend(block.attention, block.attention_norm(x))
        x = x + block.mlp_out(jax.nn.gelu(block.mlp_in(block.mlp_norm(x))))
    return model.embed.attend(model.final_norm(x)).astype(jnp.float32)  # [B, T, vocab]


def init_caches(model: TransformerLM, *, batch: int, capacity: int, dtype=jnp.float32) -> None:
    """Put every attention layer of ``model`` in decode mode with an empty cache."""
    for block in model.blocks:
        block.attention.init_cache(batch, capacity, dtype=dtype)


def prefix_ids(prefix_lengths, seq_len: int):
    """``int32[B, seq_len]``: id 1 on each row's first ``prefix_lengths[b]`` tokens (one
    bidirectional prefix), 0 after; None for None."""
    if prefix_lengths is None:
        return None
    return (jnp.arange(seq_len)[None] < prefix_lengths[:, None]).astype(jnp.int32)


def _greedy_loop(state, prompts, lengths, prefix_lengths, *, graphdef, num_tokens):
    """Prefill (the prefixes bidirectional), then ``num_tokens - 1`` decode steps; returns
    ``(int32[B, N], state)``."""
    model = nnx.merge(graphdef, state)
    ids = prefix_ids(prefix_lengths, prompts.shape[1])
    logits = _forward(model, prompts, lambda layer, x: layer.prefill(
        x, seq_lengths=lengths, bidirectional_ids=ids))
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)  # [B]

    def step(carry, _):
        token, state = carry
        model = nnx.merge(graphdef, state)
        # generate sized the caches for every step: no host check in the loop
        logits = _forward(model, token[:, None], lambda layer, x: layer.decode(
            x, check_capacity=False))  # [B, 1, V]
        following = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (following, nnx.state(model)), token

    (token, state), tokens = jax.lax.scan(step, (first, nnx.state(model)), None,
                                          length=num_tokens - 1)
    tokens = jnp.concatenate([tokens, token[None]], axis=0)  # [N, B]
    return tokens.T, state


_loop = jax.jit(_greedy_loop, static_argnames=("graphdef", "num_tokens"))
#: Compiled loops by signature: a second ``generate`` of the same shapes compiles nothing.
_COMPILED: dict = {}


def _compiled_loop(graphdef, num_tokens: int, *args):
    """``(executable, compile seconds)`` of the loop for ``args``; 0 s when reused.

    Compiled ahead of time (``lower().compile()``) so that the compile time is
    measured apart from the run; AOT executables are not cached by ``jit``, hence the
    table, keyed by what the program depends on (the model's structure, N, and the
    arrays' shapes, dtypes and shardings).
    """
    leaves, structure = jax.tree.flatten(args)
    key = (graphdef, num_tokens, structure,
           tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    compiled = _loop.lower(*args, graphdef=graphdef, num_tokens=num_tokens).compile()
    if len(_COMPILED) >= 8:  # a bounded table: a long session keeps its latest models
        del _COMPILED[next(iter(_COMPILED))]
    _COMPILED[key] = compiled
    return compiled, time.perf_counter() - start


def generate(model: TransformerLM, prompts: jax.typing.ArrayLike,
             lengths: jax.typing.ArrayLike | Sequence[int], *, num_tokens: int,
             capacity: int | None = None, cache_dtype: jax.typing.DTypeLike = jnp.float32,
             prefix_lengths: jax.typing.ArrayLike | None = None) -> Generation:
    """Greedy decoding of ``num_tokens`` tokens per row after each prompt.

    Args:
      model: the LM; its layers' mesh, strategy and masks (a chunked model's chunks
        too) shard and mask the prompt and the cache (``Parallelism()``: one device).
      prompts: ``int32[B, S]`` prompt tokens, rows padded at the end.
      lengths: ``int32[B]`` true prompt lengths (``1 .. S``).
      prefix_lengths: ``int32[B]`` (``0 .. lengths``): a prefix-LM's generation
        (PaliGemma's): each row's first ``prefix_lengths[b]`` tokens are one
        bidirectional prefix, prefilled seeing each other both ways; the rest of the
        prompt and every generated token are causal. None: all causal.
      num_tokens: ``N >= 1`` tokens to generate per row.
      capacity: cache slots per row (default: ``S + N`` rounded up to the shards).
      cache_dtype: storage dtype of the cached keys and values.

    Returns:
      A :class:`Generation`; ``model``'s layers are left in decode mode.

    .. code-block:: python

        result = generate(model, prompts, lengths, num_tokens=64)
    """
    prompts = jnp.asarray(prompts, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    batch, seq_len = prompts.shape
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1. Got {num_tokens}.")
    if lengths.shape != (batch,) or int(lengths.min()) < 1 or int(lengths.max()) > seq_len:
        raise ValueError(f"lengths must be int32[{batch}] in 1..{seq_len}. Got {lengths}.")
    if prefix_lengths is not None:
        prefix_lengths = jnp.asarray(checks.lengths("prefix_lengths", prefix_lengths, batch))
        if int(prefix_lengths.min()) < 0 or bool((prefix_lengths > lengths).any()):
            raise ValueError(f"prefix_lengths must be int32[{batch}] in 0..lengths={lengths} "
                             f"(a prefix inside each prompt). Got {prefix_lengths}.")
    needed = int(lengths.max()) + num_tokens
    if capacity is None:
        attention = model.blocks[0].attention
        axes = attention.seq_axes
        axes = (axes,) if isinstance(axes, str) else axes
        shards = 1 if attention.mesh is None else math.prod(attention.mesh.shape[a] for a in axes)
        capacity = -(-max(needed, seq_len) // shards) * shards
    if capacity < needed:
        raise ValueError(f"capacity={capacity} cannot hold the longest prompt "
                         f"(length={needed - num_tokens}) plus the {num_tokens} tokens asked "
                         f"for ({needed} > {capacity}); pass capacity >= {needed} or leave it "
                         "None.")
    init_caches(model, batch=batch, capacity=capacity, dtype=cache_dtype)
    graphdef, state = nnx.split(model)
    mesh = model.blocks[0].attention.mesh
    if mesh is not None:
        # The prompts replicated over the caches' mesh: left unplaced, the partitioner may
        # give the loop's tokens a sharding no mesh spec can name (an error when compiling).
        prompts, lengths, prefix_lengths = jax.device_put(
            (prompts, lengths, prefix_lengths), jax.NamedSharding(mesh, jax.P()))
    compiled, compile_seconds = _compiled_loop(graphdef, num_tokens, state, prompts, lengths,
                                               prefix_lengths)
    start = time.perf_counter()
    tokens, state = compiled(state, prompts, lengths, prefix_lengths)
    tokens = np.asarray(tokens)  # waits for the result
    seconds = time.perf_counter() - start
    nnx.update(model, state)
    return Generation(tokens=tokens, compile_seconds=compile_seconds, seconds=seconds,
                      tokens_per_second=batch * num_tokens / seconds)


def generate_unsharded_reference(model: TransformerLM, prompts, lengths, *,
                                 num_tokens: int, prefix_lengths=None) -> np.ndarray:
    """The same greedy tokens without a cache: the full model on all tokens at each step
    (each row's prefix one bidirectional id, as :func:`generate` prefills it).

    ``int32[B, N]``. The token buffer has a fixed length (later slots are
    padding that causal attention never lets earlier tokens see), so it compiles once.
    """
    prompts = np.asarray(prompts, np.int32)
    lengths = np.asarray(lengths, np.int32)
    batch, seq_len = prompts.shape
    buffer = np.zeros((batch, seq_len + num_tokens), np.int32)
    buffer[:, :seq_len] = prompts
    ids = prefix_ids(None if prefix_lengths is None else jnp.asarray(prefix_lengths),
                     buffer.shape[1])
    logits_at = jax.jit(lambda tokens, where: jnp.take_along_axis(
        model(tokens, bidirectional_ids=ids), where[:, None, None], axis=1)[:, 0])
    rows = np.arange(batch)
    for step in range(num_tokens):
        token = np.asarray(jnp.argmax(logits_at(buffer, lengths + step - 1), axis=-1))
        buffer[rows, lengths + step] = token
    return buffer[rows[:, None], lengths[:, None] + np.arange(num_tokens)]


def _leaf_names(params: nnx.State) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(params)[0]]


def save_params(params: nnx.State, path: str) -> None:
    """Write :class:`TransformerLM` parameters to an ``.npz`` file (one array per leaf)."""
    leaves = jax.tree.leaves(params)
    # Any: numpy's stub would read the ** keywords as savez's allow_pickle flag.
    arrays: dict[str, Any] = {name: np.asarray(leaf)
                              for name, leaf in zip(_leaf_names(params), leaves)}
    np.savez(path, **arrays)


def load_params(like: nnx.State, path: str) -> nnx.State:
    """Parameters saved by :func:`save_params`, in the structure of ``like``.

    Raises:
      ValueError: the file holds other leaves or shapes (another ``ModelConfig``).
    """
    with np.load(path) as saved:
        names = _leaf_names(like)
        leaves = jax.tree.leaves(like)
        if sorted(saved.files) != sorted(names):
            raise ValueError(f"{path} holds parameters {sorted(saved.files)[:4]}..., not those "
                             f"of this model ({sorted(names)[:4]}...); delete it or pass "
                             "another path.")
        loaded = []
        for name, leaf in zip(names, leaves):
            if saved[name].shape != leaf.shape:
                raise ValueError(f"{path}: {name} has shape {saved[name].shape}, the model "
                                 f"{leaf.shape}; it was saved from another ModelConfig.")
            loaded.append(jnp.asarray(saved[name], leaf.dtype))
    return jax.tree.unflatten(jax.tree.structure(like), loaded)
