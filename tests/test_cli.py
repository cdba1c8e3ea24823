"""The ``jax-seqpar`` command: help texts and a tiny demo run."""

import os
import subprocess
import sys

import pytest

from jax_seqpar.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_runs_as_a_program():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "jax_seqpar.cli", "--help"], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    assert "demo" in done.stdout


def test_demo_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--steps", "--seq-len", "--batch", "--strategies", "--out", "--seed"):
        assert option in text


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_unknown_strategy_is_refused(capsys):
    assert main(["demo", "--strategies", "ring,spiral"]) == 2
    assert "spiral" in capsys.readouterr().err


def test_tiny_demo_writes_the_plot(tmp_path, capsys):
    out = tmp_path / "losses.png"
    status = main(["demo", "--steps", "3", "--seq-len", "128", "--batch", "1",
                   "--strategies", "ring", "--fsdp", "--out", str(out), "--no-progress"])
    assert status == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    for expected in ("unsharded", "ring+fsdp", "tokens/s", str(out),
                     "parameters + optimizer state per device", "x of replicated"):
        assert expected in text
