"""Optional dependencies: import one, or say which extra of the package installs it."""

from __future__ import annotations

import importlib

__all__ = ["require"]


def require(module: str, extra: str, needed_by: str):
    """Import ``module``, or raise ``ImportError`` naming the extra that installs it.

    >>> nnx = require("flax.nnx", "flax", "jax_seqpar.flax")
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{needed_by} needs {module.split('.')[0]!r}, which the core package does not "
            f"install: pip install 'jax_seqpar[{extra}]'.") from error
