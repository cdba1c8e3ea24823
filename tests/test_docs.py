"""The documentation covers the package: every public module has an API page, every
name ``jax_seqpar`` re-exports is listed, and every page is in a table of contents.
(CI builds the site itself, with warnings as errors: ``.ci/run``.)"""

from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")


def _read(*parts: str) -> str:
    with open(os.path.join(*parts)) as file:
        return file.read()


def _public_modules() -> set[str]:
    found = set()
    package = os.path.join(REPO, "jax_seqpar")
    for folder, folders, files in os.walk(package):
        folders[:] = [f for f in folders if not f.startswith(("_", "."))]
        for file in files:
            if file.endswith(".py") and not file.startswith("_"):
                found.add(os.path.relpath(os.path.join(folder, file), REPO)[:-3]
                          .replace(os.sep, "."))
        if folder != package and os.path.exists(os.path.join(folder, "__init__.py")):
            found.add(os.path.relpath(folder, REPO).replace(os.sep, "."))
    return found


def _api_text() -> str:
    folder = os.path.join(DOCS, "api")
    return "\n".join(_read(folder, f) for f in sorted(os.listdir(folder)))


def test_every_public_module_has_an_api_page():
    documented = set(re.findall(r"\.\. automodule:: (\S+)", _api_text()))
    missing = _public_modules() - documented
    assert not missing, f"modules without an automodule in docs/api/: {sorted(missing)}"


def test_every_reexport_is_listed():
    tree = ast.parse(_read(REPO, "jax_seqpar", "__init__.py"))
    names = {alias.asname or alias.name for node in tree.body
             if isinstance(node, ast.ImportFrom) and node.module != "jax_seqpar"
             for alias in node.names}
    listed = set(re.findall(r"\.\. py:(?:function|data|class):: (\w+)",
                            _read(DOCS, "api", "jax_seqpar.rst")))
    assert names == listed


def test_every_page_is_in_a_toctree():
    pages, linked = set(), set()
    for folder, folders, files in os.walk(DOCS):
        folders[:] = [f for f in folders if not f.startswith(("_", "."))]
        for file in files:
            if file.endswith((".md", ".rst")):
                page = os.path.relpath(os.path.join(folder, file), DOCS).rsplit(".", 1)[0]
                pages.add(page)
                text = _read(folder, file)
                for tree in re.findall(r"```\{toctree\}(.*?)```", text, re.S):
                    base = os.path.relpath(folder, DOCS)
                    linked |= {os.path.normpath(os.path.join(base, entry.strip()))
                               for entry in tree.splitlines()
                               if entry.strip() and not entry.strip().startswith(":")}
    assert pages - linked == {"index"}, f"pages no toctree lists: {sorted(pages - linked - {'index'})}"
