"""Following a job: plain progress lines when stdout is not a terminal, and the job's log file
(Hydra's ``<run dir>/mptrain.log``) holding the run's story whether or not stdout is a terminal."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest
from rich.console import Console
from support.processes import describe, run_mptrain
from support.runs import FP16_STORY, tiny_run

from mptrain.output.joblog import LOGGER, JobLog
from mptrain.train.job import train

# A run directory deeper than 80 columns: neither wrapped nor cut with "…".
LONG_DIR = "outputs/" + "a_run_directory_whose_name_is_longer_than_a_terminal_line_" * 2 + "/run"
STEP_LINE = re.compile(
    r"^train step=(\d+)/30 epoch=\d+ loss=\d+\.\d{4} lr=\S+ loss_scale=(\S+) skipped=(\d+) "
    r"samples/s=\d+ eta=\d+:\d\d:\d\d$"
)
EVAL_LINE = re.compile(r"^eval step=(\d+)/30 epoch=\d+ val_loss=\d+\.\d{4} val_accuracy=\S+%$")
LOG_PREFIX = re.compile(r"^\[[^]]+\]\[mptrain\]\[(INFO|WARNING)\] - ")


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    """One fp16 run with stdout piped (not a terminal), a long run directory."""
    cwd = tmp_path_factory.mktemp("piped")
    result = run_mptrain(
        cwd,
        *FP16_STORY,
        f"hydra.run.dir={LONG_DIR}",
    )
    assert result.returncode == 0, describe(result)
    return result, cwd / LONG_DIR


def _story(log_text: str) -> list[str]:
    """The log file's messages, without Hydra's time/logger/level prefix."""
    return [LOG_PREFIX.sub("", line) for line in log_text.splitlines() if LOG_PREFIX.match(line)]


@pytest.mark.slow
def test_piped_stdout_has_a_plain_line_per_log_row_and_evaluation(piped_run):
    result, _ = piped_run
    lines = result.stdout.splitlines()
    steps = [STEP_LINE.match(line) for line in lines]
    steps = [m for m in steps if m]
    assert [int(m[1]) for m in steps] == [10, 20, 30]
    assert [m[2] for m in steps] == ["65536", "32768", "32768"]  # backed off at the inf, step 12
    assert [int(m[3]) for m in steps] == [0, 1, 1]  # skipped so far
    assert [int(m[1]) for m in map(EVAL_LINE.match, lines) if m] == [15, 30]
    assert "\x1b" not in result.stdout + result.stderr  # no escape codes
    # Printed once: Hydra's console handler does not repeat the logged lines.
    assert "[mptrain]" not in result.stdout + result.stderr


@pytest.mark.slow
def test_piped_stdout_keeps_long_paths_whole(piped_run):
    result, run_dir = piped_run
    report = str(run_dir.resolve() / "report.json")
    assert len(report) > 120
    assert any(report in line for line in result.stdout.splitlines()), result.stdout
    assert "…" not in result.stdout
    assert f"run dir {run_dir.resolve()}" in result.stdout  # the announce line, unwrapped


@pytest.mark.slow
def test_the_job_log_file_holds_the_same_story(piped_run):
    result, run_dir = piped_run
    story = _story((run_dir / "mptrain.log").read_text(encoding="utf-8"))
    printed = [line for line in result.stdout.splitlines() if STEP_LINE.match(line)]
    printed += [line for line in result.stdout.splitlines() if EVAL_LINE.match(line)]
    assert len(printed) == 5 and set(printed) <= set(story)
    assert (
        story[0].startswith("mptrain mlp on digits") and f"run dir {run_dir.resolve()}" in story[0]
    )
    assert any(line.startswith("note: FP16 on CPU") for line in story)
    assert "summary: status: completed" in story
    assert any(re.fullmatch(r"summary: final val accuracy: \d+\.\d\d%", line) for line in story)
    assert f"report: {run_dir.resolve() / 'report.json'}" in story
    assert "\x1b" not in "".join(story)


def test_a_terminal_keeps_the_live_bar_and_the_log_file_gets_the_lines(tmp_path):
    terminal = io.StringIO()
    console = Console(file=terminal, force_terminal=True, width=100)
    handler = logging.FileHandler(tmp_path / "job.log", encoding="utf-8")
    logging.getLogger().addHandler(handler)
    try:
        cfg = tiny_run("max_steps=8", "log_every=4", "eval_every=8", "progress=true")
        train(cfg, tmp_path / "run", console)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    logged = (tmp_path / "job.log").read_text(encoding="utf-8").splitlines()
    steps = [int(m[1]) for m in map(re.compile(r"train step=(\d+)/8 ").match, logged) if m]
    assert steps == [1, 4, 8]  # the first step's line, then the log rows
    assert any(line.startswith("eval step=8/8 ") for line in logged)
    assert any(line.startswith("summary: final val accuracy: ") for line in logged)
    shown = terminal.getvalue()
    assert "train step=" not in shown  # the bar shows progress on a terminal: no line twice
    assert "mptrain" in shown and "completed" in shown


def test_job_log_records_to_files_only_and_restores_the_logger(tmp_path):
    root = logging.getLogger()
    to_stdout = logging.StreamHandler(sys.stdout)
    to_file = logging.FileHandler(tmp_path / "job.log", encoding="utf-8")
    root.addHandler(to_stdout)
    root.addHandler(to_file)
    before = (LOGGER.propagate, list(LOGGER.handlers))
    try:
        with JobLog(Console(file=io.StringIO())) as log:
            assert to_stdout not in LOGGER.handlers and to_file in LOGGER.handlers
            log.say("a path [not markup]", "note")
    finally:
        root.removeHandler(to_stdout)
        root.removeHandler(to_file)
        to_file.close()
    assert (LOGGER.propagate, LOGGER.handlers) == before
    assert (tmp_path / "job.log").read_text(encoding="utf-8") == "note: a path [not markup]\n"


@pytest.mark.slow
def test_each_job_of_a_sweep_has_its_own_log_file(tmp_path):
    result = run_mptrain(
        tmp_path,
        "-m",
        "model=mlp",
        "device=cpu",
        "precision=fp32,bf16",
        "max_steps=4",
        "log_every=2",
        "hydra.sweep.dir=sweep",
    )
    assert result.returncode == 0, describe(result)
    for number, precision in enumerate(("fp32", "bf16")):
        (job,) = (tmp_path / "sweep").glob(f"{number}_*precision={precision}")
        story = _story((job / "mptrain.log").read_text(encoding="utf-8"))
        announce = [line for line in story if line.startswith("mptrain mlp")]
        assert len(announce) == 1 and f"| {precision}" in announce[0], story
        assert [line.split()[1] for line in story if line.startswith("train ")] == [
            "step=1/4",  # the first step's line (issue 29: no silent start)
            "step=2/4",
            "step=4/4",
        ]
