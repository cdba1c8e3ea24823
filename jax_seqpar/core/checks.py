"""The public boundary's argument checks: one place, every entry point calls them.

Token metadata (``segment_ids``, ``positions``, sequence lengths) must be integer arrays
of the documented shape whose values fit int32, the dtype every kernel computes masks in.
Anything else is a ``ValueError`` naming the argument and its dtype, shape or offending
value: a float id or position is never truncated and a wide one never wraps around.
The segment id :data:`~jax_seqpar.core.masks.PAD_SEGMENT` (``-2**31``) is the padding
marker, the library's own (the padding the entry points add) and the caller's (padded
rows, :func:`jax_seqpar.permute_batch`'s padding slots): a token that carries it sees no
key and no query sees it, and its output row is zero. It is the documented meaning of
that value, not a document id: number documents from 0.

Values can only be read from concrete arrays. Under ``jax.jit`` (a tracer) the dtype
and shape are checked, and a dtype whose values might not fit int32 (``int64``,
``uint32``, ``uint64``) is refused: cast it to int32 where the values are known to
fit. An int32 array needs no value check (every value fits): no host copy.

Scalars that shape the program (``causal``, ``scale``, ``softcap``, ``window``) are
static Python values, checked by type and range: ``True`` is not a number and
``"no"`` is not a bool.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import TYPE_CHECKING, Any, Callable, Optional, SupportsFloat, cast

import jax
import numpy as np

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.core.masks import MaskSpec

__all__ = ["bidirectional_ids", "flag", "lengths", "mask_fn", "mesh_only",
           "negative_length_message", "nonnegative_lengths", "positions", "real",
           "refuse_unless", "scale", "segment_ids"]


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def is_traced(x) -> bool:
    """Whether ``x`` is an abstract value under a JAX transformation (no values to read)."""
    return isinstance(x, jax.core.Tracer)


def _fits_int32(dtype: np.dtype) -> bool:
    return np.can_cast(dtype, np.int32, casting="safe")


def int32_array(name: str, x, shape: tuple, *, dims: str = "[batch, seq]"):
    """``x`` as an int32 array of ``shape``, or None for None; ``ValueError`` otherwise.

    Args:
      name: the argument's name, for the message.
      x: an integer array (jax, numpy, or nested lists), or None.
      shape: the shape it must have; dims: its named dims, for the message.

    Returns:
      ``x`` cast to int32 (numpy input stays numpy), or None.
    """
    if x is None:
        return None
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        x = np.asarray(x)
    dtype = np.dtype(x.dtype)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {dims}={tuple(shape)}. Got {name}.shape="
                         f"{tuple(x.shape)} ({dtype}).")
    if dtype.kind not in "iu":
        raise ValueError(
            f"{name} must be an integer array (int32); got dtype {dtype}. Token ids, "
            f"positions and lengths are exact integers: a {dtype} array would be "
            f"truncated. Pass whole numbers as .astype(jnp.int32).")
    if is_traced(x) or not getattr(x, "is_fully_addressable", True):
        if not _fits_int32(dtype):
            raise ValueError(
                f"{name} has dtype {dtype}, whose values may not fit int32, and its values "
                "cannot be checked here (traced under jit, or not all on this process). "
                f"Cast it to int32 where the values are known to fit "
                f"({name}.astype(jnp.int32)), or pass a concrete array.")
    else:
        values = np.asarray(x) if not _fits_int32(dtype) and x.size else None
        if values is not None:
            low, high = int(values.min()), int(values.max())
            if low < INT32_MIN or high > INT32_MAX:
                bad = low if low < INT32_MIN else high
                raise ValueError(
                    f"{name} holds {bad}, outside int32 [-2**31, 2**31 - 1] ({dtype} "
                    f"array): it would wrap around. Keep {name} within int32.")
    if dtype == np.int32:
        return x
    return x.astype(np.int32)


def segment_ids(name: str, x: jax.typing.ArrayLike | None, batch: int, seq: int):
    """``int32[batch, seq]`` document ids (``int32_array``; ``PAD_SEGMENT``: padding)."""
    return int32_array(name, x, (batch, seq))


def positions(name: str, x: jax.typing.ArrayLike | None, batch: int, seq: int):
    """``int32[batch, seq]`` token positions (``int32_array``)."""
    return int32_array(name, x, (batch, seq))


def lengths(name: str, x: jax.typing.ArrayLike | None, batch: int):
    """``int32[batch]`` sequence lengths (``int32_array``)."""
    return int32_array(name, x, (batch,), dims="[batch]")


def negative_length_message(name: str, lengths: jax.typing.ArrayLike) -> str:
    """What a negative sequence length is told (``lengths``: concrete ``int[B]``)."""
    lengths = np.asarray(lengths)
    row = int(np.argmin(lengths))
    return (f"{name} must be >= 0 (a row's count of real tokens). Got {name}[{row}]="
            f"{int(lengths[row])}: pass each row's true length, 0 for a row without tokens.")


def nonnegative_lengths(name: str, x: jax.typing.ArrayLike | None) -> bool:
    """Raise ``ValueError`` naming ``name`` and the value if the concrete lengths ``x``
    (``int[B]``, or None) hold a negative one. Returns whether the values were read:
    False for a traced ``x`` (under ``jit``), whose caller checks on the device."""
    if x is None:
        return True
    if is_traced(x) or not getattr(x, "is_fully_addressable", True):
        return False
    values = np.asarray(x)
    if values.size and values.min() < 0:
        raise ValueError(negative_length_message(name, values))
    return True


def flag(name: str, value: object) -> bool:
    """``value`` if it is a bool (Python or numpy), else ``ValueError``: a string or a
    number is not a yes/no answer (``causal="no"`` would count as causal)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a bool (True or False). Got {name}={value!r} "
                     f"({type(value).__name__}).")


