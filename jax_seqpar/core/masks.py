"""Attention masks from per-token metadata.

A mask is never a dense ``[S, S]`` array. It is a static :class:`MaskSpec`
(``causal``, ``window``, ``chunk_size``, an optional ``mask_fn``) applied to per-token
metadata (:class:`Tokens`: global positions, optional segment ids and bidirectional
ids). The same predicate (:func:`visible`) serves every kernel and every strategy, so
a mask means the same thing whatever the token order or the sharding::

    query i sees key j  iff  same document (segment ids)
                        and  inside the window
                        and  in the same chunk (position // chunk_size)
                        and  (not causal, or pos_j <= pos_i, or both carry the same
                              non-zero bidirectional id)
                        and  mask_fn(q, kv) (when given).

Llama 4's chunked attention is ``causal`` with ``chunk_size``; prefix-LM is one
bidirectional id per document's prefix; a vision-language model gives each image's
tokens one bidirectional id.

Padding (:data:`PAD_SEGMENT`) sees nothing and nothing sees it. For skipping work, the
same masks are classified a block of tokens at a time: :mod:`jax_seqpar.core.blocks`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import typing
from typing import Any, Callable, Generic, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Absent", "array_namespace", "cols", "EMPTY_LSE", "Leaf", "MaskSpec", "MAX_WINDOW",
           "normalize_window", "PAD_SEGMENT", "predicate_tokens", "rows", "shifted",
           "Tokens", "visible", "visible_tokens", "without_padding"]

#: The log-sum-exp given to a query row that sees no key. Finite, so merges and
#: gradients stay NaN-free, and so low that any real block outweighs it.
EMPTY_LSE = -1e30

#: The segment id of padding, reserved (never a real document). A padded token sees no
#: key and no query sees it; the global entry point and the kernels pad with it, and
#: layouts and work counts give it no work.
PAD_SEGMENT = -(2**31)

#: A window side this large reaches every pair of int32 positions (their difference is
#: at most ``2**32 - 1``): larger sides are clamped to it, which changes nothing.
MAX_WINDOW = 2**32 - 1


def _whole(number) -> Optional[int]:
    """``number`` as a Python int if it is a whole number of tokens (ints, numpy ints,
    concrete integer 0-d arrays), else None: True is not a length, and 2.5 tokens are none."""
    if isinstance(number, (bool, np.bool_, float, np.floating)):
        return None
    try:
        return operator.index(number)
    except TypeError:
        return None


def normalize_window(window: Union[None, int, tuple[int, int]]) -> Optional[tuple[int, int]]:
    """``None``, one int (both sides) or ``(left, right)`` -> ``(left, right)`` or None.

    Sides are non-negative ints (floats and bools are refused with ``ValueError``);
    a side of :data:`MAX_WINDOW` or more reaches every int32 position and is clamped
    to it.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)):
        window = (window, window)
    elif len(window) != 2:
        raise ValueError(f"window must be an int or a (left, right) pair. Got {window!r}.")
    left, right = (_whole(side) for side in window)
    if left is None or right is None:
        raise ValueError(f"window sides must be whole numbers of tokens (ints): window=k or "
                         f"(left, right). Got window={window!r}.")
    if min(left, right) < 0:
        raise ValueError(f"window sides must be >= 0. Got window={window!r}.")
    return min(left, MAX_WINDOW), min(right, MAX_WINDOW)


def shifted(x: jax.Array, by: int):
    """``x + by`` for int32 positions ``x`` and a Python int ``by``, saturated to the
    int32 range instead of wrapping around: comparisons against it stay exact for every
    int32 key position (a window edge below ``-2**31`` admits every key, like ``-2**31``).

    Works on jax and numpy arrays (host work counts) alike."""
    xp = array_namespace(x)
    low, high = -(2**31), 2**31 - 1
    if abs(by) >= MAX_WINDOW:  # past every int32 position whatever x is
        return xp.full_like(x, high if by > 0 else low)
    while by:  # steps of at most 2**31 - 1: each fits int32
        step = max(-high, min(high, by))
        if step > 0:
            x = xp.where(x > high - step, high, x + step)
        else:
            x = xp.where(x < low - step, low, x + step)
        by -= step
    return x


def normalize_chunk_size(chunk_size) -> Optional[int]:
    """``None`` or a positive int number of tokens that fits int32 (``ValueError``
    otherwise, naming ``chunk_size``)."""
    if chunk_size is None:
        return None
    value = _whole(chunk_size)
    if value is None or value <= 0:
        raise ValueError(f"chunk_size must be a positive int number of tokens (Llama 4 uses "
                         f"8192), or None for no chunks. Got {chunk_size=!r}.")
    if value > 2**31 - 1:  # the kernels divide int32 positions by it
        raise ValueError(f"chunk_size must fit int32 (at most 2**31 - 1 = {2**31 - 1} tokens, "
                         f"as positions are int32). Got {chunk_size=!r}: pass a smaller "
                         f"chunk_size, or chunk_size=None for one chunk.")
    return value


