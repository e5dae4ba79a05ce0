"""The documentation (README.md and docs/*.md) against the repository and the command line.

- every relative link points to a file that exists, and to a heading of it when it names one;
- README.md stays a first read: at most 250 lines;
- every ``mptrain`` command of a ``bash`` block (also ``python -m mptrain ...`` and
  ``torchrun ... -m mptrain ...``) is accepted as written: its arguments go through
  ``mptrain.cli.app.main`` in-process, in an empty directory (not the repository root), with the one
  step that would start the jobs replaced, so everything mptrain checks before a job starts
  (Hydra's composition, the schemas' types and ranges, each job of a sweep, the output directory)
  is checked, and bad input exits 2 here as on the command line;
- every ``$ mptrain ...`` of a ``text`` block followed by an ``mptrain: error:`` line exits 2 with
  exactly that line, run for real (in a directory holding examples/'s files, with a one-step
  guard so that a missing error cannot train for long): some errors are found only when the
  model is built.

Only the public entry point ``mptrain.cli`` is imported. About 0.2 s per command on 2 cores, a
second or two per error found at build time.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.runs import run_cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

# The subcommands whose arguments are a training run's config overrides: `mptrain bench` and
# `mptrain advise` compose the same config (one job, no launcher) before they measure, so their
# overrides are checked as a run's.
AS_A_RUN = {"bench", "advise"}
# `mptrain eval` needs a trained run: tests/commands/test_inference.py runs the lines of this page's first
# bash block (train, then eval) as written, and every `mptrain eval` line shown must be one of them.
EVAL_PAGE = ROOT / "docs" / "python-api.md"
# `mptrain sample` needs a trained language model (tests/train/test_lm.py samples one). Its key=value
# arguments are parsed before the checkpoint is looked for, so with nothing at `resume` the error
# must name that path, not an argument.
SAMPLE = "sample"
# Hydra plugins that are no part of the `test` extra: the command is checked where installed.
PLUGINS = {"hydra/launcher=submitit_slurm": "hydra_plugins.hydra_submitit_launcher"}
# Lines of a bash block run (with bash, in the test's directory) before the block's commands:
# they make the files the commands read (docs/configuration.md's config directory).
SETUP = ("mkdir", "printf")
# Appended to a `$ mptrain ...` error example, which runs for real: none of them is in its error
# line, and a run that fails to fail ends after one step.
GUARD = ("hydra.run.dir=run", "epochs=null", "max_steps=1", "checkpoint.enabled=false")


# ------------------------------------------------------------------------------------ markdown
@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    lines: list[str]


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def parse(page: Path) -> tuple[list[str], list[Block]]:
    """The lines outside fenced code blocks (code replaced by blank lines), and the blocks."""
    prose, blocks = [], []
    fence, start, lang, body = None, 0, "", []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, start, lang, body = match[1], number, match[2], []
                prose.append("")
            else:
                prose.append(line)
        elif match and match[1][0] == fence[0] and len(match[1]) >= len(fence) and not match[2]:
            blocks.append(Block(page, start, lang, body))
            fence = None
            prose.append("")
        else:
            body.append(line)
            prose.append("")
    assert fence is None, f"{page.name}:{start}: code block not closed"
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = parse(page)
    return {slug(m[1]) for line in prose if (m := re.match(r"#{1,6}\s+(.*?)\s*#*$", line))}


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links() -> list[tuple[Path, int, str]]:
    links = []
    for page in PAGES:
        prose, _ = parse(page)
        for number, line in enumerate(prose, 1):
            line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
            for target in LINK.findall(line):
                if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    links.append((page, number, target))
    return links


# ------------------------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Command:
    block: Block
    line: int
    args: tuple[str, ...]  # mptrain's arguments
    setup: tuple[str, ...]  # the block's set-up lines before it

    @property
    def id(self) -> str:
        return f"{self.block.page.relative_to(ROOT)}:{self.line}"


STOP = {"&&", "||", ";", "|", "&"}


def mptrain_args(tokens: list[str]) -> list[str] | None:
    """mptrain's arguments in one shell command's tokens, or None when it runs something else."""
    while tokens and (tokens[0] == "nohup" or re.match(r"[A-Za-z_]\w*=", tokens[0])):
        tokens = tokens[1:]  # a prefix, or an environment variable for the command
    for i, token in enumerate(tokens):  # redirections end the arguments
        if re.match(r"\d*[<>]", token):
            tokens = tokens[:i]
            break
    if tokens[:1] == ["mptrain"]:
        return tokens[1:]
    if tokens[:3] in (["python", "-m", "mptrain"], ["python3", "-m", "mptrain"]):
        return tokens[3:]
    if tokens[:1] == ["torchrun"] and "-m" in tokens:
        at = tokens.index("-m")
        return tokens[at + 2 :] if tokens[at + 1 : at + 2] == ["mptrain"] else None
    return None


def logical_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(offset of the first line, the line) with backslash continuations joined."""
    joined, pending, first = [], "", 0
    for offset, line in enumerate(lines):
        if not pending:
            first = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((first, pending + line))
        pending = ""
    return joined


