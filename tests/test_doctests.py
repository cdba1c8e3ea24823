"""The docstring examples run: doctest over every module whose ``>>>`` examples are
self-contained (tiny arrays; a mesh of the 8 emulated CPU devices tests/conftest.py
sets up). Examples that need arrays or a mesh from the text around them, or a GPU/TPU
compiler, are ``.. code-block:: python`` blocks instead, which nothing runs; the last
test keeps ``>>>`` for examples that run."""

from __future__ import annotations

import doctest
import importlib
import io
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The modules whose examples run (each in well under a second once JAX is warm).
DOCTESTED = (
    "jax_seqpar.core.extras",
    "jax_seqpar.core.layout",
    "jax_seqpar.core.meshes",
    "jax_seqpar.core.packing",
    "jax_seqpar.core.reach",
    "jax_seqpar.core.shape",
    "jax_seqpar.planning.plan",
    "jax_seqpar.planning.predict",
    "jax_seqpar.planning.projection",
    "jax_seqpar.strategies.heads",
    "jax_seqpar.strategies.pieces",
    "jax_seqpar.strategies.registry",
    "jax_seqpar.tools.hlo",
    "jax_seqpar.tools.hlo_text",
    "jax_seqpar.tools.report",
    "jax_seqpar.tools.targets",
)

#: Modules that still write ``>>>`` for examples that cannot run alone (they use a mesh
#: and shards from the surrounding text); another change owns these files now.
NOT_RUN = ("jax_seqpar.strategies.hybrid", "jax_seqpar.strategies.ulysses")


@pytest.mark.parametrize("name", DOCTESTED)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    assert tests, f"{name} has no examples: take it off DOCTESTED"
    for test in tests:
        runner.run(test, out=report.write)
    assert runner.summarize(verbose=False).failed == 0, report.getvalue()


def _modules_with_prompts() -> set[str]:
    found = set()
    for folder, _, files in os.walk(os.path.join(REPO, "jax_seqpar")):
        for file in files:
            path = os.path.join(folder, file)
            if not file.endswith(".py"):
                continue
            with open(path) as source:
                if ">>>" not in source.read():
                    continue
            relative = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
            found.add(relative.removesuffix(".__init__"))
    return found


def test_every_prompt_is_run():
    unrun = _modules_with_prompts() - set(DOCTESTED) - set(NOT_RUN)
    assert not unrun, (f"examples written as >>> that no test runs: {sorted(unrun)}; add "
                       f"the module to DOCTESTED or make them `.. code-block:: python`")
