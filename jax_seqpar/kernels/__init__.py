"""Local attention kernels: ``(q, k, v, token metadata) -> (out, lse)``, no communication.

Every kernel module offers the same three functions, ``forward``, ``backward`` and
``attention`` (see :mod:`jax_seqpar.kernels.xla` for the contract). Strategies get
one with :func:`get`, which picks the backend when called, never at import.
"""

from __future__ import annotations

import importlib

import jax

KERNELS = ("auto", "xla", "pallas", "mosaic")


def get(kernel: str = "auto"):
    """The kernel module for ``kernel`` (``"auto"``: Pallas on GPU, XLA elsewhere)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}.")
    if kernel == "auto":
        kernel = "pallas" if jax.default_backend() == "gpu" else "xla"
    return importlib.import_module(f"jax_seqpar.kernels.{kernel}")
