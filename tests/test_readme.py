"""README.md runs: every code block executes, every command is run or skipped for a reason.

How the README is executed:

* Each ```` ```python ```` block is a whole program: it runs as pasted, alone, in a fresh
  interpreter (``python -c``; the block sets ``XLA_FLAGS`` before it imports JAX, which
  only a new process honours), from an empty directory, with nothing of this test's
  environment but ``PYTHONPATH`` (this checkout) and ``JAX_PLATFORMS=cpu``. A block
  states what it prints in closing comments, ``# prints: <text>`` or
  ``# prints: <text>: < <bound>``; the output must hold a line that starts with
  ``<text>`` and, with a bound, ends in a number below it (the max error against
  ``jax_seqpar.core.reference`` or ``jax.nn``). The first block (the README's context:
  an Explicit mesh, ``jax.set_mesh``, unsharded inputs, ``jax.jit``, ``jax.grad``)
  runs in the default tier; the others, longer, in the ``experiments`` tier (CI runs
  both). Every block is checked in the default tier for what running it needs: it
  compiles, sets ``XLA_FLAGS`` before importing JAX and states what it prints.
* Shell blocks (```` ```bash ````/``sh``/``shell``/``console``, and indented blocks of
  command lines) are split into commands at newlines and ``&&``. A command that matches
  :data:`SKIPPED` (each entry says why it is too expensive here) is only checked: its
  program, subcommand, options, script, module and extras exist, and ``jax-seqpar``
  parses it. Every other command is run and must exit 0: ``jax-seqpar ...`` through the
  console script's entry point (``pyproject.toml``) in this process, ``python ...`` as
  a subprocess from the repository root. A command no rule covers fails the test, so a
  new README command cannot go untested silently.
* Commands quoted inline in the prose are checked like skipped ones, and every
  repository path, relative link and ``jax_seqpar.*`` name the README quotes must exist.
* A fenced block in any other language fails: give it a rule here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
with open(os.path.join(REPO, "pyproject.toml"), "rb") as _file:
    PYPROJECT = tomllib.load(_file)

SHELLS = ("bash", "sh", "shell", "console")

# (pattern matched at the start of a command, why the test does not run it).
SKIPPED = (
    (r"pip install\b", "installs the package; the tests run from the source tree"),
    (r"pytest\b", "runs the suite this test belongs to"),
    (r"jax-seqpar demo$", "trains the LM four times at its full size (minutes on CPU); "
                          "tests/test_cli.py::test_tiny_demo_writes_the_plot runs the demo "
                          "at tiny sizes"),
    (r"python -m sphinx\b", "builds the documentation (a minute or more); CI (.ci/run) "
                            "builds it with warnings as errors"),
)


@dataclasses.dataclass(frozen=True)
class Block:
    """One code block of the README."""

    language: str  # the fence's language, or "indented"
    line: int  # 1-based line of its first line of code
    code: str
    title: str  # the heading or bold lead-in above it
    lines: range  # every README line it takes, fences included

    @property
    def test_id(self) -> str:
        return f"line{self.line}-" + re.sub(r"\W+", "-", self.title).strip("-").lower()


def _title(line: str) -> str | None:
    found = re.match(r"#+\s+(.*)", line) or re.match(r"\*\*(.+?)\*\*", line)
    return found.group(1).strip() if found else None


def parse_blocks(text: str) -> list[Block]:
    """The fenced blocks and the indented blocks (a blank line, then 4-space lines)."""
    blocks, lines, title, i = [], text.splitlines(), "", 0
    while i < len(lines):
        fence = re.match(r"(```+|~~~+)\s*(\S*)", lines[i])
        if fence:
            end = next(j for j in range(i + 1, len(lines))
                       if lines[j].startswith(fence.group(1)))
            blocks.append(Block(fence.group(2) or "(none)", i + 2,
                                "\n".join(lines[i + 1:end]) + "\n", title,
                                range(i + 1, end + 2)))
            i = end + 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            blocks.append(Block("indented", i + 1, "\n".join(x[4:] for x in lines[i:end]),
                                title, range(i + 1, end + 1)))
            i = end
        else:
            title = _title(lines[i]) or title
            i += 1
    return blocks


def prose(text: str) -> str:
    """The README without its code blocks."""
    code = {n for block in parse_blocks(text) for n in block.lines}
    return "\n".join(x for n, x in enumerate(text.splitlines(), 1) if n not in code)


def commands(block: Block) -> list[list[str]]:
    """The commands of a shell block, as argument lists (comments and prompts dropped)."""
    text = re.sub(r"\\\n", " ", block.code)
    found = []
    for line in text.splitlines():
        line = re.sub(r"^\$\s+", "", line.strip())
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(words[:cut])
            words = words[cut + 1:]
    return [c for c in found if c]


def skip_reason(argv: list[str]) -> str | None:
    line = shlex.join(argv)
    return next((why for pattern, why in SKIPPED if re.match(pattern, line)), None)


with open(README) as _file:
    TEXT = _file.read()
BLOCKS = parse_blocks(TEXT)
PYTHON = [b for b in BLOCKS if b.language == "python"]
SHELL = [b for b in BLOCKS if b.language in SHELLS or b.language == "indented"]


# --- python blocks: each a program, run alone; its "# prints:" claims checked ------------

#: How long one block may take (they take seconds to a minute on 2 shared cores).
BLOCK_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Claim:
    """``# prints: <text>`` or ``# prints: <text>: < <bound>`` in a python block."""

    text: str
    bound: float | None

    def check(self, stdout: str) -> None:
        lines = [x for x in stdout.splitlines() if x.startswith(self.text)]
        assert lines, f"no printed line starts with {self.text!r}:\n{stdout}"
        if self.bound is not None:
            value = float(lines[-1].split()[-1])
            assert value < self.bound, f"{lines[-1]!r}: {value} is not below {self.bound}"


