"""``experiments/packed_balance.py`` run as a user runs it, at a tiny size on 4 CPU devices:
the tables, their JSON and both plots (the masked mixes' plot is the script's own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.experiments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tables_json_and_plots(tmp_path):
    """Balance at S=2048 over P=4 with one seed, no timing: every layout and masked mix."""
    pytest.importorskip("matplotlib")
    numbers, work, masked = (tmp_path / name for name in ("packed.json", "work.png",
                                                           "masked.png"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "experiments/packed_balance.py", "--batch", "1", "--seq", "2048",
         "--shards", "4", "--seeds", "1", "--time-seq", "0", "--plot", str(work),
         "--masked-plot", str(masked), "--json", str(numbers)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(numbers.read_text())
    assert {r["layout"] for r in result["balance"]} == {"contiguous", "zigzag", "striped",
                                                        "per_document"}
    assert {r["mix"] for r in result["masked"]} >= {"prefix_lm", "vlm"}
    assert "times" not in result
    for png in (work, masked):
        assert png.read_bytes().startswith(b"\x89PNG")
    assert "masked mixes" in done.stdout
