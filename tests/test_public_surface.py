"""The public surface, read from the package itself: every public module says what it
exports (``__all__``, each name there), the top level exports the documented names,
every public function annotates every parameter, and ``strategy`` / ``layout`` /
``kernel`` carry the package's ``Literal`` aliases. Nothing runs at import.
"""

import importlib
import importlib.util
import inspect
import pathlib
import sys
import typing

import pytest

import jax_seqpar
from jax_seqpar import kernels
from jax_seqpar.api import attention
from jax_seqpar.core import layout
from jax_seqpar.strategies import registry

ROOT = pathlib.Path(jax_seqpar.__file__).parent
#: What the README and docs/design.md promise at the top level.
TOP_LEVEL = {
    "sequence_parallel_attention", "dot_product_attention", "prefill", "decode", "KVCache",
    "BlockSizes", "permute_batch", "unpermute_batch", "contiguous_positions",
    "zigzag_positions", "striped_positions", "comm_bytes", "work_per_shard",
    "ulysses_attention", "ring_attention", "hybrid_attention", "allgather_attention",
    "decode_attention", "Compute",
}
#: The parameter names that take a strategy, a layout or a kernel, and the aliases they carry.
ALIASES = {"strategy": ("StrategyName", "StrategyChoice"),
           "strategies": ("StrategyName", "StrategyChoice"),
           "layout": ("LayoutName", "LayoutChoice"),
           "kernel": ("KernelName", "Kernel")}  # a name, or the kernel it resolved to


def _public_modules() -> list:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("jax_seqpar",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts):
            continue
        names.append(".".join(parts))
    return names


MODULES = _public_modules()


def _import(name: str):
    if name.startswith(("jax_seqpar.flax", "jax_seqpar.examples")):
        pytest.importorskip("flax")
        pytest.importorskip("optax")
    return importlib.import_module(name)


def _functions(module) -> list:
    """``(qualified name, function)`` of every public function and public method (and
    ``__init__`` / ``__call__``) of the classes in ``module.__all__``."""
    found = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) and obj.__module__.startswith("jax_seqpar"):
            for attribute, member in vars(obj).items():
                member = getattr(member, "__func__", member)  # classmethod, staticmethod
                if inspect.isfunction(member) and (
                        not attribute.startswith("_") or attribute in ("__init__", "__call__")):
                    if getattr(member, "__module__", "").startswith("jax_seqpar"):
                        found.append((f"{name}.{attribute}", member))
        elif callable(obj) and not inspect.isclass(obj) and hasattr(obj, "__code__") or (
                hasattr(obj, "__signature__") and not inspect.isclass(obj)):
            found.append((name, obj))
    return found


@pytest.mark.parametrize("name", MODULES)
def test_every_public_module_lists_its_names(name):
    module = _import(name)
    assert isinstance(getattr(module, "__all__", None), (list, tuple)), f"{name} has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ repeats a name"


def test_the_top_level_exports_the_documented_names():
    assert set(jax_seqpar.__all__) == TOP_LEVEL
    assert jax_seqpar.BlockSizes is kernels.BlockSizes
    assert jax_seqpar.KVCache.create  # the cache's constructor


def test_nothing_runs_at_import_and_old_paths_are_gone():
    assert not any(type(finder).__module__.startswith("jax_seqpar") for finder in sys.meta_path)
    for old in ("plan", "layout", "ring", "inference"):
        assert importlib.util.find_spec(f"jax_seqpar.{old}") is None, old


@pytest.mark.parametrize("name", MODULES)
def test_public_functions_annotate_every_parameter(name):
    module = _import(name)
    bare = []
    for qualified, function in _functions(module):
        for parameter in inspect.signature(function).parameters.values():
            if parameter.name in ("self", "cls"):
                continue
            if parameter.annotation is inspect.Parameter.empty:
                bare.append(f"{qualified}({parameter.name})")
    assert not bare, f"unannotated parameters in {name}: {bare}"


@pytest.mark.parametrize("name", MODULES)
def test_strategy_layout_and_kernel_parameters_carry_the_literal(name):
    module = _import(name)
    loose = []
    for qualified, function in _functions(module):
        for parameter in inspect.signature(function).parameters.values():
            expected = ALIASES.get(parameter.name)
            text = str(parameter.annotation)
            if expected and not any(alias in text for alias in expected):
                loose.append(f"{qualified}({parameter.name}: {text})")
    assert not loose, f"in {name}: {loose}"


def test_the_tuples_come_from_the_literals():
    assert kernels.KERNELS == typing.get_args(kernels.KernelName)
    assert layout.LAYOUTS == typing.get_args(layout.LayoutName)
    assert tuple(registry.STRATEGIES) == typing.get_args(registry.StrategyName)
    assert attention.STRATEGIES == ("auto",) + typing.get_args(registry.StrategyName)
    assert attention.LAYOUTS == ("auto",) + typing.get_args(layout.LayoutName)
    assert all(registry.get(name).name == name for name in registry.STRATEGIES)


def test_one_name_per_concept():
    """The rename table of docs/design.md ("Names"): axis sizes, per-row lengths, the mesh."""
    def parameters(function):
        return inspect.signature(function).parameters

    from jax_seqpar.planning.plan import plan, plan_layer

    for function in (jax_seqpar.comm_bytes, plan, plan_layer):
        assert "axis_sizes" in parameters(function) and "seq_axes" not in parameters(function)
    for function in (jax_seqpar.prefill, jax_seqpar.decode_attention):
        names = parameters(function)
        assert "seq_lengths" in names and not {"lengths", "kv_length"} & set(names)
    for function in (jax_seqpar.sequence_parallel_attention, jax_seqpar.dot_product_attention):
        assert parameters(function)["mesh"].default is None
        assert "seq_axes" in parameters(function)
