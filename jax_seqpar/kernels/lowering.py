"""The kernel of the platform a program is lowered for: :func:`forward`, :func:`backward`
and :func:`attention`, each ``fn(options, q, k, v, q_tokens, kv_tokens, ...)`` with the
call's :class:`~jax_seqpar.kernels.options.Options` first and then the kernel contract's
operands (:mod:`jax_seqpar.kernels.contract`).

``options.kernel`` names the choice. ``"xla"`` and ``"mosaic"`` are one kernel module
each (Mosaic runs its interpreter off TPU by itself). ``"auto"`` and ``"pallas"`` stage
one branch per lowering platform with :func:`jax.lax.platform_dependent`, and lowering
keeps only the branch of its platform: a program compiled ahead of time for H100s on a
CPU host carries the Triton kernel, the same program jitted on CPU the XLA kernel.
``"auto"`` takes the XLA kernel wherever the platform's kernel does not take the
operands' dtype (Mosaic: no float16) or would spill registers (Triton's float32
backward beyond head dim 128; FP8 at head dims other than 64, 128, 256 or on a GPU
without FP8 matrix units, :func:`jax_seqpar.kernels.gpu.pallas.compiles_clean`), and for
the FP8 ``compute_dtype`` combinations only it computes (another dtype backward:
``make_options`` sets it).

A call with ``accumulate`` (a ring step, a pipeline's piece) whose queries can see none
of its keys is skipped whole: a ``lax.cond`` on a few tile summaries
(:func:`jax_seqpar.kernels.tiling.any_visible`), only where whole calls can be empty
(:meth:`~jax_seqpar.kernels.options.Options.may_be_empty`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Callable, Mapping

import jax

from jax_seqpar.core import compat as _compat
from jax_seqpar.core import masks
from jax_seqpar.core.masks import Tokens
from jax_seqpar.kernels import tiling
from jax_seqpar.kernels.options import KERNELS, KernelName, Options

__all__ = ["attention", "backward", "forward", "may_interpret"]

# The kernel each choice lowers to, per lowering platform ("default": every other);
# "pallas-interpret" is the Pallas kernel run by the Pallas interpreter.
_PLATFORM_KERNELS: Mapping[str, Mapping[str, str]] = {
    "auto": {"cuda": "pallas", "tpu": "mosaic", "default": "xla"},
    "pallas": {"cuda": "pallas", "default": "pallas-interpret"},
}


def _module(name: str) -> ModuleType:
    """The kernel module ``name`` (``"pallas-interpret"``: the Pallas one), imported
    when a call first needs it: a CPU program never imports Triton's lowering."""
    if name == "xla":
        from jax_seqpar.kernels import xla
        return xla
    if name == "mosaic":
        from jax_seqpar.kernels.tpu import mosaic
        return mosaic
    from jax_seqpar.kernels.gpu import pallas
    return pallas


