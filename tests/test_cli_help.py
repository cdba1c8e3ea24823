"""``jax-seqpar <command> --help`` reads like one command: one default per option, plain
text, the same option with the same default everywhere; and files land where ``--out`` says.
"""

import argparse
import os
import pathlib
import re

import pytest

from jax_seqpar.tools.cli import build_parser, main

COMMANDS = ("demo", "generate", "bench", "tune", "check")
#: Options two subcommands spell alike but that mean different things (the reason why).
DIFFERENT_MEANINGS = {
    "--batch": "demo: rows of a training batch; bench/tune: sequences per attention call",
    "--strategies": "demo: strategies trained (3 by default); bench: every strategy measured",
    "--packed": "demo: train in the per-document order; bench: the packed-documents bench",
    "--mesh": "bench: meshes swept (two by default); tune: the one mesh timed",
}
SHAPE_OPTIONS = ("--batch", "--seq", "--heads", "--kv-heads", "--head-dim", "--v-head-dim",
                 "--dtype", "--causal")


def _subparsers() -> dict:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def _help(command, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _option_helps(text: str) -> dict:
    """``{"--seq": "its help text on one line"}`` from a ``--help`` page."""
    options, current = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"  (-\S+)", line)
        if match:
            current = match.group(1).rstrip(",")
            options[current] = line
        elif current:
            options[current] += " " + line.strip()
    return {name: " ".join(text.split()) for name, text in options.items()}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_each_default_once_in_plain_text(command, capsys):
    text = _help(command, capsys)
    assert command in text.splitlines()[0]
    assert "(default: None)" not in text
    assert "(default: False)" not in text
    assert not re.search(r"`|:func:|:mod:|:class:|:data:", text), text
    options = _option_helps(text)
    assert "-h" in options and len(options) > 4
    for option, line in options.items():
        assert line.count("default:") <= 1, (command, option, line)
        assert "[" not in line.split("default", 1)[-1], (command, option, line)  # no ['a']


def test_shared_options_have_one_default():
    defaults = {}
    for command, parser in _subparsers().items():
        for action in parser._actions:
            for option in action.option_strings:
                defaults.setdefault(option, {})[command] = action.default
    shared = {option: by_command for option, by_command in defaults.items()
              if len(by_command) > 1 and option not in ("-h", "--help")}
    for option in SHAPE_OPTIONS:
        assert {"bench", "tune"} <= set(shared[option]), option
    for option, by_command in shared.items():
        if option in DIFFERENT_MEANINGS:
            continue
        assert len({repr(v) for v in by_command.values()}) == 1, (option, by_command)
    for option in SHAPE_OPTIONS:  # --batch included: one definition for bench and tune
        assert shared[option]["bench"] == shared[option]["tune"], (option, shared[option])


def test_demo_default_strategies_are_the_examples_and_the_readme():
    from jax_seqpar import examples

    strategies = _subparsers()["demo"].get_default("strategies")
    assert strategies.split(",") == list(examples.DEFAULT_STRATEGIES)
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    claim = "once with each of " + ", ".join(strategies.split(",")[:-1])
    assert claim in " ".join(readme.split()), claim


def _fake_run_generate(written):
    def run_generate(*, params_path, **_):
        written.append(params_path)
        if params_path:  # what the real one does after training
            with open(params_path, "wb") as f:
                f.write(b"params")
    return run_generate


def test_generate_writes_only_where_out_says(tmp_path, monkeypatch, capsys):
    """The default is a cache folder, never the working directory; --out moves it."""
    from jax_seqpar import examples

    written = []
    monkeypatch.setattr(examples, "run_generate", _fake_run_generate(written))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["generate", "--prompt", "def ", "--tokens", "2"]) == 0
    assert os.listdir(work) == []
    assert written[-1].startswith(str(tmp_path / "cache" / "jax_seqpar"))
    assert os.path.exists(written[-1])

    assert main(["generate", "--prompt", "def ", "--no-save"]) == 0
    assert written[-1] is None and os.listdir(work) == []

    assert main(["generate", "--prompt", "def ", "--out", "here"]) == 0
    assert os.path.dirname(written[-1]) == "here" and os.listdir(work / "here")


def test_demo_writes_its_plot_under_out(tmp_path, monkeypatch):
    from jax_seqpar import examples

    seen = {}
    monkeypatch.setattr(examples, "run_demo", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--no-progress"]) == 0
    assert seen["out"].startswith(str(tmp_path / "cache" / "jax_seqpar"))
    assert main(["demo", "--out", "plots"]) == 0
    assert os.path.dirname(seen["out"]) == "plots"
    assert sorted(os.listdir(tmp_path)) == ["cache", "plots"]