def real(name: str, value: object, *, positive: bool = False) -> float:
    """A static real number (a Python or numpy scalar, or a concrete 0-d array) as a float.

    ``bool`` is refused (``True`` is not a number), and so are arrays of other shapes,
    traced values (the number is compiled into the program) and NaN; infinity is
    returned as is for the caller to give it a meaning or refuse it.
    """
    fix = f"pass a Python float, e.g. {name}=0.5"
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a number; got the bool {value!r}: {fix}.")
    if is_traced(value):
        raise ValueError(f"{name} is traced under a JAX transformation, but it is a "
                         f"compile-time constant of the program: {fix}.")
    if not isinstance(value, numbers.Real):
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        if shape is None or dtype is None:
            raise ValueError(f"{name} must be a number. Got {name}={value!r} "
                             f"({type(value).__name__}): {fix}.")
        if tuple(shape) != () or np.dtype(dtype).kind not in "iuf":
            raise ValueError(f"{name} must be a scalar number. Got an array of shape "
                             f"{tuple(shape)} and dtype {dtype}: {fix}.")
    # Checked above: a real number, or a concrete 0-d numeric array (which float() takes).
    number = float(cast(SupportsFloat, value))
    if math.isnan(number) or (positive and not number > 0):
        need = "a positive float" if positive else "a number, not NaN"
        raise ValueError(f"{name} must be {need}. Got {name}={value!r}: {fix}.")
    return number


def scale(value: object) -> Optional[float]:
    """``None`` (the default ``1/sqrt(head_dim)``) or a finite real number."""
    if value is None:
        return None
    number = real("scale", value)
    if math.isinf(number):
        raise ValueError(f"scale must be finite. Got scale={value!r}.")
    return number


def mesh_only(**given: tuple[object, object]) -> None:
    """Raise ``ValueError`` for arguments that mean something only with a mesh, given
    non-default values in a call with ``mesh=None``: never silently dropped.

    Args:
      given: ``name=(value, default)`` for each such argument.
    """
    for name, (value, default) in given.items():
        if value is not default and value != default:
            raise ValueError(
                f"{name}={value!r} needs a mesh: with mesh=None the call attends on the "
                f"caller's devices without splitting the sequence. Pass mesh= to split it, "
                f"or drop {name}= (default {default!r}).")


def bidirectional_ids(x: jax.typing.ArrayLike | None, batch: int, seq: int, causal: bool,
                      name: str = "bidirectional_ids"):
    """``int32[batch, seq]`` bidirectional ids (``int32_array``), or None. They only
    lift a causal mask, so without ``causal`` they would mean nothing: ``ValueError``."""
    if x is None:
        return None
    if not causal:
        raise ValueError(f"{name} lets tokens of one id see each other in both directions "
                         "under a causal mask; without causal=True every token already sees "
                         f"both directions, so {name} would change nothing. Pass causal=True "
                         f"(prefix-LM, vision-language masks) or drop {name}.")
    return int32_array(name, x, (batch, seq))


