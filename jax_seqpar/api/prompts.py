"""The prompts of :func:`jax_seqpar.api.inference.prefill`: their true lengths (default
the whole sequence), the refusal of a negative one, and what marks their padding (each
a jitted program, compiled once per signature); inference's refusal of the max logit."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_seqpar.core import checks

__all__ = ["padding_segments", "prompt_lengths", "refuse_max_logit", "refuse_negative",
           "without_padding"]


@functools.partial(jax.jit, static_argnames=("batch", "seq_len"))
def prompt_lengths(lengths: Optional[jax.Array], *, batch: int, seq_len: int) -> jax.Array:
    """``int32[B]``: the true prompt lengths (default ``S``), in ``0 .. S``."""
    if lengths is None:
        return jnp.full((batch,), seq_len, jnp.int32)
    return jnp.clip(lengths.astype(jnp.int32), 0, seq_len)


@functools.partial(jax.jit, static_argnames="mesh")
def refuse_negative(lengths: jax.Array, given: jax.Array, *, mesh: jax.sharding.Mesh
                    ) -> jax.Array:
    """``lengths``, or, when the caller's traced ``given`` lengths hold a negative one,
    a failed program: a host ``ValueError`` naming ``seq_lengths`` on every shard of
    ``mesh`` at once (read as ``jax.errors.JaxRuntimeError``, as decode's capacity
    check)."""
    def check(lengths, given):  # every shard: none waits in a collective for another
        return checks.refuse_unless(
            (given >= 0).all(), lambda given: checks.negative_length_message("seq_lengths", given),
            lengths, given)

    return jax.shard_map(check, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                         check_vma=False)(lengths, given)


@jax.jit
def without_padding(ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """The prompts' bidirectional ids ``int32[B, S]`` with every token past ``lengths``
    at 0 (then later than every real token, so never seen)."""
    real = jnp.arange(ids.shape[1])[None] < lengths[:, None]
    return jnp.where(real, ids, 0)


@functools.partial(jax.jit, static_argnames="seq_len")
def padding_segments(lengths: jax.Array, *, seq_len: int) -> jax.Array:
    """``int32[B, S]``: 0 for the prompt's tokens, 1 for its padding."""
    return (jnp.arange(seq_len)[None] >= lengths[:, None]).astype(jnp.int32)


def refuse_max_logit(entry: str, return_max_logit: bool) -> None:
    """``ValueError`` where ``return_max_logit`` asks ``entry`` (inference) for the max logit."""
    if checks.flag("return_max_logit", return_max_logit):
        raise ValueError(
            f"{entry} does not return the max logit: return_max_logit=True is a training "
            "statistic (QK-Clip clips the query/key weights by it), which inference does not "
            "update. Compute it in training with sequence_parallel_attention(..., "
            "return_max_logit=True) or dot_product_attention(..., return_max_logit=True).")
