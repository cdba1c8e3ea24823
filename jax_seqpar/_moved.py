"""Module paths from before the package was split into layers, and their new homes.

``import jax_seqpar.plan`` (or ``from jax_seqpar.layout import zigzag_permute``) keeps
working: the old path names the new module itself (one module object, not a copy), so
code written against the flat layout runs unchanged. New code should use the new paths
(``docs/design.md`` §2 lists every module in its layer).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old path -> new path (both relative to ``jax_seqpar``).
MOVED = {
    "_compat": "core.compat",
    "_extras": "core.extras",
    "masks": "core.masks",
    "merge": "core.merge",
    "layout": "core.layout",
    "batch_layout": "core.batch_layout",
    "reference": "core.reference",
    "meshes": "core.meshes",
    "kernels.pallas": "kernels.gpu.pallas",
    "kernels.mosaic": "kernels.tpu.mosaic",
    "_inputs": "strategies.inputs",
    "ulysses": "strategies.ulysses",
    "ring": "strategies.ring",
    "hybrid": "strategies.hybrid",
    "allgather": "strategies.allgather",
    "halo": "strategies.halo",
    "decode": "strategies.decode",
    "local": "strategies.local",
    "traffic": "strategies.traffic",
    "hardware": "planning.hardware",
    "predict": "planning.predict",
    "plan": "planning.plan",
    "planner": "planning.plan",
    "projection": "planning.projection",
    "_placement": "api.placement",
    "dot_product": "api.dot_product",
    "inference": "api.inference",
    "targets": "tools.targets",
    "aot": "tools.aot",
    "hlo": "tools.hlo",
    "bench": "tools.bench",
    "calibrate": "tools.calibrate",
    "tune": "tools.tune",
    "cli": "tools.cli",
    "bench_report": "tools.bench_report",
    "bench_target": "tools.bench_target",
    "tune_report": "tools.tune_report",
    "_hlo_text": "tools.hlo_text",
    "kernels._pallas_core": "kernels.gpu._core",
    "kernels._pallas_config": "kernels.gpu._config",
    "kernels._pallas_bwd": "kernels.gpu._bwd",
    "kernels._mosaic_common": "kernels.tpu._common",
    "kernels._mosaic_bwd": "kernels.tpu._bwd",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``jax_seqpar.<old>`` and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != "jax_seqpar" or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(f"jax_seqpar.{MOVED[spec.name.partition('.')[2]]}")

    def exec_module(self, module):
        pass  # the new module ran when it was imported


def install() -> None:
    """Make the old paths importable (idempotent)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before path-based finders (editable installs)
