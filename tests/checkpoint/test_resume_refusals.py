"""resume=auto never starts over on another run's work, nor wipes a finished run (issue 39,
items 15 and 16).

Before: with every checkpoint unreadable it exited 0 ("started fresh"), renamed them ``.corrupt``
without saying so and replaced the run's metrics.jsonl and report; with ``checkpoints`` a regular
file it truncated metrics.jsonl, then failed and turned a completed report into ``failed``; on a
finished run it trained 0 steps and rewrote the report without its measurements.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from support.runs import run_cli, tiny_run, train

from mptrain.checkpoint.resume import AlreadyCompleted
from mptrain.config.base import ConfigError
from mptrain.rundir.layout import CHECKPOINT_DIR, METRICS_JSONL, REPORT_JSON

RUN = ("max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep_best=false")


def contents(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` by relative path, with its digest."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def finished(tmp_path) -> Path:
    out = tmp_path / "run"
    train(tiny_run(*RUN), out)
    return out


def test_no_checkpoint_that_loads_is_refused_naming_each_and_nothing_changes(finished):
    for path in (finished / CHECKPOINT_DIR).glob("step_*.pt"):
        path.write_bytes(path.read_bytes()[:100])  # what a full disk or a bad copy leaves
    before = contents(finished)
    with pytest.raises(ConfigError) as refused:
        train(tiny_run(*RUN, "resume=auto"), finished)
    message = str(refused.value)
    assert message.startswith(f"resume=auto: no checkpoint in {finished / CHECKPOINT_DIR} loads (")
    assert "step_00000006.pt: " in message and "step_00000003.pt: " in message
    assert message.endswith("start over there with overwrite=true (deletes them)")
    assert "\n" not in message and len(message) < 600
    assert contents(finished) == before  # no .corrupt renames, metrics and report as they were


def test_overwrite_true_starts_over_there(finished, capsys):
    for path in (finished / CHECKPOINT_DIR).glob("step_*.pt"):
        path.write_bytes(b"not a checkpoint")
    report = train(tiny_run(*RUN, "resume=auto", "overwrite=true"), finished)
    assert report["status"] == "completed" and report["training"]["steps"] == 6
    out = capsys.readouterr().out
    assert "overwrite=true: deleted 2 checkpoint(s) of the previous run" in out
    assert f"no checkpoint loaded in {finished}; started over (overwrite=true)" in out
    assert sorted(p.name for p in (finished / CHECKPOINT_DIR).glob("*.corrupt")) == []


def test_a_checkpoints_file_in_the_way_is_refused_before_anything_is_written(finished):
    directory = finished / CHECKPOINT_DIR
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    directory.write_text("a file where the checkpoints were")
    before = contents(finished)
    with pytest.raises(ConfigError, match=r"checkpoints is not a directory, so no checkpoint"):
        train(tiny_run(*RUN, "resume=auto"), finished)
    assert contents(finished) == before  # metrics.jsonl not truncated, the report still completed


def test_a_completed_run_resumed_again_keeps_its_report(finished):
    before = contents(finished)
    with pytest.raises(AlreadyCompleted) as done:
        train(tiny_run(*RUN, "resume=auto"), finished)
    assert str(done.value) == (
        f"{finished}: already completed (step 6 of 6); nothing to train, its report is kept "
        "(report.md)"
    )
    assert done.value.report["status"] == "completed"
    assert contents(finished) == before


def test_the_command_line_says_already_completed_and_exits_0(tmp_path, monkeypatch):
    args = ["model=mlp", "epochs=null", "max_steps=4", "progress=false", "hydra.run.dir=run"]
    first = run_cli(args, tmp_path, monkeypatch, jobs=True)
    assert first.code == 0, first
    speed = (tmp_path / "run" / REPORT_JSON).read_text()
    again = run_cli([*args, "resume=auto"], tmp_path, monkeypatch, jobs=True)
    assert again.code == 0 and again.stderr == "", again
    assert (tmp_path / "run" / REPORT_JSON).read_text() == speed


def test_a_finished_checkpoint_resumed_elsewhere_says_there_is_nothing_to_train(
    finished, tmp_path, capsys
):
    step6 = finished / CHECKPOINT_DIR / "step_00000006.pt"
    report = train(tiny_run(*RUN, f"resume={step6}"), tmp_path / "elsewhere")
    assert report["status"] == "completed" and report["training"]["steps"] == 6
    assert f"{step6} is at step 6 of 6: nothing left to train" in capsys.readouterr().out
    assert (tmp_path / "elsewhere" / METRICS_JSONL).read_text().count('"kind": "train"') == 0


def test_the_summary_and_report_md_say_a_run_was_resumed_and_its_fp32_modules(tmp_path):
    """Issue 39, item 8: only report.json said so. The first run pins fp32 (the default, auto,
    is bf16 on a CPU with native BF16: the resume would change nothing)."""
    from mptrain.report.render import render_markdown
    from mptrain.report.schema import load_report

    finished = tmp_path / "run"
    train(tiny_run(*RUN, "precision=fp32"), finished)
    step6 = finished / CHECKPOINT_DIR / "step_00000006.pt"
    overrides = ("max_steps=9", "resume=auto", "resume_allow_changes=true")
    train(tiny_run(*RUN[1:], *overrides, "precision=bf16", "numerics.fp32_modules=[4]"), finished)
    markdown = render_markdown(load_report(finished))
    assert f"| resumed | from {step6} at step 6; allowed changes: precision: checkpoint" in markdown
    assert "max_steps: checkpoint 6, now 9" in markdown
    assert "| fp32 modules | 4 |" in markdown


def test_overwrite_true_removes_the_earlier_runs_diagnostics_and_quarantined_files(tmp_path):
    """Issue 39, item 25: the old audit.* and *.corrupt stayed beside the new run's report."""
    out = tmp_path / "run"
    train(tiny_run(*RUN, "audit=true"), out)
    (out / CHECKPOINT_DIR / "step_00000001.pt.corrupt").write_bytes(b"cut")
    train(tiny_run(*RUN, "overwrite=true"), out)
    assert not (out / "audit.json").exists() and not (out / "audit.md").exists()
    assert list((out / CHECKPOINT_DIR).glob("*.corrupt")) == []


def test_a_latest_json_that_is_a_directory_is_found_before_training(tmp_path):
    """Issue 39, item 25: it surfaced only at the first save, as a raw IsADirectoryError."""
    (tmp_path / "run" / CHECKPOINT_DIR / "latest.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"latest\.json: not a file \(a directory\?\)"):
        train(tiny_run(*RUN), tmp_path / "run")


def test_a_resume_in_another_precision_lists_the_precision_not_its_settings(tmp_path):
    """Issue 39, item 25: an nvfp4 run resumed with precision=bf16 listed 8 spurious
    "nvfp4.*: checkpoint X, now None" differences besides the precision."""
    out = tmp_path / "run"
    train(tiny_run("precision=nvfp4", "max_steps=4", "epochs=null"), out)
    with pytest.raises(ConfigError) as refused:
        train(tiny_run("precision=bf16", "max_steps=4", "epochs=null", "resume=auto"), out)
    assert "(precision: checkpoint 'nvfp4', now 'bf16'); " in str(refused.value)
    assert "nvfp4." not in str(refused.value)