def claims(block: Block) -> list[Claim]:
    found = []
    for line in block.code.splitlines():
        claim = re.match(r"#\s*prints:\s*(.*?)\s*$", line.strip())
        if claim:
            bounded = re.fullmatch(r"(.*:)\s*<\s*(\S+)", claim.group(1))
            found.append(Claim(bounded.group(1), float(bounded.group(2))) if bounded
                         else Claim(claim.group(1), None))
    return found


def _python_params():
    params = []
    for index, block in enumerate(PYTHON):
        marks = () if index == 0 else (pytest.mark.experiments,)
        params.append(pytest.param(block, marks=marks, id=block.test_id))
    return params


@pytest.mark.parametrize("block", PYTHON, ids=[b.test_id for b in PYTHON])
def test_python_block_is_a_program(block):
    """What running a block as pasted needs, checked without running it."""
    compile(block.code, f"README.md line {block.line}", "exec")
    code = block.code
    assert 'os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"' in code, (
        f"README.md line {block.line}: the block must set XLA_FLAGS itself")
    first_jax = re.search(r"^(import|from) (jax|flax)\b", code, re.M)
    assert first_jax and code.index("XLA_FLAGS") < first_jax.start(), (
        f"README.md line {block.line}: XLA_FLAGS must be set before JAX is imported")
    assert claims(block), f"README.md line {block.line}: no '# prints:' claim to check"


