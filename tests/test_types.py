"""The package type-checks: ``python -m mypy`` from the repository root is clean.

mypy reads its configuration from ``pyproject.toml`` (``[tool.mypy]``: the files, the
strictness, the per-module exceptions). A cold run (no ``.mypy_cache``) takes about 35 s
on one core, a warm one under a second.
"""

import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_mypy_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (
        f"mypy found type errors (exit code {result.returncode}); run `python -m mypy` "
        f"from the repository root to see them:\n{result.stdout}{result.stderr}")
