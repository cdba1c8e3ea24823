"""The tuned-plan file: strategies timed on a mesh (``jax-seqpar tune``), read only on request.

``jax-seqpar tune`` (:func:`jax_seqpar.tools.tune.tune`) times the best predicted
candidates on a mesh and stores the winner here, keyed by the layer's shape, the mesh's
sequence axes and device kind, and the hardware preset. ``strategy="auto"`` reads the
file only when the environment variable :data:`ENV_VAR` names it: without it no file is
read, so a program traces the same way on every machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:  # annotations only
    from jax_seqpar.core.shape import LayerShape
    from jax_seqpar.planning.hardware import Hardware

__all__ = ["ENV_VAR", "cache_key", "default_cache_path", "lookup", "requested", "store"]

#: Names the tuned-plan file. ``jax-seqpar tune`` writes it there, and ``strategy="auto"``
#: reads it only when this is set.
ENV_VAR = "JAX_SEQPAR_TUNED_PLANS"


def default_cache_path() -> pathlib.Path:
    """Where ``jax-seqpar tune`` writes: ``$JAX_SEQPAR_TUNED_PLANS``, else
    ``<user cache dir>/jax_seqpar/tuned_plans.json``."""
    if os.environ.get(ENV_VAR):
        return pathlib.Path(os.environ[ENV_VAR])
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "jax_seqpar" / "tuned_plans.json"


def requested() -> Optional[pathlib.Path]:
    """The file ``strategy="auto"`` reads: ``$JAX_SEQPAR_TUNED_PLANS``, or None (unset)."""
    return pathlib.Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else None


def cache_key(shape: LayerShape, axis_sizes: Mapping[str, int], device_kind: str,
              hardware: Hardware | None) -> str:
    """One string per (layer shape, sequence axes of the mesh, device kind, hardware).

    ``shape`` is a :class:`~jax_seqpar.core.shape.LayerShape`; every field is in the key
    (a file tuned before the layer had one record, keyed by ``dtype_bytes`` and a tile,
    is not found: ``strategy="auto"`` then predicts, and ``jax-seqpar tune`` stores
    the entry again).
    """
    key = dict(shape=dict(dataclasses.asdict(shape),
                          window=list(shape.window) if shape.window else None),
               mesh={str(k): int(v) for k, v in dict(axis_sizes).items()},
               device_kind=device_kind,
               hardware=None if hardware is None else hardware.name)
    return json.dumps(key, sort_keys=True)


def _read(path: pathlib.Path) -> dict:
    try:
        with open(path) as file:
            entries = json.load(file)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ValueError(f"the tuned-plan file {str(path)!r} is not readable JSON ({error}); "
                         f"delete it or point {ENV_VAR} elsewhere.") from None
    return entries if isinstance(entries, dict) else {}


def lookup(key: str, cache: str | os.PathLike | None = None) -> Optional[dict]:
    """The entry for ``key`` (``{"strategy", "ulysses_size", ...}``) in ``cache`` (default:
    the file :func:`requested` names; None when no file is requested) or None."""
    path = pathlib.Path(cache) if cache else requested()
    return None if path is None else _read(path).get(key)


def store(key: str, entry: dict, cache: str | os.PathLike | None = None) -> pathlib.Path:
    """Adds ``entry`` under ``key`` to ``cache`` (default :func:`default_cache_path`),
    written atomically; returns the file's path."""
    path = pathlib.Path(cache) if cache else default_cache_path()
    entries = _read(path)
    entries[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
    os.replace(partial, path)
    return path
