"""A run owns its directory and nothing of another run is lost or mixed (issue 27, items 1, 2, 5,
6): each test reproduces a case that lost or mixed data before."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from support.processes import describe, run_mptrain
from support.runs import LM, compose_run, tiny_run, train

from mptrain.checkpoint.file import load_checkpoint
from mptrain.config.base import ConfigError
from mptrain.data.batches import files_identity, tensors_identity
from mptrain.platform.signals import Terminated, terminate_like_interrupt
from mptrain.rundir.layout import BEST, CHECKPOINT_DIR, LATEST, METRICS_JSONL, REPORT_JSON
from mptrain.train import job as job_module


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


@pytest.mark.slow
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


# ------------------------------------------------------------ the data a checkpoint was trained on
def lm_run(text: Path, *overrides: str):
    return compose_run(*LM, f"dataset.path={text}", "dataset.vocabulary=chars", *overrides)


@pytest.mark.slow
def test_resume_refuses_a_text_changed_in_place_and_keeps_the_finished_runs_report(tmp_path):
    """Item 2: the same path, other content: refused naming dataset.path, before anything of the
    finished run is touched (it used to fail in load_state_dict and write a 'failed' report)."""
    text, out = tmp_path / "corpus.txt", tmp_path / "run"
    text.write_text("to be or not to be, that is the question\n" * 400)
    train(lm_run(text, "max_steps=4"), out)
    finished = {name: (out / name).read_bytes() for name in ("report.json", "report.md")}
    text.write_text("TO BE OR NOT TO BE; WHAT A QUESTION!\n" * 400)  # other characters
    with pytest.raises(ConfigError, match=rf"dataset.path='{text}' holds other data than"):
        train(lm_run(text, "max_steps=4", "resume=auto"), out)
    with pytest.raises(ConfigError, match=r"does not fit the run built now .*size mismatch"):
        train(lm_run(text, "max_steps=4", "resume=auto", "resume_allow_changes=true"), out)
    assert {name: (out / name).read_bytes() for name in finished} == finished


def test_data_identity_follows_content_not_names(tmp_path):
    a, b = tmp_path / "a.jpg", tmp_path / "b.jpg"
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"y" * 10)
    before = files_identity([str(a), str(b)])
    assert files_identity([str(a), str(b)]) == before
    os.utime(b, ns=(0, 0))  # rewritten (here: only its mtime changed)
    assert files_identity([str(a), str(b)]) != before
    assert files_identity([str(a)]) != before  # a file gone
    x = torch.arange(6)
    assert tensors_identity(x) == tensors_identity(x.clone())
    assert tensors_identity(x) != tensors_identity(x.flip(0))


@pytest.mark.slow
def test_a_checkpoint_without_a_data_identity_still_resumes(tmp_path):
    """Checkpoints of an older mptrain name no data: nothing to compare, nothing refused."""
    out = tmp_path / "run"
    train(tiny_run("max_steps=2", "checkpoint.every_steps=2"), out)
    path = out / CHECKPOINT_DIR / "step_00000002.pt"
    payload = torch.load(path, weights_only=True)
    assert payload["signature"].pop("data.identity").startswith("sha256:")
    torch.save(payload, path)
    report = train(tiny_run("max_steps=3", "resume=auto", "resume_allow_changes=true"), out)
    assert report["resumed"]["allowed_differences"] == ["max_steps: checkpoint 2, now 3"]


@pytest.mark.slow
def test_a_resumed_run_reports_its_throughput(tmp_path):
    """Item 6: the stopwatch started only at the absolute warm-up step, so any resumed run said
    'n/a samples/s (0 steps after 5 warm-up)' and sweep speed columns broke."""
    train(tiny_run("max_steps=4", "checkpoint.every_steps=4"), tmp_path)
    report = train(tiny_run("max_steps=10", "resume=auto", "resume_allow_changes=true"), tmp_path)
    assert report["resumed"]["step"] == 4
    throughput = report["throughput"]
    assert throughput["measured_steps"] == 10 - 4 - 2  # after this process's 2 warm-up steps
    assert throughput["samples_per_s"] > 0


# ------------------------------------------------------------------ the run's record (.hydra/)
@pytest.mark.slow
def test_a_refused_resume_leaves_the_earlier_runs_record_as_it_was(tmp_path):
    """Item 6: refused for different settings, `resume=auto hydra.run.dir=<an earlier run>`
    still rewrote that run's .hydra/config.yaml and overrides.yaml."""
    out = tmp_path / "run"
    common = ("model=mlp", "device=cpu", "progress=false", "epochs=null", f"hydra.run.dir={out}")
    first = run_mptrain(tmp_path, *common, "max_steps=2")
    assert first.returncode == 0, describe(first)
    record = {p.name: p.read_bytes() for p in (out / ".hydra").iterdir()}
    second = run_mptrain(tmp_path, *common, "max_steps=3", "resume=auto")
    assert second.returncode == 2, describe(second)
    assert "saved with different settings (max_steps: checkpoint 2, now 3)" in second.stderr
    assert {p.name: p.read_bytes() for p in (out / ".hydra").iterdir()} == record
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".hydra")) == [".hydra"]


