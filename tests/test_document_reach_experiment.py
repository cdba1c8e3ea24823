"""``experiments/document_reach.py`` run as a user runs it, at a tiny size, no compiling:
the table and its results file (the command first)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.experiments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_table_and_results_file(tmp_path):
    """S=16384 over P=4, one seed of the heavy-tailed mix: every layout a row; a bound kept
    keeps its span and the balance, one refused names its floor."""
    out = tmp_path / "document_reach.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    argv = ["--seq", "16384", "--shards", "4", "--seeds", "0", "--longest", "1024",
            "--mixes", "heavy_tailed", "--no-compile", "--out", str(out)]
    done = subprocess.run([sys.executable, "experiments/document_reach.py", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    assert text.startswith("$ ") and "experiments/document_reach.py --seq 16384" in text
    rows = [line.split(" | ") for line in text.splitlines()
            if line.startswith("| heavy_tailed | 0 |")]
    assert [row[2] for row in rows] == ["unbounded", "D=1", "D=2", "D=3", "D=auto"]
    for row in rows:
        if row[3].startswith("refused: floor"):
            assert row[4:8] == ["-"] * 4, row
            continue
        span, pairs, tiles = int(row[3]), float(row[4]), float(row[5])
        if row[2] not in ("unbounded", "D=auto"):
            assert span <= int(row[2][2:]) and pairs <= 1.05 and tiles <= 1.10, row
    assert any(row[3].startswith("refused: floor") for row in rows), rows
    assert "| heavy_tailed | 0 | D=1 |" in done.stdout  # the printed table
    assert "compiled ring" not in text
