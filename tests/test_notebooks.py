"""Every notebook in experiments/ executes top to bottom without an error.

Each runs in a fresh Jupyter kernel (nbclient) with experiments/ as its working
directory and the repository root on PYTHONPATH; its first cell sets XLA_FLAGS for
8 emulated CPU devices before JAX starts. The committed outputs are not touched:
the notebook is executed in memory.
"""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
NOTEBOOKS = sorted(EXPERIMENTS.glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_the_experiment_notebooks_exist():
    names = {path.name for path in NOTEBOOKS}
    assert {"comm_volume.ipynb", "memory_scaling.ipynb", "load_balance.ipynb"} <= names, names


@pytest.mark.experiments
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(EXPERIMENTS)}})
    client.execute()  # raises CellExecutionError (with the traceback) on any error
    errors = [output for cell in notebook.cells if cell.cell_type == "code"
              for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    assert not errors, errors