def commands() -> list[Command]:
    found = []
    for page in PAGES:
        for block in parse(page)[1]:
            if block.lang not in ("bash", "sh", "shell", "console"):
                continue
            setup: list[str] = []
            for offset, line in logical_lines(block.lines):
                tokens = shlex.split(line, comments=True)
                if tokens[:1] and tokens[0] in SETUP:
                    setup.append(line)
                    continue
                segment: list[str] = []
                for token in [*tokens, ";"]:
                    if token not in STOP:
                        segment.append(token)
                        continue
                    args = mptrain_args(segment) if segment else None
                    if args is not None:
                        line_number = block.line + 1 + offset
                        found.append(Command(block, line_number, tuple(args), tuple(setup)))
                    segment = []
    return found


COMMANDS = commands()
# Each distinct command once (the README's tour repeats lines of docs/), under its first place.
DISTINCT = [c for i, c in enumerate(COMMANDS) if all(c.args != d.args for d in COMMANDS[:i])]


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


# --------------------------------------------------------------------------------------- tests
def test_readme_is_a_first_read():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference to docs/"


def test_the_pages_have_commands_to_check():
    """The parser finds the commands (a broken parser would make the check below vacuous)."""
    pages = {c.block.page.name for c in COMMANDS}
    assert {"README.md", "configuration.md", "python-api.md", "custom-code.md"} <= pages
    assert len(COMMANDS) >= 40
    assert any(c.args[:1] == ("-cd",) for c in COMMANDS)  # the set-up lines' config directory
    assert any("hydra.run.dir=runs/fsdp" in c.args for c in COMMANDS)  # torchrun, continued


@pytest.mark.parametrize(
    ("page", "line", "target"),
    relative_links(),
    ids=[f"{p.relative_to(ROOT)}:{n}:{t}" for p, n, t in relative_links()],
)
def test_relative_link_points_to_an_existing_file_and_heading(page, line, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.is_relative_to(ROOT), f"{target}: outside the repository"
    assert resolved.exists(), f"{target}: no such file ({resolved})"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{target}: no heading #{anchor} in {resolved.name}"


@pytest.mark.parametrize("command", DISTINCT, ids=[c.id for c in DISTINCT])
def test_command_is_accepted_as_written(command, tmp_path, monkeypatch):
    args = list(command.args)
    subcommand = args[0] if args and args[0] in {*AS_A_RUN, "eval", SAMPLE} else None
    if subcommand == "eval":
        executed = {c.args for c in COMMANDS if c.block == parse(EVAL_PAGE)[1][0]}
        assert command.args in executed, f"not one of the eval lines run from {EVAL_PAGE.name}"
        return
    if subcommand == SAMPLE:
        resume = next(a.partition("=")[2] for a in args if a.startswith("resume="))
        outcome = run_cli(args, tmp_path, monkeypatch)
        assert outcome.code == 2, outcome
        assert outcome.stderr.startswith(f"mptrain: error: resume='{resume}': no such"), outcome
        return
    for override, module in PLUGINS.items():
        if override in args and not installed(module):
            pytest.skip(f"{override}: {module} is not installed (not in the test extra)")
    for line in command.setup:
        subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True)
    if subcommand in AS_A_RUN:
        args = args[1:]
    outcome = run_cli(args, tmp_path, monkeypatch)
    assert outcome.code in (0, None), f"exit {outcome.code}: {outcome.stderr}"
    # --cfg, --help and --version answer without starting a job.
    answered = {"--cfg", "--help", "--version"} & set(args)
    assert outcome.launched or answered, "the command did not reach its jobs"


def error_examples() -> list[tuple[str, tuple[str, ...], str]]:
    """(page:line, mptrain's arguments, the error line shown) of every text block's example."""
    found = []
    for page in PAGES:
        for block in parse(page)[1]:
            if block.lang != "text":
                continue
            pairs = zip(block.lines, [*block.lines[1:], ""], strict=True)
            for offset, (this, after) in enumerate(pairs):
                if this.startswith("$ mptrain ") and after.startswith("mptrain: error: "):
                    where = f"{page.relative_to(ROOT)}:{block.line + 1 + offset}"
                    found.append((where, tuple(shlex.split(this)[2:]), after))
    return found


ERROR_EXAMPLES = error_examples()


def test_the_pages_have_error_examples_to_check():
    assert len(ERROR_EXAMPLES) >= 5
    assert any(args[:1] == ("advise",) for _, args, _ in ERROR_EXAMPLES)


@pytest.mark.parametrize(
    ("where", "args", "shown"), ERROR_EXAMPLES, ids=[w for w, _, _ in ERROR_EXAMPLES]
)
def test_error_example_exits_2_with_the_line_shown(where, args, shown, tmp_path, monkeypatch):
    for source in (ROOT / "examples").glob("*.py"):  # for the examples that name them
        shutil.copy(source, tmp_path)
    run_args = [*(args[1:] if args[:1] and args[0] in AS_A_RUN else args), *GUARD]
    outcome = run_cli(run_args, tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 2, outcome
    assert outcome.stderr.strip() == shown, where
