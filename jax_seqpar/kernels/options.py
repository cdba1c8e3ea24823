"""What one attention call computes: the static description every kernel and strategy
reads (:class:`Options`), and its tile sizes (:class:`BlockSizes`).

Built once per call by :func:`make_options` from the public keywords (every check runs
there); the kernels read the fields they need (:mod:`jax_seqpar.kernels.contract`), and
strategies reach the kernel of the platform a program is lowered for through
:mod:`jax_seqpar.kernels.lowering` with it. Nothing here imports a kernel.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal, Optional

import jax
import numpy as np

from jax_seqpar.core import checks, quant
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.core.quant import Compute

__all__ = ["GPU_MIN_TILE", "KERNELS", "TPU_LANES", "BlockSizes", "KernelName", "Options",
           "check_softcap", "make_options", "pallas_computes", "resolve_block_sizes"]

#: What ``kernel=`` takes: a per-platform choice (``"auto"``) or one kernel.
KernelName = Literal["auto", "xla", "pallas", "mosaic"]
#: Every value ``kernel=`` takes.
KERNELS: tuple[str, ...] = typing.get_args(KernelName)
#: Smallest tile the Triton (GPU) lowering takes; tiles there are powers of two.
GPU_MIN_TILE = 16
#: TPU lane width; Mosaic tiles are multiples of it.
TPU_LANES = 128


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes in tokens, the same class for every kernel.

    A size left ``None`` is the default of the kernel that runs, for the call's
    head dims and dtype (each kernel module's ``default_block_sizes``). Tiles are
    clipped to the sequence (the XLA kernel: its length; Triton: the next power of
    two; Mosaic: whole 128-token lanes) and ragged tails are padded. What a kernel
    takes: the XLA kernel any positive size; the Pallas kernel powers of two >= 16
    when lowered for GPU (:meth:`check_gpu`), any size in the interpreter; the
    Mosaic kernel multiples of 128 (:meth:`check_tpu`). Powers of two that are
    multiples of 128 (128, 256, 512) suit every kernel.

    Attributes:
      block_q: query tokens per forward tile.
      block_k: key/value tokens per forward tile.
      block_q_bwd: query tokens per tile in the backward.
      block_k_bwd: key/value tokens per tile in the backward.
    """

    block_q: Optional[int] = None
    block_k: Optional[int] = None
    block_q_bwd: Optional[int] = None
    block_k_bwd: Optional[int] = None

    def __post_init__(self):
        for name, size in self._sizes():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}={size!r} must be a positive int (or None for the "
                                 f"kernel's default). Got {self}.")

    def _sizes(self):
        """``(name, size)`` of the sizes that are set."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None]

    def check_gpu(self) -> None:
        """Raise ``ValueError`` unless every size set suits the Triton (GPU) lowering:
        powers of two >= 16."""
        for name, size in self._sizes():
            if size < GPU_MIN_TILE or size & (size - 1):
                raise ValueError(
                    f"{name}={size} must be a power of two >= {GPU_MIN_TILE} for the Triton "
                    f"(GPU) lowering; use e.g. {max(GPU_MIN_TILE, _next_power_of_two(size))}.")

    def check_tpu(self) -> None:
        """Raise ``ValueError`` unless every size set suits the Mosaic (TPU) kernel:
        multiples of 128, the TPU lane width."""
        for name, size in self._sizes():
            if size % TPU_LANES:
                raise ValueError(
                    f"{name}={size} must be a positive multiple of {TPU_LANES} (the TPU lane "
                    f"width); use e.g. {TPU_LANES * -(-size // TPU_LANES)}.")

    def resolve(self, defaults: "BlockSizes") -> "BlockSizes":
        """These sizes with every ``None`` taken from ``defaults``."""
        return dataclasses.replace(defaults, **dict(self._sizes()))


def resolve_block_sizes(block_sizes: Optional[BlockSizes], defaults: BlockSizes,
                        kernel_name: str) -> BlockSizes:
    """``block_sizes`` (``None`` or partly ``None``) completed from ``defaults``.

    Raises ``ValueError`` unless ``block_sizes`` is a :class:`BlockSizes` or None.
    """
    if block_sizes is None:
        return defaults
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes={block_sizes!r} must be a jax_seqpar.kernels.BlockSizes "
                         f"(the tile sizes of {kernel_name}) or None.")
    return block_sizes.resolve(defaults)


def check_softcap(softcap: float | None) -> Optional[float]:
    """``None`` or a positive number (not a bool) as a float, else ``ValueError``.

    ``softcap=inf`` is no cap (``c * tanh(s / c) -> s`` as ``c`` grows; computed as
    written it would be ``inf * 0``, NaN): it returns None.
    """
    if softcap is None:
        return None
    softcap = checks.real("softcap", softcap, positive=True)
    return None if math.isinf(softcap) else softcap


@dataclasses.dataclass(frozen=True)
class Options:
    """What one attention call computes (hashable: static under ``jit`` and
    ``custom_vjp``, and the key of the call's compiled program).

    Attributes:
      spec: the mask (:class:`jax_seqpar.core.masks.MaskSpec`).
      scale: the score multiplier (``1/sqrt(Dqk)`` unless given).
      kernel: the ``kernel=`` choice (:data:`KernelName`): which kernel runs, per
        lowering platform (:mod:`jax_seqpar.kernels.lowering`); the kernels ignore it.
      block_sizes: the tile sizes, or None for the running kernel's defaults.
      softcap: logit soft-cap (``softcap * tanh(s / softcap)``), or None.
      return_lse: whether the call also returns the float32 log-sum-exp (read by the
        strategies and the entry points, not by the kernels).
      return_max_logit: whether the call also returns, per head, the largest scaled
        logit ``scale * q.k`` (before the soft-cap) of any visible pair (QK-Clip): the
        kernels' forward then returns a third result, the float32 ``[B, Sq, H]`` row
        maxima (:mod:`jax_seqpar.kernels.contract`). Every kernel computes it (XLA,
        Triton, Mosaic), a static branch: nothing more is computed without it.
      compute: the precision of the matrix products
        (:class:`~jax_seqpar.core.quant.Compute`), or None for the inputs' dtype.
    """

    spec: MaskSpec
    scale: float
    kernel: KernelName = "auto"
    block_sizes: Optional[BlockSizes] = None
    softcap: Optional[float] = None
    return_lse: bool = False
    compute: Optional[Compute] = None
    return_max_logit: bool = False

    @property
    def cast_dtype(self) -> Optional[str]:
        """The dtype every kernel takes q, k, v (and dout) in, where the call computes in
        one plain dtype (no FP8, one dtype both ways): the lowering casts to it. None
        otherwise (the XLA kernel then scales and casts per block itself; the Pallas
        kernels quantize FP8 operands before their ``pallas_call``,
        :mod:`jax_seqpar.kernels.fp8_inputs`)."""
        compute = self.compute
        if compute is None or compute.quantizes or compute.backward != compute.dtype:
            return None
        return compute.dtype

    def products_dtype(self, like: jax.typing.DTypeLike) -> jax.typing.DTypeLike:
        """The dtype a Pallas kernel's products take for operands of dtype ``like``: the
        FP8 compute dtype where the kernel computes FP8 itself (:func:`pallas_computes`),
        else ``like`` (its tiles, and whether it compiles cleanly, follow it)."""
        compute = self.compute
        return compute.dtype if compute is not None and pallas_computes(compute) else like

    def resolved(self, defaults: BlockSizes, kernel_name: str) -> "Options":
        """These options as a kernel runs them: tile sizes completed from ``defaults``
        (:func:`resolve_block_sizes`), the soft-cap checked (:func:`check_softcap`) and
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

    def may_be_empty(self, q_tokens: Tokens) -> bool:
        """Whether a whole call on these tokens can have no visible pair beyond what
        causality alone rules out cheaply: with documents (segment ids), chunks
        (``spec.chunk_size``) or bidirectional ids, a ring step or a pipeline's pair of
        pieces may share nothing (then :mod:`jax_seqpar.kernels.lowering` skips it)."""
        return (q_tokens.segment_ids is not None or q_tokens.bidirectional_ids is not None
                or self.spec.chunk_size is not None)


def make_options(q: jax.Array, spec: MaskSpec, *, scale: float | None = None,
                 kernel: KernelName = "auto", block_sizes: BlockSizes | None = None,
                 softcap: float | None = None, return_lse: bool = False,
                 compute_dtype: quant.ComputeLike = None,
                 return_max_logit: bool = False) -> Options:
    """The :class:`Options` of a call on queries ``q [..., Dqk]`` (for the default scale
    ``1/sqrt(Dqk)``), every keyword checked once here (``ValueError`` naming it): the
    mask ``spec``, ``kernel`` one of :data:`KERNELS`, ``block_sizes`` a
    :class:`BlockSizes` or None, ``scale`` a finite number, ``softcap`` a positive one,
    ``return_lse`` and ``return_max_logit`` bools, ``compute_dtype`` a dtype of
    :data:`~jax_seqpar.core.quant.COMPUTE_DTYPES` or a
    :class:`~jax_seqpar.core.quant.Compute` (:func:`jax_seqpar.core.quant.compute`).
    Every kernel returns the max logit (``return_max_logit``), so it keeps ``kernel``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}.")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(
            f"block_sizes={block_sizes!r} is not a jax_seqpar.kernels.BlockSizes, the tile "
            f"sizes every kernel takes (kernel={kernel!r}); pass e.g. "
            "BlockSizes(block_q=256, block_k=256), or None for the kernel's defaults.")
    scale = checks.scale(scale)
    if kernel != "xla" and _captures_arrays(spec):
        kernel = _kernel_for_captured_arrays(spec, kernel)
    options = Options(spec, q.shape[-1] ** -0.5 if scale is None else scale, kernel,
                      block_sizes, check_softcap(softcap), checks.flag("return_lse", return_lse),
                      quant.compute(compute_dtype, q.dtype),
                      checks.flag("return_max_logit", return_max_logit))
    if options.compute is not None and options.cast_dtype is None and kernel != "xla":
        # FP8 (or another dtype backward): the Pallas kernels take an FP8 forward with an
        # FP8 (same format) or bfloat16 backward, by name or through "auto" (which runs
        # them where they compile cleanly, jax_seqpar.kernels.lowering); other
        # combinations only the XLA kernel.
        if kernel in ("auto", "pallas", "mosaic") and pallas_computes(options.compute):
            return options
        _refuse_scaled(options.compute, kernel)
        return dataclasses.replace(options, kernel="xla")
    return options


def pallas_computes(compute: Optional[Compute]) -> bool:
    """Whether the Pallas kernels (Triton, Mosaic) compute ``compute`` in FP8 themselves
    (:mod:`jax_seqpar.kernels.fp8_inputs`): an FP8 forward with a backward in the same
    FP8 format or in bfloat16."""
    return (compute is not None and quant.is_fp8(compute.dtype)
            and compute.backward in (compute.dtype, "bfloat16"))


def _refuse_scaled(compute: Compute, requested: KernelName) -> None:
    """Raise where ``requested`` (a kernel other than ``"auto"``) cannot run ``compute``,
    naming the alternatives."""
    if requested == "auto":
        return
    raise ValueError(
        f"compute_dtype={compute} is not one the kernel={requested!r} computes: the Pallas "
        "kernels take an FP8 forward (float8_e4m3fn, float8_e5m2) with a backward in the "
        "same FP8 format or in bfloat16, or one plain dtype (float32, bfloat16, float16) "
        "both ways; other combinations (another dtype backward) only the XLA kernel "
        "computes. Pass kernel='xla' or kernel='auto' (which runs the XLA kernel for it), "
        "or one of those compute dtypes.")


def _captures_arrays(spec: MaskSpec) -> bool:
    """Whether ``spec.mask_fn`` closes over arrays (a lookup table, a traced value): the
    constants of its traced form, which a Pallas kernel cannot capture (only the XLA
    kernel takes them). Traced abstractly on one token pair with every field present; a
    predicate that fails to trace is left to :func:`jax_seqpar.core.checks.mask_fn`."""
    if spec.mask_fn is None:
        return False
    one = jax.ShapeDtypeStruct((1, 1, 1), np.int32)
    tokens = Tokens(one, one, one)
    try:
        traced = jax.make_jaxpr(spec.mask_fn)(tokens, tokens)
    except Exception:  # noqa: BLE001 - reported with its shapes by checks.mask_fn
        return False
    return bool(traced.consts)


def _kernel_for_captured_arrays(spec: MaskSpec, kernel: KernelName) -> KernelName:
    """The kernel that runs a ``mask_fn`` holding arrays: ``"auto"`` takes the XLA kernel
    on every platform (the Pallas kernels cannot capture them); ``"pallas"`` and
    ``"mosaic"`` are refused naming ``mask_fn`` and the fix."""
    if kernel == "auto":
        return "xla"
    raise ValueError(
        f"mask_fn={spec.mask_fn!r} closes over arrays (a table, or a value traced under "
        f"jit), which kernel={kernel!r} cannot take: its Pallas kernel receives only q, k, v "
        "and the tokens' metadata. Pass kernel='xla' or kernel='auto' (which runs the XLA "
        "kernel for such a predicate), or compute the mask from the tokens' fields with "
        "Python constants.")
