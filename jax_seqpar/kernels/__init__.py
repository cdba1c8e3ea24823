"""Local attention kernels: ``(q, k, v, token metadata) -> (out, lse)``, no communication.

Every kernel module offers the same three functions, ``forward``, ``backward`` and
``attention``, and takes the same tile sizes, :class:`BlockSizes` (the
:class:`~jax_seqpar.kernels.contract.Kernel` protocol of
:mod:`jax_seqpar.kernels.contract`). Strategies get one with :func:`get`.

The kernel that runs follows the platform the program is LOWERED for, not the
host's backend: ``"auto"`` and ``"pallas"`` stage every candidate with
:func:`jax.lax.platform_dependent`, and lowering keeps only the branch of its
platform. So a program compiled ahead of time for 8 H100s on a CPU host
(:mod:`jax_seqpar.tools.targets`), or exported with :func:`jax.export.export`, carries
the Triton kernel, and the same program jitted on CPU runs the XLA kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
from typing import TYPE_CHECKING, Literal, Mapping, Optional

import jax

from jax_seqpar.core import checks
from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.kernels.contract import BlockSizes, Kernel, check_softcap
from jax_seqpar.kernels.options import Options

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.core.masks import Tokens

__all__ = ["KERNELS", "BlockSizes", "Kernel", "KernelName", "Options", "PerPlatform", "get",
           "make_options",
           "may_interpret"]

#: What ``kernel=`` takes: a per-platform choice (``"auto"``) or one kernel.
KernelName = Literal["auto", "xla", "pallas", "mosaic"]
#: Every value ``kernel=`` takes.
KERNELS: tuple[str, ...] = typing.get_args(KernelName)

# The kernel each choice lowers to, per lowering platform ("default": every other).
# ``pallas-interpret`` is the Pallas kernel run by the Pallas interpreter.
_PLATFORM_KERNELS: Mapping[str, Mapping[str, str]] = {
    "auto": {"cuda": "pallas", "tpu": "mosaic", "default": "xla"},
    "pallas": {"cuda": "pallas", "default": "pallas-interpret"},
}


#: The module of each kernel (``"pallas-interpret"``: the Pallas module, interpreted).
_MODULES = {"xla": "jax_seqpar.kernels.xla", "pallas": "jax_seqpar.kernels.gpu.pallas",
            "mosaic": "jax_seqpar.kernels.tpu.mosaic"}


def _module(name: str):
    return importlib.import_module(_MODULES[name.split('-')[0]])


def _check_tiles(choice: str, options, kernels: set) -> None:
    """Raise ``ValueError`` unless every kernel a ``choice`` may lower to takes the tiles
    of ``options``."""
    sizes = options.block_sizes
    if sizes is None:
        return
    problems = []
    for name, check in (("pallas", sizes.check_gpu), ("mosaic", sizes.check_tpu)):
        if name in kernels:
            try:
                check()
            except ValueError as error:
                problems.append(f"{name}: {str(error).rstrip('.')}")
    if not problems:
        return
    every = ("powers of two that are multiples of 128 such as 128/256/512, which every "
             "kernel takes" if "mosaic" in kernels else
             "powers of two >= 16 such as 16/32/64/128, which Triton takes")
    raise ValueError(
        f"block_sizes={sizes} do not suit every kernel that kernel={choice!r} may run: "
        f"tile sizes apply to whichever kernel the platform lowers to. {'; '.join(problems)}. "
        f"Use kernel='xla' for tiles under 16 (it takes any positive size), or {every}.")


@dataclasses.dataclass(frozen=True)
class PerPlatform:
    """A kernel that is a different kernel module on each lowering platform.

    It has the kernel contract (``forward``, ``backward``, ``attention``, taking the
    :class:`~jax_seqpar.kernels.options.Options` of the modules it stands for) and
    stages one branch per platform with :func:`jax.lax.platform_dependent`, so nothing
    is decided before lowering.

    Attributes:
      name: the ``kernel=`` choice (``"auto"`` or ``"pallas"``).
      platforms: ``{platform or "default": kernel}``, kernels from
        ``_PLATFORM_KERNELS`` (``"pallas-interpret"`` runs the Pallas interpreter).
    """

    name: str
    platforms: tuple

    @property
    def __name__(self) -> str:  # noqa: A003 - read like a module's name by callers
        return f"jax_seqpar.kernels.{self.name}"

    #: The tile sizes every kernel takes. They apply to whichever kernel runs (a
    #: size left None: that kernel's default); sizes some platform's kernel cannot
    #: take are a ``ValueError`` in the call.
    BlockSizes = BlockSizes

    @property
    def DTYPES(self) -> Optional[tuple]:  # noqa: N802 - the kernel modules' constant
        """The input dtypes the platforms' kernels take; None for any float (``"auto"``
        falls back to the XLA kernel for a dtype its platform's kernel lacks)."""
        if self.name == "auto":
            return None
        dtypes = [_module(name).DTYPES for _, name in self.platforms]
        if any(d is None for d in dtypes):
            return None
        return tuple(dict.fromkeys(dtype for some in dtypes for dtype in some))

    @property
    def may_interpret(self) -> bool:
        """Whether some platform runs the Pallas interpreter."""
        return any(k == "pallas-interpret" for _, k in self.platforms)

    def _branches(self, method: str, args: tuple, options, extra: tuple) -> dict:
        """``{platform or "default": fn(*args)}`` of ``method`` of each platform's kernel,
        called with ``options`` and ``extra`` (``accumulate``) after the arrays."""
        q, _, v = args[:3]
        branches, chosen = {}, set()
        for platform, name in self.platforms:
            module = _module(name)
            # The automatic choice is the best kernel that takes the operands' dtype and
            # compiles cleanly for them (Mosaic takes no float16; Triton's float32
            # backward spills for head dims over 128). Each branch is traced, so one a
            # platform's kernel cannot serve must not be staged.
            serves = (module.DTYPES is None or q.dtype in module.DTYPES) and (
                name != "pallas" or module.compiles_clean(q.shape[-1], v.shape[-1], q.dtype))
            if self.name == "auto" and not serves:
                name, module = "xla", _module("xla")
            keywords = {}
            if module.__name__.endswith("pallas"):
                keywords["interpret"] = name == "pallas-interpret"
            chosen.add(name)
            branches[platform] = functools.partial(
                lambda fn, keywords, *arrays: fn(*arrays, options, *extra, **keywords),
                getattr(module, method), keywords)
        _check_tiles(self.name, options, chosen)
        return branches

    def _call(self, method: str, args: tuple, options, extra: tuple, interpret):
        import jax

        if interpret is not None:  # the caller pinned how Pallas lowers: no choice left
            if not self.may_interpret:
                raise ValueError(f"interpret={interpret} is an option of kernel='pallas', "
                                 f"not of kernel={self.name!r}.")
            return getattr(_module("pallas"), method)(*args, options, *extra,
                                                      interpret=interpret)
        branches = self._branches(method, args, options, extra)
        default = branches.pop("default", None)
        return jax.lax.platform_dependent(*args, default=default, **branches)

    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens, kv_tokens: Tokens,
                options: Options, accumulate: tuple[jax.Array, jax.Array] | None = None, *,
                interpret: bool | None = None):
        """The forward of the platform's kernel (see :func:`jax_seqpar.kernels.xla.forward`)."""
        return self._call("forward", (q, k, v, q_tokens, kv_tokens), options, (accumulate,),
                          interpret)

    def backward(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
                 kv_tokens: Tokens, lse: jax.Array, delta: jax.Array, dout: jax.Array,
                 options: Options, accumulate: tuple[jax.Array, jax.Array] | None = None, *,
                 interpret: bool | None = None):
        """The backward of the platform's kernel (see :func:`jax_seqpar.kernels.xla.backward`)."""
        return self._call("backward", (q, k, v, q_tokens, kv_tokens, lse, delta, dout),
                          options, (accumulate,), interpret)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, q_tokens: Tokens,
                  kv_tokens: Tokens, options: Options, *, interpret: bool | None = None):
        """Differentiable forward of the platform's kernel: ``(out float32, lse float32)``."""
        return self._call("attention", (q, k, v, q_tokens, kv_tokens), options, (), interpret)