@pytest.mark.parametrize("block", _python_params())
def test_python_block(block, tmp_path):
    env = {name: value for name, value in os.environ.items() if name != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"  # this machine may have GPU/TPU compiler plugins
    done = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, (
        f"README.md line {block.line} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    for claim in claims(block):
        claim.check(done.stdout)


def test_every_block_has_a_rule():
    other = [f"line {b.line}: {b.language}" for b in BLOCKS
             if b not in PYTHON and b not in SHELL]
    assert not other, f"README blocks this test has no rule for: {other}"
    assert PYTHON and SHELL


# --- commands ----------------------------------------------------------------------------

def _cli():
    from jax_seqpar.tools import cli

    module, name = PYPROJECT["project"]["scripts"]["jax-seqpar"].split(":")
    assert module == cli.__name__
    return getattr(cli, name), cli.build_parser()


def _options(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[str, set]:
    """``(subcommand, its option strings)`` for a ``jax-seqpar`` argument list."""
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    words = [w for w in argv if not w.startswith("-")]
    if not words:
        return "", set(parser._option_string_actions)
    assert words[0] in subparsers.choices, f"jax-seqpar has no subcommand {words[0]!r}"
    return words[0], set(subparsers.choices[words[0]]._option_string_actions)


def check_command(argv: list[str], *, parse: bool) -> None:
    """What a command names exists: subcommand and options of ``jax-seqpar`` (parsed when
    ``parse``), a script and its options, extras of ``pip install``."""
    program, args = argv[0], argv[1:]
    if program == "jax-seqpar":
        _, parser = _cli()
        sub, options = _options(parser, args)
        unknown = [a.split("=")[0] for a in args
                   if a.startswith("--") and a.split("=")[0] not in options]
        assert not unknown, f"jax-seqpar {sub} has no options {unknown}"
        if parse:
            errors = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
                try:
                    parser.parse_args(args)
                except SystemExit as exit_info:
                    assert exit_info.code == 0, f"jax-seqpar: {errors.getvalue().strip()}"
    elif program == "python" and args[:1] == ["-m"]:
        assert importlib.util.find_spec(args[1]), f"no module {args[1]} (its extra installed?)"
    elif program == "python" or program.endswith(".py"):
        script = args[0] if program == "python" else program
        path = os.path.join(REPO, script)
        assert os.path.isfile(path), f"no script {script}"
        with open(path) as file:
            source = file.read()
        unknown = [a for a in args if a.startswith("--") and f'"{a}"' not in source]
        assert not unknown, f"{script} defines no options {unknown}"
    elif argv[:2] == ["pip", "install"]:
        extras = PYPROJECT["project"]["optional-dependencies"]
        for wanted in re.findall(r"\[([\w,-]+)\]", " ".join(args)):
            missing = set(wanted.split(",")) - set(extras)
            assert not missing, f"pyproject.toml has no extras {missing}"
    elif program != "pytest":
        raise AssertionError(f"no rule to check {shlex.join(argv)!r}: add one here")


def run_command(argv: list[str], monkeypatch, tmp_path) -> None:
    """Runs a README command; it must exit 0."""
    if argv[0] == "jax-seqpar":
        main, _ = _cli()
        out = io.StringIO()
        monkeypatch.chdir(tmp_path)  # where anything it writes lands
        with contextlib.redirect_stdout(out):
            try:
                status = main(argv[1:])
            except SystemExit as exit_info:  # --help exits
                status = exit_info.code
        assert status in (0, None), f"{shlex.join(argv)} exited {status}:\n{out.getvalue()}"
        assert out.getvalue().strip(), f"{shlex.join(argv)} printed nothing"
    elif argv[0] == "python":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=env, timeout=300,
                              capture_output=True, text=True)
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stdout}\n{done.stderr}"
    else:
        raise AssertionError(f"no rule to run {shlex.join(argv)!r}: add a runner here, or an "
                             f"entry to SKIPPED with the reason")


SHELL_COMMANDS = [(b, argv) for b in SHELL for argv in commands(b)]


@pytest.mark.parametrize("block,argv", SHELL_COMMANDS,
                         ids=[f"line{b.line}-{shlex.join(a)}" for b, a in SHELL_COMMANDS])
def test_shell_command(block, argv, monkeypatch, tmp_path):
    if argv[:3] == ["python", "-m", "sphinx"] and importlib.util.find_spec("sphinx") is None:
        # The README's test line installs [test] only; building the docs needs [docs].
        pytest.skip('needs the [docs] extra (pip install -e ".[docs]"): Sphinx is not installed')
    reason = skip_reason(argv)
    if reason is None:
        run_command(argv, monkeypatch, tmp_path)
    else:
        check_command(argv, parse=True)
        pytest.skip(f"checked, not run: {reason}")


def test_every_skip_rule_is_used():
    used = {pattern for pattern, _ in SKIPPED for _, argv in SHELL_COMMANDS
            if re.match(pattern, shlex.join(argv))}
    assert used == {pattern for pattern, _ in SKIPPED}, "SKIPPED has entries no command uses"


def test_inline_commands_paths_and_names_exist():
    problems = []
    for span in {" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose(TEXT))}:
        checks = []
        if re.match(r"(jax-seqpar|pip install|python)\b|experiments/\S+\.py ", span):
            checks.append(lambda span=span: check_command(shlex.split(span), parse=False))
        for path in re.findall(r"(?:^|\s)((?:experiments|tests|jax_seqpar|docs|\.ci)/[\w./]*)",
                               span):
            checks.append(lambda path=path: _exists(path))
        for name in re.findall(r"\bjax_seqpar(?:\.\w+)+", span):
            checks.append(lambda name=name: _resolve(name))
        for check in checks:
            try:
                check()
            except AssertionError as error:
                problems.append(f"`{span}`: {str(error).splitlines()[0]}")
    assert not problems, "\n".join(sorted(problems))


def test_relative_links_exist():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", prose(TEXT))
    assert links, "the README links into the docs"
    missing = [link for link in links if not os.path.exists(os.path.join(REPO, link))]
    assert not missing, f"README links to files that do not exist: {missing}"


def _exists(path: str) -> None:
    assert os.path.exists(os.path.join(REPO, path)), f"no {path} in the repository"


def _resolve(dotted: str) -> None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            assert hasattr(obj, attribute), f"{dotted} has no {attribute}"
            obj = getattr(obj, attribute)
        return
