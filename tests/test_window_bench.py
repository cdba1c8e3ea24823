"""``experiments/window_bench.py`` run as a user runs it, at tiny S on 2 CPU devices: the
table, its JSON and the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.experiments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_table_json_and_plot(tmp_path):
    """Every variant compiled at S=256, W=32, P=2; the window ring's row is its halo."""
    pytest.importorskip("matplotlib")
    table, png = tmp_path / "bytes.json", tmp_path / "bytes.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "experiments/window_bench.py", "--seq", "256", "--windows", "32",
         "--shards", "2", "--json", str(table), "--plot", str(png)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["variant"]: row for row in json.loads(table.read_text())["rows"]}
    assert set(rows) == {"window ring", "full ring", "allgather", "ulysses"}
    assert not [row for row in rows.values() if "error" in row], rows
    halo = rows["window ring"]
    # the halo: W tokens of k and v (Hkv=8, D=64, f32), to the neighbour and back in the vjp
    assert halo["hlo_bytes"] == halo["model_bytes"] == 2 * 2 * 32 * 8 * 64 * 4
    assert halo["kernels"] == "xla"
    assert rows["full ring"]["hlo_bytes"] > halo["hlo_bytes"]
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "window ring" in done.stdout  # the printed table
