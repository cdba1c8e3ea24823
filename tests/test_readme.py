"""README.md runs: every code block executes, every command is run or skipped for a reason.

How the README is executed:

* ```` ```python ```` blocks run in README order in ONE namespace, in this process, on the
  8 emulated CPU devices (``conftest.py``), as if pasted one after another into one
  session: a block may use what an earlier block defined, and nothing else. Each block
  is a test; selecting one runs the blocks before it first (each block runs once per
  session). The code runs exactly as written, shapes included (the README keeps its
  examples small enough for a CPU), and :data:`CHECKS` then holds what the README says
  about a block's result. ``strategy="auto"`` reads a tuning cache that starts empty.
* Shell blocks (```` ```bash ````/``sh``/``shell``/``console``, and indented blocks of
  command lines) are split into commands at newlines and ``&&``. A command that matches
  :data:`SKIPPED` (each entry says why it is too expensive here) is only checked: its
  program, subcommand, options, script and extras exist, and ``jax-seqpar`` parses it.
  Every other command is run and must exit 0: ``jax-seqpar ...`` through the console
  script's entry point (``pyproject.toml``) in this process, ``python ...`` as a
  subprocess from the repository root. A command no rule covers fails the test, so a
  new README command cannot go untested silently.
* Commands quoted inline in the prose are checked like skipped ones, and every
  repository path and ``jax_seqpar.*`` name the README quotes must exist.
* A fenced block in any other language fails: give it a rule here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import io
import os
import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_seqpar
from jax_seqpar.core import reference

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
    (r".* --target\b", "compiles for GPU/TPU with the real compilers (minutes, needs the "
                       "[aot] extra); tests/test_compile_gate.py compiles those programs"),
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


# --- checks of what the README says about a python block's result ----------------------

# Every 29th query row (on every device, in every 256-token zigzag chunk) against all
# the keys.
ROWS = np.arange(0, 4096, 29)


@jax.jit
def _sampled_reference(q, k, v, segment_ids):
    """Causal attention of the sampled query rows against every key (jitted: one compile
    instead of one per eager op)."""
    rows = jnp.asarray(ROWS, jnp.int32)
    kv_positions = jnp.arange(k.shape[1], dtype=jnp.int32)[None]
    return reference.attention(q[:, rows], k, v, causal=True, positions=rows[None],
                               kv_positions=kv_positions, segment_ids=segment_ids[:, rows],
                               kv_segment_ids=segment_ids)


def _check_usage(ns, tolerances):
    # "out: [1, 4096, 8, 64], exactly softmax(q k^T / sqrt(64)) v with a causal mask"
    out, q, k, v = (ns[name] for name in ("out", "q", "k", "v"))
    assert out.shape == (1, 4096, 8, 64) and out.dtype == q.dtype
    one_document = jnp.zeros(q.shape[:2], jnp.int32)
    np.testing.assert_allclose(out[:, ROWS], _sampled_reference(q, k, v, one_document),
                               **tolerances(out.dtype))


def _check_models(ns, tolerances):
    # The layer saw the tokens in zigzag order with their positions and documents:
    # back in natural order, it is causal attention within each document.
    out = jax_seqpar.unpermute_batch(ns["out"], "zigzag", num_shards=8)
    natural = jax_seqpar.unpermute_batch(ns["batch"], "zigzag", num_shards=8)
    assert (ns["positions"][0] == jax_seqpar.zigzag_positions(4096, 8)).all()
    np.testing.assert_array_equal(natural["tokens"], ns["tokens"][:, :-1])
    q = k = v = ns["embed"][natural["tokens"]]
    expected = _sampled_reference(q, k, v, natural["segment_ids"])
    np.testing.assert_allclose(out[:, ROWS], expected, **tolerances(out.dtype))


@functools.partial(jax.jit, static_argnames="chunk_size")
def _sampled_masked(q, k, v, segment_ids, bidirectional_ids, chunk_size=None):
    """:func:`_sampled_reference` with bidirectional ids and chunks."""
    rows = jnp.asarray(ROWS, jnp.int32)
    kv_positions = jnp.arange(k.shape[1], dtype=jnp.int32)[None]
    return reference.attention(
        q[:, rows], k, v, causal=True, positions=rows[None], kv_positions=kv_positions,
        segment_ids=None if segment_ids is None else segment_ids[:, rows],
        kv_segment_ids=segment_ids,
        bidirectional_ids=None if bidirectional_ids is None else bidirectional_ids[:, rows],
        kv_bidirectional_ids=bidirectional_ids, chunk_size=chunk_size)


def _check_masks(ns, tolerances):
    # Laid out by the mask; back in natural order each output is its mask's attention.
    positions = ns["positions"]
    back = lambda x: jax_seqpar.unpermute_batch(  # noqa: E731
        x, "per_document", num_shards=8, positions=positions)
    natural = back(ns["batch"])
    np.testing.assert_array_equal(natural["prompts"], ns["prompts"])
    q = k = v = ns["embed"][natural["tokens"]]
    docs, prompts = jnp.asarray(ns["docs"]), jnp.asarray(ns["prompts"])
    for name, expected in (("prefix_lm", _sampled_masked(q, k, v, docs, prompts)),
                           ("chunked", _sampled_masked(q, k, v, None, None, 1024))):
        np.testing.assert_allclose(back(ns[name])[:, ROWS], expected,
                                   **tolerances(ns[name].dtype))


#: {block title: check(namespace after the block, tolerances fixture)}
CHECKS = {"Usage": _check_usage, "Models: lay the batch out once.": _check_models,
          "Masks beyond causal.": _check_masks}


class _Session:
    """Runs the python blocks in order, once each, in one namespace."""

    def __init__(self):
        self.namespace = {"__name__": "__readme__"}
        self.done = 0
        self.failed = None

    def run_through(self, index: int, tolerances):
        while self.done <= index:
            if self.failed is not None:
                pytest.fail(f"an earlier README block failed ({self.failed})")
            block = PYTHON[self.done]
            try:
                # Leading newlines: tracebacks name the README's own line numbers.
                code = compile("\n" * (block.line - 1) + block.code, README, "exec")
                exec(code, self.namespace)  # noqa: S102 - the README's own code
                if block.title in CHECKS:
                    CHECKS[block.title](self.namespace, tolerances)
            except BaseException:
                self.failed = f"README.md line {block.line}"
                raise
            self.done += 1


@pytest.fixture(scope="module")
def session():
    return _Session()  # tuned plans are off in the tests (tests/conftest.py)


@pytest.mark.parametrize("index", range(len(PYTHON)), ids=[b.test_id for b in PYTHON])
def test_python_block(index, session, tolerances):
    with jax.numpy_rank_promotion("allow"):  # a user's default, not the suite's strict one
        session.run_through(index, tolerances)


def test_every_block_has_a_rule_and_every_check_a_block():
    other = [f"line {b.line}: {b.language}" for b in BLOCKS
             if b not in PYTHON and b not in SHELL]
    assert not other, f"README blocks this test has no rule for: {other}"
    assert PYTHON and SHELL
    titles = {b.title for b in PYTHON}
    assert set(CHECKS) <= titles, f"checks for blocks that are gone: {set(CHECKS) - titles}"


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
