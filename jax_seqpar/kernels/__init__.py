"""Local attention kernels: ``(q, k, v, token metadata) -> (out, lse)``, no communication.

Every kernel module (:mod:`.xla`, :mod:`.gpu.pallas`, :mod:`.tpu.mosaic`) keeps the
contract of :mod:`jax_seqpar.kernels.contract`; a call's static description is one
:class:`~jax_seqpar.kernels.options.Options`
(:func:`~jax_seqpar.kernels.options.make_options`), and strategies reach the kernel of
the platform a program is lowered for through :func:`~jax_seqpar.kernels.lowering.forward`,
:func:`~jax_seqpar.kernels.lowering.backward` and
:func:`~jax_seqpar.kernels.lowering.attention`.
"""

from jax_seqpar.kernels.contract import Kernel as Kernel
from jax_seqpar.kernels.lowering import attention as attention
from jax_seqpar.kernels.lowering import backward as backward
from jax_seqpar.kernels.lowering import forward as forward
from jax_seqpar.kernels.lowering import may_interpret as may_interpret
from jax_seqpar.kernels.options import KERNELS as KERNELS
from jax_seqpar.kernels.options import BlockSizes as BlockSizes
from jax_seqpar.kernels.options import KernelName as KernelName
from jax_seqpar.kernels.options import Options as Options
from jax_seqpar.kernels.options import make_options as make_options

__all__ = ["KERNELS", "BlockSizes", "Kernel", "KernelName", "Options", "attention",
           "backward", "forward", "make_options", "may_interpret"]
