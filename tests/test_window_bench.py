"""``experiments/window_bench.py``: a table row and the plot, at tiny S on 2 CPU devices."""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "experiments", "window_bench.py")
_spec = importlib.util.spec_from_file_location("window_bench", _PATH)
window_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(window_bench)


def test_halo_row_and_plot(tmp_path):
    """One compiled row (the window ring: cheapest) and the plot drawn from it."""
    pytest.importorskip("matplotlib")
    row = window_bench.measure("cpu", 256, 32, 2, "window ring", "ring", True)
    # the halo: W tokens of k and v (Hkv=8, D=64, f32), to the neighbour and back in the vjp
    assert row["hlo_bytes"] == row["model_bytes"] == 2 * 2 * 32 * 8 * 64 * 4
    assert row["kernels"] == "xla"
    png = tmp_path / "bytes.png"
    window_bench.plot([row, dict(row, shards=4)], "test", str(png))
    assert png.read_bytes().startswith(b"\x89PNG")