def get(kernel: KernelName = "auto") -> Kernel:
    """The kernel for ``kernel``: a module, or a :class:`PerPlatform` of modules.

    ``"xla"``: the XLA kernel everywhere. ``"pallas"``: Triton when lowered for
    CUDA, the Pallas interpreter elsewhere. ``"mosaic"``: the Mosaic kernel when
    lowered for TPU, the Pallas interpreter elsewhere (the module chooses itself).
    ``"auto"``: Triton when lowered for CUDA, Mosaic for TPU, the XLA kernel
    elsewhere, and the XLA kernel wherever a call needs an option the platform's
    kernel lacks, a dtype it does not take (float16 on TPU: Mosaic takes float32 and
    bfloat16) or where it would spill registers (float32 head dims over 128 on GPU). Every kernel takes :class:`BlockSizes`; under ``"auto"`` and
    ``"pallas"`` they apply to whichever kernel runs, and sizes that one of them
    cannot take (Triton: powers of two >= 16; Mosaic: multiples of 128) are a
    ``ValueError`` in the call.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}.")
    if kernel in ("xla", "mosaic"):
        return _module(kernel)
    return PerPlatform(kernel, tuple(_PLATFORM_KERNELS[kernel].items()))


def may_interpret(kernel: KernelName) -> bool:
    """Whether ``kernel`` runs the Pallas interpreter on some lowering platform."""
    return kernel == "mosaic" or getattr(get(kernel), "may_interpret", False)


def make_options(q: jax.Array, spec: MaskSpec, *, scale: float | None = None,
                 kernel: KernelName = "auto", block_sizes: BlockSizes | None = None,
                 softcap: float | None = None) -> Options:
    """The static :class:`~jax_seqpar.kernels.options.Options` of a call on queries
    ``q [..., Dqk]`` (for the default scale ``1/sqrt(Dqk)``): the mask ``spec``, the
    kernel :func:`get` chooses for ``kernel``, its tiles and soft-cap, all checked."""
    scale = checks.scale(scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    module = get(kernel)
    if block_sizes is not None and not isinstance(block_sizes, module.BlockSizes):
        raise ValueError(
            f"block_sizes={block_sizes!r} is not a jax_seqpar.kernels.BlockSizes, the tile "
            f"sizes every kernel takes (kernel={kernel!r}); pass e.g. "
            "BlockSizes(block_q=256, block_k=256), or None for the kernel's defaults.")
    softcap = check_softcap(softcap)
    return Options(spec, scale, module, block_sizes, softcap)
