"""Output that fits (issue 39, item 4): piped summaries were padded with trailing spaces to
260-355 columns, one diverged job's reason made a sweep table 310 columns wide, and threads=auto
printed 2-5 lines per run for a setting the user never touched."""

from __future__ import annotations

import sys

from support.runs import run_cli

from mptrain.output.joblog import MAX_PLAIN_CELL, plain_table


def test_a_piped_run_pads_nothing_and_says_threads_once(tmp_path, monkeypatch, capsys):
    args = ["model=mlp", "max_steps=40", "progress=false", "threads=auto", "hydra.run.dir=run"]
    outcome = run_cli(args, tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 0, outcome
    out = (tmp_path / "run" / "mptrain.log").read_text()
    assert "threads: warm-up at step" in out  # the measurement is in the log
    printed = sys.stdout.getvalue()  # run_cli replaced stdout (not a terminal) for this test
    lines = printed.splitlines()
    assert lines and not [line for line in lines if line != line.rstrip()]
    summary = [line for line in lines if line.startswith("threads ")]
    assert len(summary) == 1 and not [line for line in lines if line.startswith("threads:")]


def test_a_long_cell_becomes_a_note_below_a_plain_table():
    reason = "diverged: " + "loss is NaN at step 12 after 3 skipped steps; " * 5
    table = plain_table("sweep", ["job", "status"], [["0", "completed"], ["1", reason]])
    lines = table.splitlines()
    assert lines[:4] == ["sweep", "job  status", "0    completed", "1    [1]"]
    assert lines[4] == f"[1] {reason}"
    assert max(len(line) for line in lines[:4]) <= MAX_PLAIN_CELL + 5