@pytest.mark.slow
def test_an_accepted_resume_records_its_own_command(tmp_path):
    out = tmp_path / "run"
    common = ("model=mlp", "device=cpu", "progress=false", "epochs=null", f"hydra.run.dir={out}")
    assert run_mptrain(tmp_path, *common, "max_steps=2").returncode == 0
    resumed = run_mptrain(
        tmp_path, *common, "max_steps=3", "resume=auto", "resume_allow_changes=true"
    )
    assert resumed.returncode == 0, describe(resumed)
    assert "resume_allow_changes=true" in (out / ".hydra" / "overrides.yaml").read_text()
    hydra_yaml = yaml.safe_load((out / ".hydra" / "hydra.yaml").read_text())
    assert hydra_yaml["hydra"]["output_subdir"] == ".hydra"  # not the staged name
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".hydra")) == [".hydra"]


# ------------------------------------------------------------ a stop signal in the first instant
@pytest.fixture
def stop_signals_raise():
    """SIGTERM and SIGHUP raise Terminated for one test (terminate_like_interrupt), every handler
    put back afterwards: a signal mptrain does not hold fails the test, never ends pytest."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    terminate_like_interrupt()
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize(
    "where", ["check_no_other_run", pytest.param("FigureWorker", marks=pytest.mark.figure)]
)
def test_sigterm_while_the_run_takes_its_directory_writes_an_interrupted_report(
    tmp_path, monkeypatch, stop_signals_raise, where
):
    """Item 5: before the job's report writer existed (the directory check, the lock, the figure
    worker's start) a SIGTERM left only .hydra/ and an empty log."""
    real = getattr(job_module, where)

    def signalled(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(job_module, where, signalled)
    with pytest.raises(Terminated):
        train(tiny_run("max_steps=2"), tmp_path)
    report = json.loads((tmp_path / REPORT_JSON).read_text())
    assert report["status"] == "interrupted" and report["reason"] == "SIGTERM before training"


def test_a_signal_before_a_resume_is_accepted_leaves_the_finished_run_as_it_was(
    tmp_path, monkeypatch, stop_signals_raise
):
    train(tiny_run("max_steps=2", "checkpoint.every_steps=2"), tmp_path)
    finished = (tmp_path / REPORT_JSON).read_bytes()

    def build_then_terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(job_module, "build_run", build_then_terminated)
    with pytest.raises(Terminated):
        train(tiny_run("max_steps=2", "resume=auto"), tmp_path)
    assert (tmp_path / REPORT_JSON).read_bytes() == finished


# ------------------------------------------------------------ a run directory made unwritable
@pytest.mark.slow
def test_a_run_directory_made_unwritable_mid_run_is_one_line_and_exit_1(tmp_path, monkeypatch):
    """Item 17: the right first line, then three chained tracebacks, the lock's removal masking
    the failure. The directory refuses new names and removals from the second checkpoint on
    (chmod -w or a read-only remount; root ignores chmod, so it is simulated)."""
    import pathlib
    import tempfile

    from support.runs import run_cli

    from mptrain.checkpoint import checkpointer as checkpointer_module

    out = tmp_path / "unwritable-run"
    saves = []
    real_save = checkpointer_module.Checkpointer._save

    def counted(self, state):
        saves.append(state.step)
        return real_save(self, state)

    def refused(path) -> bool:
        return len(saves) >= 2 and str(path).startswith(str(out))

    real_mkstemp, real_unlink = tempfile.mkstemp, pathlib.Path.unlink

    def mkstemp(*args, dir=None, **kwargs):
        if refused(dir):
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)

    def unlink(self, missing_ok=False):
        if refused(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(checkpointer_module.Checkpointer, "_save", counted)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    args = ["model=mlp", "device=cpu", "progress=false", "epochs=null", "max_steps=6"]
    result = run_cli(
        [*args, "checkpoint.every_steps=2", f"hydra.run.dir={out}"], tmp_path, monkeypatch, True
    )
    assert result.code == 1, result
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mptrain: error:")]
    assert errors == [result.stderr.strip().splitlines()[-1]]
    assert errors[0].startswith("mptrain: error: run failed: PermissionError")
    assert "report.json not written (Permission denied); kept: checkpoint" in errors[0]
    assert not list((out / CHECKPOINT_DIR).glob(".*.tmp"))


# ------------------------------------------------------- resume=auto in a new directory
@pytest.mark.slow
def test_resume_auto_in_a_new_directory_names_only_a_run_of_the_same_model(tmp_path):
    """'Also': the suggestion named the most recent resumable run whatever it was (a GPT run for
    a CNN command), whose command would then be refused."""
    day = tmp_path / "outputs" / "2026-11-30"
    same = day / "09-00-00_mlp"
    train(tiny_run("max_steps=2"), same)
    other = day / "10-00-00_cnn"
    train(compose_run("model=cnn", "device=cpu", "progress=false", "max_steps=1"), other)
    report = train(tiny_run("max_steps=2", "resume=auto"), day / "11-00-00_new")
    note = report["resumed"]["note"]
    assert (
        f"the most recent resumable run of mlp {report['config']['precision']['name']} is {same}"
        in note
    )
    assert str(other) not in note


def test_a_refusal_never_proposes_resume_allow_changes_for_another_model(tmp_path):
    """Issue 28: a CNN command over an MLP run was told to set resume_allow_changes=true, which
    would load an MLP checkpoint into a CNN config."""
    train(tiny_run("max_steps=2"), tmp_path)
    cnn = compose_run("model=cnn", "device=cpu", "progress=false", "max_steps=2", "resume=auto")
    with pytest.raises(ConfigError) as refused:
        train(cnn, tmp_path)
    message = str(refused.value)
    assert "resume_allow_changes" not in message
    assert message.endswith(
        "it is a checkpoint of another model: resume it with model=mlp, or start this run "
        "in another directory"
    )