def mask_fn(spec: MaskSpec, batch: int, q_len: int, kv_len: int, *,
            given: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` unless ``spec.mask_fn`` (if any) maps query metadata
    ``[batch, q_len, 1]`` and key metadata ``[batch, 1, kv_len]`` (int32
    :class:`~jax_seqpar.core.masks.Tokens`) to booleans that broadcast to
    ``[batch, q_len, kv_len]`` (a Python bool included). Traced abstractly (no work runs)
    on the fields the call HAS, as the kernels show them
    (:func:`~jax_seqpar.core.masks.predicate_tokens`): ``given`` names the optional
    fields the call has (``"segment_ids"``, ``"bidirectional_ids"``); absent bidirectional
    ids read as zeros, absent segment ids are a ``ValueError`` naming them when read."""
    from jax_seqpar.core import masks

    if spec.mask_fn is None:
        return

    def tokens(shape):
        x = jax.ShapeDtypeStruct(shape, np.int32)
        return masks.Tokens(x, x if "segment_ids" in given else None,
                            x if "bidirectional_ids" in given else None)

    def predicate(q, kv):  # masks.visible's call of the predicate, nothing else
        return masks.visible(masks.MaskSpec(mask_fn=spec.mask_fn), q, kv)

    want = (batch, q_len, kv_len)
    try:
        out = jax.eval_shape(predicate, tokens((batch, q_len, 1)), tokens((batch, 1, kv_len)))
    except ValueError as error:
        if "mask_fn read" in str(error):  # a field the call was not given: its own message
            raise ValueError(str(error)) from None
        raise ValueError(f"mask_fn(q_tokens, kv_tokens) failed on int32 metadata of shapes "
                         f"[{batch}, {q_len}, 1] and [{batch}, 1, {kv_len}]: {error}. It must "
                         "be a jittable elementwise predicate on masks.Tokens fields.") from error
    except Exception as error:  # noqa: BLE001 - any failure is the predicate's
        raise ValueError(f"mask_fn(q_tokens, kv_tokens) failed on int32 metadata of shapes "
                         f"[{batch}, {q_len}, 1] and [{batch}, 1, {kv_len}]: {error}. It must "
                         "be a jittable elementwise predicate on masks.Tokens fields.") from error
    shape = getattr(out, "shape", None)
    try:
        ok = (shape is not None and np.dtype(out.dtype) == np.bool_
              and np.broadcast_shapes(tuple(shape), want) == want)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"mask_fn must return booleans that broadcast to [batch, q_seq, kv_seq]"
                         f" = {list(want)} (elementwise on its metadata). Got "
                         f"{getattr(out, 'dtype', type(out).__name__)}{list(shape or [])}.")


def refuse_unless(ok: Any, message: Callable[..., str], value: Any, *args: Any) -> Any:
    """``value``, unless ``ok`` is False: then a ``ValueError(message(*args))``.

    Concrete ``ok`` raises now. Traced (inside a compiled program) the check runs on the
    device and, where it fails, a host callback raises the ``ValueError``: the program
    fails and reading any of its outputs raises ``jax.errors.JaxRuntimeError`` whose
    text ends with the message. An error cannot leave a compiled program any other way,
    and unlike a status flag it cannot be ignored. Every shard raises at the same point
    of the same program, so none waits in a collective for another; ``value`` comes back
    through the check (use the result), so the callback is neither dropped as dead code
    nor an effect later programs would wait on.

    A program lowered ahead of time for a platform this process has no device of (the
    compile-only GPU and TPU targets of :mod:`jax_seqpar.tools.targets`) cannot hold a
    host callback: it cannot run here either, and holds the check without the callback
    (``value`` passed through). Compile where it runs to keep the refusal.

    Args:
      ok: a bool scalar (Python, numpy or JAX).
      message: called with ``args`` as numpy arrays (concrete) to say what is refused.
      value: an array passed through; args: arrays the message reads.
    """
    if not is_traced(ok) and not any(is_traced(x) for x in (value, *args)):
        if not bool(ok):
            raise ValueError(message(*(np.asarray(x) for x in args)))
        return value

    def refuse(value, *args):
        raise ValueError(message(*(np.asarray(x) for x in args)))

    from jax_seqpar.core.compat import match_varying

    def checked(value, *args):
        return jax.lax.cond(ok, lambda: value, lambda: match_varying(jax.pure_callback(
            refuse, jax.ShapeDtypeStruct(value.shape, value.dtype), value, *args), value))

    here = {platform: checked for platform in _PLATFORMS if _runs_here(platform)}
    return jax.lax.platform_dependent(value, *args, default=lambda value, *args: value, **here)


#: The platforms ``jax.lax.platform_dependent`` names, and the backend each runs on.
_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


@functools.cache
def _runs_here(platform: str) -> bool:
    """Whether this process has a device of ``platform`` (a host callback lowers for it)."""
    try:
        return bool(jax.devices(_PLATFORMS[platform]))
    except RuntimeError:
        return False
