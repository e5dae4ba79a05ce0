"""A run owns its directory and nothing of another run is lost or mixed (issue 27, items 1, 2, 5,
6): each test reproduces a case that lost or mixed data before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_run, train

from mptrain.config.base import ConfigError
from mptrain.rundir.checkpoint import load_checkpoint
from mptrain.rundir.layout import BEST, CHECKPOINT_DIR, LATEST, METRICS_JSONL, REPORT_JSON


def metric_steps(directory: Path) -> list[int]:
    rows = [json.loads(line) for line in (directory / METRICS_JSONL).read_text().splitlines()]
    return [row["step"] for row in rows if row.get("kind", "train") == "train" and "step" in row]


def killed_before_its_first_periodic_checkpoint(directory: Path) -> None:
    """What kill -9 leaves of a run whose first periodic checkpoint was still minutes away:
    best.pt (written at each better evaluation), metrics.jsonl and the log; no step_*.pt."""
    train(tiny_run("max_steps=4", "eval_every=2", "log_every=1"), directory)
    checkpoints = directory / CHECKPOINT_DIR
    for path in [*checkpoints.glob("step_*.pt"), checkpoints / LATEST]:
        path.unlink()
    for name in ("report.json", "report.md", "curves.png"):
        (directory / name).unlink(missing_ok=True)
    assert (checkpoints / BEST).is_file()


def test_a_fresh_run_over_a_killed_runs_best_and_metrics_is_refused(tmp_path):
    killed_before_its_first_periodic_checkpoint(tmp_path)
    best = (tmp_path / CHECKPOINT_DIR / BEST).read_bytes()
    metrics = (tmp_path / METRICS_JSONL).read_text()
    with pytest.raises(ConfigError, match=r"holds another run's .*best\.pt.*resume=auto"):
        train(tiny_run("max_steps=4", "eval_every=2"), tmp_path)
    assert (tmp_path / CHECKPOINT_DIR / BEST).read_bytes() == best
    assert (tmp_path / METRICS_JSONL).read_text() == metrics


def test_a_fresh_run_over_a_finished_runs_report_is_refused(tmp_path):
    train(tiny_run("max_steps=2", "checkpoint.enabled=false"), tmp_path)
    report = (tmp_path / REPORT_JSON).read_text()
    with pytest.raises(ConfigError, match=r"holds another run's .*metrics\.jsonl.*overwrite=true"):
        train(tiny_run("max_steps=2", "checkpoint.enabled=false"), tmp_path)
    assert (tmp_path / REPORT_JSON).read_text() == report


@pytest.mark.slow
def test_overwrite_true_deletes_the_earlier_runs_best_metrics_and_report(tmp_path, capsys):
    killed_before_its_first_periodic_checkpoint(tmp_path)
    report = train(tiny_run("max_steps=2", "overwrite=true", "log_every=1"), tmp_path)
    assert report["status"] == "completed"
    assert metric_steps(tmp_path) == [1, 2]  # only this run's rows
    out = capsys.readouterr().out
    assert "overwrite=true: deleted 0 checkpoint(s)" in out and "best.pt" in out


@pytest.mark.slow
def test_resume_auto_starts_from_best_when_it_is_all_there_is_and_says_so(tmp_path, capsys):
    killed_before_its_first_periodic_checkpoint(tmp_path)
    saved_step = load_checkpoint(tmp_path / CHECKPOINT_DIR / BEST)["loop"]["step"]
    report = train(tiny_run("max_steps=4", "eval_every=2", "log_every=1", "resume=auto"), tmp_path)
    assert report["status"] == "completed"
    assert report["resumed"]["from"].endswith(BEST)
    assert report["resumed"]["step"] == saved_step
    assert any("resumed from best.pt" in note for note in report["resumed"]["notes"])
    assert metric_steps(tmp_path) == [1, 2, 3, 4]  # each step once
    assert "no step checkpoint: resumed from best.pt" in capsys.readouterr().out