def may_interpret(kernel: KernelName) -> bool:
    """Whether ``kernel`` runs the Pallas interpreter on some lowering platform."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}.")
    return kernel in ("mosaic", "pallas")


def _check_tiles(options: Options, chosen: set) -> None:
    """Raise ``ValueError`` unless every kernel of ``chosen`` takes the tiles of
    ``options`` (they apply to whichever kernel the platform lowers to)."""
    sizes = options.block_sizes
    if sizes is None:
        return
    problems = []
    for name, check in (("pallas", sizes.check_gpu), ("mosaic", sizes.check_tpu)):
        if name in chosen:
            try:
                check()
            except ValueError as error:
                problems.append(f"{name}: {str(error).rstrip('.')}")
    if not problems:
        return
    every = ("powers of two that are multiples of 128 such as 128/256/512, which every "
             "kernel takes" if "mosaic" in chosen else
             "powers of two >= 16 such as 16/32/64/128, which Triton takes")
    raise ValueError(
        f"block_sizes={sizes} do not suit every kernel that kernel={options.kernel!r} may "
        f"run: tile sizes apply to whichever kernel the platform lowers to. "
        f"{'; '.join(problems)}. Use kernel='xla' for tiles under 16 (it takes any positive "
        f"size), or {every}.")


def _kernel(method: str, options: Options, q: jax.Array, v: jax.Array, **extra) -> Callable:
    """``method`` of the kernel ``options.kernel`` chooses, bound to ``options`` and the
    keywords ``extra`` (``accumulate``), to call on the operands: one module's function,
    or one branch per lowering platform (``jax.lax.platform_dependent``). ``ValueError``
    for a call that still asks for the Hadamard rotation: no kernel rotates (the
    strategies rotate q and k once where they start,
    :func:`jax_seqpar.strategies.wire.rotated`)."""
    if options.compute is not None and options.compute.hadamard:
        raise ValueError(
            f"compute_dtype={options.compute} asks the kernel to rotate q and k, but the "
            "kernels take them as given: rotate them first "
            "(jax_seqpar.strategies.wire.rotated, which every entry point applies) and call "
            "the kernel with Compute(..., hadamard=False).")
    if options.kernel in ("xla", "mosaic"):
        return functools.partial(getattr(_module(options.kernel), method), options=options,
                                 **extra)
    branches: dict[str, Callable] = {}
    chosen = set()
    products = options.products_dtype(q.dtype)
    for platform, name in _PLATFORM_KERNELS[options.kernel].items():
        module = _module(name)
        # "auto" stages only a kernel that takes the dtype and compiles cleanly: each
        # branch is traced, so one its platform's kernel cannot serve must not be.
        serves = (module.DTYPES is None or q.dtype in module.DTYPES) and (
            name != "pallas" or module.compiles_clean(q.shape[-1], v.shape[-1], products))
        if options.kernel == "auto" and not serves:
            name, module = "xla", _module("xla")
        keywords = {"interpret": name == "pallas-interpret"} if "pallas" in name else {}
        chosen.add(name.split("-")[0])
        branches[platform] = functools.partial(getattr(module, method), options=options,
                                               **extra, **keywords)
    _check_tiles(options, chosen)
    return functools.partial(jax.lax.platform_dependent, default=branches.pop("default"),
                             **branches)


def _without_padding(args: tuple, options: Options) -> tuple:
    """``args`` (``q, k, v, q_tokens, kv_tokens, ...``) with the padding rows of q, k and v
    at zero (:func:`jax_seqpar.core.masks.without_padding`: ``0 * NaN`` is NaN), and q,
    k, v (and the backward's ``dout``, last) in the call's plain compute dtype where it
    has one (:attr:`~jax_seqpar.kernels.options.Options.cast_dtype`: every kernel takes
    it; FP8 is scaled by the kernel that runs it: inside the XLA kernel, before the
    ``pallas_call`` in the Pallas ones)."""
    q, k, v, q_tokens, kv_tokens = args[:5]
    args = (masks.without_padding(q, q_tokens), masks.without_padding(k, kv_tokens),
            masks.without_padding(v, kv_tokens), *args[3:])
    dtype = options.cast_dtype
    if dtype is None:
        return args
    cast = [x.astype(dtype) for x in args[:3]]
    if len(args) > 5:  # the backward: ..., lse, delta, dout
        return (*cast, *args[3:-1], args[-1].astype(dtype))
    return (*cast, *args[3:])


def _unless_empty(call: Callable, args: tuple, accumulate, options: Options):
    """``call(*args)``, or ``accumulate`` unchanged where no query of ``args`` (``q, k, v,
    q_tokens, kv_tokens, ...``) may see any of its keys
    (:func:`jax_seqpar.kernels.tiling.any_visible`, exact-conservative: a call it skips
    has no visible pair)."""
    q_tokens, kv_tokens = args[3:5]
    if accumulate is None or not options.may_be_empty(q_tokens):
        return call(*args)
    like = (args[:5], accumulate)
    return jax.lax.cond(tiling.any_visible(options.spec, q_tokens, kv_tokens),
                        lambda: _compat.match_varying(tuple(call(*args)), like),
                        lambda: _compat.match_varying(tuple(accumulate), like))


def forward(options: Options, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
            kv_tokens: Tokens, accumulate: tuple[jax.Array, jax.Array] | None = None):
    """``(out float32[B, Sq, H, Dv], lse float32[B, Sq, H])`` of the platform's kernel
    (the contract: :mod:`jax_seqpar.kernels.contract`), and ``max_logit float32[B, Sq,
    H]`` last with ``options.return_max_logit`` (every kernel computes it); with
    ``accumulate`` (the same results of earlier keys) the result covers both, and a call
    no query of which may see a key is skipped."""
    args = _without_padding((q, k, v, q_tokens, kv_tokens), options)
    return _unless_empty(_kernel("forward", options, args[0], v, accumulate=accumulate),
                         args, accumulate, options)


def backward(options: Options, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
             kv_tokens: Tokens, lse: jax.Array, delta: jax.Array, dout: jax.Array,
             accumulate: tuple[jax.Array, ...] | None = None):
    """float32 ``(dq, dk, dv)`` of the platform's kernel (plus ``accumulate``); with
    ``accumulate``, skipped whole like :func:`forward`."""
    args = _without_padding((q, k, v, q_tokens, kv_tokens, lse, delta, dout), options)
    return _unless_empty(_kernel("backward", options, args[0], v, accumulate=accumulate),
                         args, accumulate, options)


def attention(options: Options, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
              kv_tokens: Tokens):
    """The platform's kernel, differentiable: ``(out float32, lse float32)`` with
    cotangents for both."""
    args = _without_padding((q, k, v, q_tokens, kv_tokens), options)
    return _kernel("attention", options, args[0], v)(*args)