def normalize_document_shards(max_document_shards) -> Optional[int]:
    """``None`` or a positive int number of shards (``ValueError`` otherwise, naming
    ``max_document_shards``)."""
    if max_document_shards is None:
        return None
    value = _whole(max_document_shards)
    if value is None or value < 1:
        raise ValueError(f"max_document_shards must be a positive int (the most consecutive "
                         f"sequence shards any one document spans, as permute_batch(..., "
                         f'"per_document", max_document_shards=) reports it), or None. Got '
                         f"{max_document_shards=!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static part of a mask (hashable, usable as a static argument).

    Attributes:
      causal: query position ``i`` sees key positions ``<= i`` (and, with
        bidirectional ids, every key that carries its non-zero id).
      window: ``(left, right)``: query position ``i`` sees key positions
        ``i - left .. i + right``; combines with ``causal``. ``None``: unbounded.
      chunk_size: query and key see each other only inside one chunk
        ``position // chunk_size`` (Llama 4's local layers). ``None``: one chunk.
      mask_fn: the escape hatch for a mask no family covers: a jittable
        elementwise predicate ``mask_fn(q: Tokens, kv: Tokens) -> bool`` on
        broadcastable metadata, ANDed with the rest. It is evaluated per element;
        tiles are skipped only where the other fields rule them out (a tile it
        alone empties is still computed, fully masked), and no tile runs unmasked.
        Compiled programs are keyed on the function object: define it once.
      max_document_shards: ``D``, a promise about the segment ids: every document's
        tokens lie on at most ``D`` consecutive sequence shards (in the order the shards
        hold them: :func:`jax_seqpar.permute_batch`'s ``"per_document"`` layout reports
        it, :func:`jax_seqpar.core.packing.document_shards` counts it). It masks nothing;
        it bounds the mask's reach (:func:`jax_seqpar.core.reach.mask_reach`) to
        ``D - 1`` shards on either side, and a batch that breaks it is refused.
        ``None``: no bound.
    """

    causal: bool = False
    window: Optional[tuple[int, int]] = None
    chunk_size: Optional[int] = None
    mask_fn: Optional[Callable] = None
    max_document_shards: Optional[int] = None

    @classmethod
    def make(cls, causal: bool = False, window: int | tuple[int, int] | None = None,
             chunk_size: int | None = None, mask_fn: Callable | None = None,
             max_document_shards: int | None = None) -> "MaskSpec":
        if mask_fn is not None and not callable(mask_fn):
            raise ValueError(f"mask_fn must be a callable mask_fn(q_tokens, kv_tokens) -> bool "
                             f"array, or None. Got {mask_fn!r}.")
        return cls(causal=bool(causal), window=normalize_window(window),
                   chunk_size=normalize_chunk_size(chunk_size), mask_fn=mask_fn,
                   max_document_shards=normalize_document_shards(max_document_shards))

    @property
    def bounded(self) -> bool:
        """Whether a tile may be ``PARTIAL`` by the static fields alone (else only the
        tokens' ids can mask)."""
        return (self.causal or self.window is not None or self.chunk_size is not None
                or self.mask_fn is not None)


#: What a :class:`Tokens` holds: ``jax.Array`` in the kernels, numpy arrays on host,
#: and, as a pytree, anything its leaves map to (shardings, ``ShapeDtypeStruct``, ints).
Leaf = TypeVar("Leaf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tokens(Generic[Leaf]):
    """Per-token metadata of a run of tokens.

    Attributes:
      positions: ``int32[batch, seq]`` global token positions.
      segment_ids: ``int32[batch, seq]`` document ids (tokens attend only within
        their document), or ``None`` for one document.
      bidirectional_ids: ``int32[batch, seq]``: tokens that carry the same non-zero
        id see each other in both directions under a causal mask (a prefix-LM
        prompt, an image's tokens); ``0`` is plain causal. ``None``: all zero.
    """

    positions: Leaf
    segment_ids: Optional[Leaf] = None
    bidirectional_ids: Optional[Leaf] = None


class Absent:
    """A field of the :class:`Tokens` a ``mask_fn`` is shown that the call was not given:
    any use of it (a comparison, arithmetic, indexing, an attribute, a conversion to an
    array) raises ``ValueError`` saying which field and how to give it, instead of
    Python's ``None == x`` answering ``False`` for every token or a crash deep in a
    kernel. ``fix`` says what to pass."""

    def __init__(self, field: str, fix: str):
        self._message = (f"mask_fn read {field}, but this call has none: {fix}")

    def _refuse(self, *_args, **_kwargs):
        raise ValueError(self._message)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    def __repr__(self):
        return "<absent: " + self._message + ">"

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __invert__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __neg__ = __abs__ = _refuse
    __getitem__ = __bool__ = __int__ = __index__ = __iter__ = __len__ = _refuse
    __array__ = __jax_array__ = _refuse
    __hash__ = object.__hash__


#: What a ``mask_fn`` reading absent segment ids is told to do.
_NO_SEGMENT_IDS = ("pass segment_ids= (each token's document id; zeros for one document) "
                   "where the entry point takes them, or mask on the fields it has "
                   "(positions, bidirectional_ids).")


def predicate_tokens(tokens: Tokens, segments_fix: str = _NO_SEGMENT_IDS) -> Tokens:
    """``tokens`` as a ``mask_fn`` sees them: absent ``bidirectional_ids`` read as
    documented (all zero, shaped like ``positions``), absent ``segment_ids`` are
    :class:`Absent` (reading them is a ``ValueError`` naming the keyword), never None."""
    segment_ids, bidirectional_ids = tokens.segment_ids, tokens.bidirectional_ids
    if segment_ids is None:
        side = "q_tokens/kv_tokens.segment_ids"
        segment_ids = Absent(side, segments_fix)
    if bidirectional_ids is None:
        bidirectional_ids = array_namespace(tokens.positions).zeros_like(tokens.positions)
    return Tokens(tokens.positions, segment_ids, bidirectional_ids)


def array_namespace(x: Any) -> Any:
    """numpy for numpy arrays (host counts: :mod:`jax_seqpar.core.work`), else jax.numpy."""
    return np if isinstance(x, np.ndarray) else jnp


def _predicate(spec: MaskSpec, q: Tokens, kv: Tokens):
    """``spec.mask_fn`` on the fields the call has (:func:`predicate_tokens`), as a bool
    array of the tokens' broadcast shape (a Python ``True`` included)."""
    predicate = typing.cast(Callable, spec.mask_fn)  # visible calls it only when set
    ok = predicate(predicate_tokens(q), predicate_tokens(kv))
    if np.ndim(ok):
        return ok
    xp = array_namespace(q.positions)  # a Python (or 0-d) bool: the same for every pair
    shape = np.broadcast_shapes(np.shape(q.positions), np.shape(kv.positions))
    return xp.broadcast_to(xp.asarray(ok), shape)


def visible(spec: MaskSpec, q: Tokens, kv: Tokens):
    """The mask predicate: may a query see a key? Broadcasts like its inputs.

    Args:
      spec: the static mask.
      q, kv: metadata whose fields broadcast against each other (e.g. ``[..., Sq, 1]``
        against ``[..., 1, Sk]``); ``kv``'s optional fields are None where ``q``'s are.
    Returns:
      bool array of the broadcast shape (or ``None`` when nothing is masked).
    """
    terms = []  # every condition that applies; a key is visible where all hold
    q_pos, kv_pos = q.positions, kv.positions
    if spec.causal:
        causal = kv_pos <= q_pos
        if q.bidirectional_ids is not None:
            q_bid, kv_bid = q.bidirectional_ids, kv.bidirectional_ids
            causal = causal | ((q_bid == kv_bid) & (q_bid != 0))
        terms.append(causal)
    if spec.window is not None:  # edges saturate at the int32 limits, never wrap
        left, right = spec.window
        terms.append((kv_pos >= shifted(q_pos, -left)) & (kv_pos <= shifted(q_pos, right)))
    if spec.chunk_size is not None:
        terms.append(q_pos // spec.chunk_size == kv_pos // spec.chunk_size)
    if q.segment_ids is not None:
        terms.append((q.segment_ids == kv.segment_ids) & (q.segment_ids != PAD_SEGMENT))
    if spec.mask_fn is not None:
        terms.append(_predicate(spec, q, kv))
    return functools.reduce(operator.and_, terms) if terms else None


def without_padding(x: jax.Array, tokens: Tokens) -> jax.Array:
    """``x [B, S, ...]`` (q, k or v) with the rows of padding tokens (segment id
    :data:`PAD_SEGMENT`) at zero. Nothing sees padding and it sees nothing, but a kernel
    multiplies its rows by zero weights (``P @ V``, and ``dS^T Q`` / ``dS K`` in the
    backward), and ``0 * NaN`` is NaN: zeroed, whatever they held never reaches an output
    or a gradient (padding's gradients are zero). One select over the tokens
    (``O(S * D)``, none per tile), only where they carry segment ids."""
    if tokens.segment_ids is None:
        return x
    pad = tokens.segment_ids == PAD_SEGMENT
    return jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - pad.ndim)), jnp.zeros((), x.dtype), x)


def rows(tokens: Tokens) -> Tokens:
    """``[..., S]`` metadata as ``[..., S, 1]`` (the query side of :func:`visible`)."""
    return jax.tree.map(functools.partial(jnp.expand_dims, axis=-1), tokens)


def cols(tokens: Tokens) -> Tokens:
    """``[..., S]`` metadata as ``[..., 1, S]`` (the key side of :func:`visible`)."""
    return jax.tree.map(functools.partial(jnp.expand_dims, axis=-2), tokens)


def visible_tokens(spec: MaskSpec, q: Tokens, kv: Tokens):
    """``bool[batch, Sq, Sk]`` mask of :func:`visible` for two runs of tokens (or None)."""
    return visible(spec, rows(q), cols(kv))
