"""The ``jax-seqpar`` command: help texts and a tiny demo run."""

import os
import subprocess
import sys

import numpy as np
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

from jax_seqpar.tools.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_runs_as_a_program():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "jax_seqpar.tools.cli", "--help"], env=env,
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
    out = tmp_path / "demo-losses.png"
    status = main(["demo", "--steps", "3", "--seq-len", "128", "--batch", "1",
                   "--strategies", "ring", "--fsdp", "--out", str(tmp_path), "--no-progress"])
    assert status == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    for expected in ("unsharded", "ring+fsdp", "tokens/s", str(out),
                     "parameters + optimizer state per device", "x of replicated"):
        assert expected in text


def test_the_core_needs_only_jax_and_numpy():
    """``import jax_seqpar`` and a call import no extra; importing ``jax_seqpar.flax``
    without Flax installed is an ImportError naming the extra."""
    script = (
        "import sys, importlib.abc\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('flax', 'optax', 'matplotlib', 'tqdm'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "import jax, jax.numpy as jnp, jax_seqpar\n"
        "q = jnp.ones((1, 16, 2, 8))\n"
        "jax_seqpar.sequence_parallel_attention(q, q, q, mesh=None, causal=True)\n"
        "try:\n"
        "    import jax_seqpar.flax\n"
        "except ImportError as error:\n"
        "    print(error)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [REPO, os.environ.get("PYTHONPATH")])), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert "pip install 'jax_seqpar[flax]'" in done.stdout, done.stdout + done.stderr
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["dependencies"] == ["jax>=0.7", "numpy"]


def test_packed_demo_matches_the_unsharded_loss(tmp_path, monkeypatch, capsys):
    """``jax-seqpar demo --packed``: the ring trains on batches in the per-document order
    at the unsharded run's losses, and the report gives both orders' balance."""
    from jax_seqpar import examples

    results = {}
    run_demo = examples.run_demo
    monkeypatch.setattr(examples, "run_demo", lambda **kw: results.update(run_demo(**kw)))
    status = main(["demo", "--steps", "2", "--seq-len", "128", "--batch", "2",
                   "--strategies", "ring", "--packed", "--out", str(tmp_path),
                   "--no-progress"])
    assert status == 0
    np.testing.assert_allclose(results["ring+packed"].losses, results["unsharded"].losses,
                               rtol=1e-4)
    text = capsys.readouterr().out
    assert "ring+packed" in text and "per_document" in text


def test_the_fp8_demo_trains_within_one_percent_of_the_full_precision_loss(
        tmp_path, monkeypatch, capsys):
    """``jax-seqpar demo --compute-dtype float8_e4m3fn``: attention in FP8, unsharded and
    in the ring, at every step within 1 % of the unsharded run in the model's precision
    (float32), and the report gives the relative difference; the parser's dtypes are the
    library's."""
    from jax_seqpar import examples
    from jax_seqpar.core import quant
    from jax_seqpar.tools import cli

    assert cli.COMPUTE_DTYPES == quant.COMPUTE_DTYPES
    results = {}
    run_demo = examples.run_demo
    monkeypatch.setattr(examples, "run_demo", lambda **kw: results.update(run_demo(**kw)))
    status = main(["demo", "--steps", "4", "--seq-len", "128", "--batch", "2",
                   "--strategies", "ring", "--compute-dtype", "float8_e4m3fn",
                   "--out", str(tmp_path), "--no-progress"])
    assert status == 0
    assert list(results) == ["unsharded", "unsharded+float8_e4m3fn", "ring+float8_e4m3fn"]
    base = results["unsharded"].losses
    for name in ("unsharded+float8_e4m3fn", "ring+float8_e4m3fn"):
        relative = np.abs(results[name].losses - base) / base
        assert relative.max() <= 0.01, (name, relative)
        assert np.any(results[name].losses != base), name  # FP8 did compute differently
    text = capsys.readouterr().out
    assert "relative" in text and "ring+float8_e4m3fn" in text
