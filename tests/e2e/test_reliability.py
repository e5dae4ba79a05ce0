"""Reliability under faults (issue 14): a run owns its directory, never overwrites another run,
and every signal ends it the same way. Each test reproduces a case that failed before."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support.processes import describe, run_command, run_mptrain
from support.runs import tiny_run, train

from mptrain.checkpoint.file import load_checkpoint
from mptrain.config.base import ConfigError
from mptrain.platform.signals import Terminated, terminate_like_interrupt
from mptrain.rundir.layout import LOCK_NAME
from mptrain.rundir.lock import RunDirLock
from mptrain.train import job as run_module

QUIET = ("progress=false", "device=cpu")


def write_lock(directory: Path, pid: int, host: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    owner = {"pid": pid, "host": host or socket.gethostname(), "started_at": "2026-11-30T12:00:00"}
    path.write_text(json.dumps(owner))
    return path


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ------------------------------------------------------------------------- one run per directory
def test_a_second_run_in_a_used_directory_is_refused_naming_the_holder(tmp_path):
    """This test process holds the directory: the second run exits 2, one line, and leaves the
    directory as it was (Hydra's .hydra/ record included)."""
    out = tmp_path / "run"
    out.mkdir()
    with RunDirLock(out):
        result = run_mptrain(tmp_path, "max_steps=2", "epochs=null", *QUIET, f"hydra.run.dir={out}")
    assert result.returncode == 2, describe(result)
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in result.stderr
    assert f"in use by another run (pid {os.getpid()} on {socket.gethostname()}" in message
    assert sorted(p.name for p in out.iterdir()) == []


def test_the_lock_holds_against_a_second_lock_in_the_same_process(tmp_path):
    with RunDirLock(tmp_path), pytest.raises(ConfigError, match="in use by another run"):
        train(tiny_run("max_steps=1"), tmp_path)


def test_a_stale_lock_is_reported_and_taken_over(tmp_path, capsys):
    pid = dead_pid()
    write_lock(tmp_path, pid)
    report = train(tiny_run("max_steps=2"), tmp_path)
    assert report["status"] == "completed"
    assert f"took over the lock of a run that is gone (pid {pid}" in capsys.readouterr().out
    assert not (tmp_path / LOCK_NAME).exists(), "the lock outlived its run"


def test_the_lock_is_released_when_the_run_fails(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(run_module, "train_loop", crash)
    with pytest.raises(run_module.RunFailed):
        train(tiny_run("max_steps=2"), tmp_path)
    with RunDirLock(tmp_path) as lock:  # free again, and not mistaken for a stale one
        assert lock.stale_note is None


# ------------------------------------------------------------------ never over another run's work
def test_a_fresh_run_refuses_a_directory_with_another_runs_checkpoints(tmp_path):
    train(tiny_run("max_steps=4", "checkpoint.every_steps=2"), tmp_path)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(
        ConfigError, match=r"holds another run's checkpoints .*resume=auto.*overwrite=true"
    ):
        train(tiny_run("max_steps=4", "checkpoint.every_steps=2"), tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == kept


@pytest.mark.slow
def test_the_refusal_comes_before_hydra_rewrites_the_run_record(tmp_path):
    out = tmp_path / "run"
    first = run_mptrain(tmp_path, "max_steps=2", "epochs=null", *QUIET, f"hydra.run.dir={out}")
    assert first.returncode == 0, describe(first)
    record = (out / ".hydra" / "overrides.yaml").read_text()
    second = run_mptrain(tmp_path, "max_steps=3", "epochs=null", *QUIET, f"hydra.run.dir={out}")
    assert "holds another run's checkpoints" in one_line_error(second)
    assert (out / ".hydra" / "overrides.yaml").read_text() == record


def test_overwrite_true_starts_over_and_says_so(tmp_path, capsys):
    train(tiny_run("max_steps=4", "checkpoint.every_steps=2"), tmp_path)
    report = train(tiny_run("max_steps=2", "overwrite=true"), tmp_path)
    assert report["status"] == "completed" and report["training"]["steps"] == 2
    assert "overwrite=true: deleted 2 checkpoint(s) of the previous run" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*.pt")] == ["step_00000002.pt"]
    assert metric_steps(tmp_path) == [2]  # the old run's rows went with its checkpoints


@pytest.mark.slow
def test_resume_auto_is_still_allowed_over_its_own_checkpoints(tmp_path):
    train(tiny_run("max_steps=2", "checkpoint.every_steps=2"), tmp_path)
    report = train(tiny_run("max_steps=4", "resume=auto", "resume_allow_changes=true"), tmp_path)
    assert report["status"] == "completed" and report["resumed"]["step"] == 2


# ----------------------------------------------------------------------------- signals in setup
class SighupUnhandled(Exception):
    """SIGHUP reached a handler mptrain did not install (Python's default would end the process)."""


def _sighup_unhandled(signum, frame):
    raise SighupUnhandled("SIGHUP was not handled by mptrain")


@pytest.fixture
def sigterm_raises():
    """terminate_like_interrupt() for one test, every handler put back afterwards. SIGHUP first
    gets a handler that raises SighupUnhandled: where mptrain does not handle SIGHUP, the test
    fails instead of the signal ending the test run."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, _sighup_unhandled)
    terminate_like_interrupt()
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_sigterm_while_building_writes_an_interrupted_report(tmp_path, monkeypatch, sigterm_raises):
    def build_then_terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(run_module, "build_run", build_then_terminated)
    with pytest.raises(Terminated):
        train(tiny_run("max_steps=2"), tmp_path)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["status"] == "interrupted" and on_disk["reason"] == "SIGTERM before training"


def test_sighup_while_building_writes_an_interrupted_report_and_exits_129(
    tmp_path, monkeypatch, sigterm_raises
):
    """A closed terminal or dropped ssh session (SIGHUP) ends a run like SIGTERM, with a report."""

    def build_then_hung_up(*args, **kwargs):
        signal.raise_signal(signal.SIGHUP)

    monkeypatch.setattr(run_module, "build_run", build_then_hung_up)
    with pytest.raises(Terminated) as stopped:
        train(tiny_run("max_steps=2"), tmp_path)
    assert stopped.value.exit_code == 129
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["status"] == "interrupted" and on_disk["reason"] == "SIGHUP before training"


def test_a_burst_of_signals_while_the_report_is_written_cannot_cut_it_short(
    tmp_path, monkeypatch, sigterm_raises
):
    """timeout -k, schedulers and impatient users send signal after signal: once the run is ending,
    they are ignored until its report is complete (a later SIGTERM used to kill the report)."""
    real_write = run_module.write_report

    def write_under_fire(output_dir, report):
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.raise_signal(sig)
        return real_write(output_dir, report)

    monkeypatch.setattr(run_module, "write_report", write_under_fire)
    report = train(tiny_run("max_steps=2", "epochs=null"), tmp_path)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == on_disk["status"] == "completed"
    assert (tmp_path / "report.md").is_file()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # the handlers are back


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_setup_ends_the_command_alike(tmp_path, sig, code):
    """SIGTERM during setup used to kill the process silently (-15, no report)."""
    script = textwrap.dedent(
        f"""
        import signal, sys
        import mptrain.train.job
        from mptrain.cli import app as cli

        # A shell starts background jobs with SIGINT ignored (and Python then keeps it so):
        # this test is about mptrain's handling, not how the suite was launched.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def build_then_signal(*args, **kwargs):
            signal.raise_signal({int(sig)})

        mptrain.train.job.build_run = build_then_signal
        cli.main(["max_steps=2", "epochs=null", "progress=false", "hydra.run.dir={tmp_path / "run"}"])
        """
    )
    result = run_command(tmp_path, sys.executable, "-c", script)
    assert result.returncode == code, describe(result)
    assert "Traceback" not in result.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "interrupted"


# ---------------------------------------------------------------------------- skips and resumes
def test_a_skip_is_seen_even_when_the_backoff_leaves_the_scale_unchanged(tmp_path):
    """backoff_factor 0.99999999 rounds to the same FP32 scale: the old scale comparison saw 0
    skips and advanced the LR on the skipped step."""
    cfg = tiny_run(
        "precision=fp16",
        "max_steps=5",
        "log_every=1",
        "precision.scaler.backoff_factor=0.99999999",
        "debug.inject_inf_grad_steps=[3]",
        "scheduler=cosine",
    )
    report = train(cfg, tmp_path)
    assert report["training"]["skipped_steps"] == {"count": 1, "steps": [3]}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lr = {row["step"]: row["lr"] for row in rows if row["kind"] == "train"}
    assert lr[3] == lr[2], "the scheduler advanced on the skipped step"
    assert lr[4] != lr[3]


def metric_steps(directory: Path) -> list[int]:
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if row["kind"] == "train"]


def test_resume_after_a_kill_between_checkpoints_logs_each_step_once(tmp_path):
    """A kill after step 5 with the last checkpoint at step 4: steps 5.. are logged again after
    resume=auto, and used to appear twice in metrics.jsonl (and the curves)."""
    common = ("log_every=1", "checkpoint.every_steps=2", "checkpoint.every_epoch=false")
    train(tiny_run("max_steps=5", *common), tmp_path)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step_00000005.pt").unlink()  # as if killed before the final save
    (checkpoints / "latest.json").write_text(json.dumps({"checkpoint": "step_00000004.pt"}))
    report = train(
        tiny_run("max_steps=7", "resume=auto", "resume_allow_changes=true", *common), tmp_path
    )
    assert report["resumed"]["step"] == 4
    assert metric_steps(tmp_path) == [1, 2, 3, 4, 5, 6, 7]
    assert any("row(s) after step 4 removed" in note for note in report["resumed"]["notes"])


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_quarantined_not_kept_in_place_of_a_good_one(tmp_path):
    common = ("checkpoint.every_steps=2", "checkpoint.every_epoch=false", "checkpoint.keep_last=2")
    train(tiny_run("max_steps=6", *common), tmp_path)
    checkpoints = tmp_path / "checkpoints"
    newest = checkpoints / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    report = train(
        tiny_run("max_steps=8", "resume=auto", "resume_allow_changes=true", *common), tmp_path
    )
    assert report["resumed"]["step"] == 4
    assert (checkpoints / "step_00000006.pt.corrupt").is_file()
    kept = sorted(p.name for p in checkpoints.glob("step_*.pt"))
    assert kept == ["step_00000006.pt", "step_00000008.pt"]  # both written by the resumed run
    for path in checkpoints.glob("step_*.pt"):
        load_checkpoint(path)  # every kept checkpoint loads


# --------------------------------------------------------------------------------- safe loading
class _RunsCodeWhenUnpickled:
    """Unpickling it would create ``marker``: through pathlib (torch: "Unsupported global") or
    through os.system (torch 2.14: "... whose module posix is blocked")."""

    def __init__(self, marker: Path, via_system: bool = False) -> None:
        self.marker, self.via_system = marker, via_system

    def __reduce__(self):
        if self.via_system:
            return (os.system, (f"touch {self.marker}",))
        return (Path.touch, (self.marker,))


def craft(source: Path, target: Path, marker: Path, via_system: bool) -> None:
    """``source`` checkpoint's payload with an object that would run code, saved at ``target``."""
    payload = load_checkpoint(source)
    payload["scheduler"]["evil"] = _RunsCodeWhenUnpickled(marker, via_system)
    torch.save(payload, target)


@pytest.mark.parametrize("via_system", [False, True], ids=["pathlib", "os-system"])
def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs(tmp_path, via_system):
    """resume=PATH used torch.load(weights_only=False): a crafted file could run code. torch's
    refusal of os.system is worded differently: it was called 'truncated or corrupt'."""
    source = tmp_path / "source"
    train(tiny_run("max_steps=2"), source)
    marker = tmp_path / "code_ran"
    crafted = tmp_path / "step_00000002.pt"
    craft(source / "checkpoints" / "step_00000002.pt", crafted, marker, via_system)
    with pytest.raises(ConfigError, match=r"refused: it holds objects other than tensors") as err:
        train(tiny_run("max_steps=4", f"resume={crafted}"), tmp_path / "run")
    assert not marker.exists(), "unpickling the checkpoint ran code"
    assert "weights_only=False" not in str(err.value) and "\n" not in str(err.value)
    if via_system:
        assert "(posix.system)" in str(err.value)


def test_resume_auto_stops_at_a_crafted_newest_checkpoint_and_keeps_it(tmp_path):
    """A refused file is not corrupt: resume=auto names it in one line rather than renaming it
    .corrupt and silently starting from an older checkpoint."""
    run_dir = tmp_path / "run"
    common = ("max_steps=4", "epochs=null", "checkpoint.every_steps=2")
    train(tiny_run(*common), run_dir)
    newest = run_dir / "checkpoints" / "step_00000004.pt"
    craft(newest, newest, tmp_path / "code_ran", via_system=True)
    with pytest.raises(ConfigError, match=r"resume=auto: checkpoint .*step_00000004.pt: refused"):
        train(tiny_run(*common, "max_steps=6", "resume=auto"), run_dir)
    assert newest.is_file() and not newest.with_name(newest.name + ".corrupt").exists()
    assert not (tmp_path / "code_ran").exists()


def test_checkpoints_load_with_weights_only(tmp_path):
    train(tiny_run("precision=fp16", "max_steps=2"), tmp_path)
    payload = torch.load(tmp_path / "checkpoints" / "step_00000002.pt", weights_only=True)
    assert payload["format_version"] == 2 and payload["loop"]["step"] == 2


# ------------------------------------------------------------------ resume compares every setting
def logged_lr(directory: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["lr"] for row in rows if row["kind"] == "train"}


def test_resume_refuses_a_changed_learning_rate_listing_it(tmp_path):
    """A new optimizer.lr used to be ignored on resume while report.json claimed it."""
    common = ("max_steps=2", "scheduler=constant", "checkpoint.every_steps=2")
    train(tiny_run(*common), tmp_path)
    with pytest.raises(ConfigError, match=r"optimizer\.lr: checkpoint 0\.003, now 0\.01") as err:
        train(
            tiny_run("max_steps=4", "scheduler=constant", "resume=auto", "optimizer.lr=0.01"),
            tmp_path,
        )
    assert "max_steps: checkpoint 2, now 4" in str(err.value)
    assert "resume_allow_changes=true" in str(err.value)


def test_an_allowed_learning_rate_change_is_applied_for_real(tmp_path):
    common = ("scheduler=constant", "log_every=1", "checkpoint.every_steps=2")
    train(tiny_run("max_steps=2", *common), tmp_path)
    report = train(
        tiny_run(
            "max_steps=4", *common, "resume=auto", "resume_allow_changes=true", "optimizer.lr=0.01"
        ),
        tmp_path,
    )
    assert logged_lr(tmp_path) == {1: 0.003, 2: 0.003, 3: 0.01, 4: 0.01}
    assert "optimizer.lr: checkpoint 0.003, now 0.01" in report["resumed"]["allowed_differences"]


@pytest.mark.slow
def test_a_changed_optimizer_is_refused_then_starts_fresh_when_allowed(tmp_path):
    """optimizer=sgd on an AdamW checkpoint crashed with KeyError: 'momentum'."""
    train(tiny_run("max_steps=2", "checkpoint.every_steps=2"), tmp_path)
    with pytest.raises(ConfigError, match=r"optimizer\.name: checkpoint 'adamw', now 'sgd'"):
        train(tiny_run("max_steps=2", "resume=auto", "optimizer=sgd"), tmp_path)
    report = train(
        tiny_run("max_steps=4", "resume=auto", "resume_allow_changes=true", "optimizer=sgd"),
        tmp_path,
    )
    assert report["status"] == "completed" and report["training"]["steps"] == 4
    assert any("optimizer changed (adamw -> sgd)" in note for note in report["resumed"]["notes"])


# ------------------------------------------------------------ one line, exit 2, never a traceback
def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, describe(result)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mptrain: error: "), describe(result)
    return lines[0]


@pytest.mark.parametrize(
    ("make_dir", "expected"),
    [
        (
            lambda tmp: (tmp / "a_file").write_text("x") and tmp / "a_file",
            "exists and is not a directory",
        ),
        (lambda tmp: Path("/proc/mptrain_run"), "cannot create directories in /proc"),
        (lambda tmp: tmp / ("n" * 300), "longer than the file system allows"),
    ],
    ids=["existing-file", "proc", "name-too-long"],
)
def test_an_unusable_run_directory_is_one_line(tmp_path, make_dir, expected):
    run_dir = make_dir(tmp_path)
    result = run_mptrain(tmp_path, "max_steps=1", "epochs=null", *QUIET, f"hydra.run.dir={run_dir}")
    assert expected in one_line_error(result)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("seed=99999999999999999999", "seed=99999999999999999999: must fit in 64 bits"),
        ("precision.scaler.init_scale=1e39", "at most FP32's largest value"),
        ("optimizer.weight_decay=inf", "optimizer.weight_decay=inf: must be >= 0 and finite"),
        ("dataset.root=" + "r" * 5000, "dataset.root='rrrr"),
    ],
    ids=["seed", "init-scale", "weight-decay", "long-root"],
)
def test_values_that_used_to_fail_mid_run_are_refused_up_front(tmp_path, override, expected):
    extra = ("dataset=cifar10",) if override.startswith("dataset.root") else ()
    result = run_mptrain(tmp_path, "max_steps=1", "epochs=null", *QUIET, *extra, override)
    assert expected in one_line_error(result)
    assert not list(tmp_path.glob("outputs/*/*/report.json")), "something trained"


@pytest.mark.slow
def test_help_into_a_closed_pipe_ends_quietly(tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)
    result = subprocess.run(
        [sys.executable, "-m", "mptrain", "--help"],
        cwd=tmp_path,  # not the repository root, whose mptrain/ would shadow the installed one
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    assert result.returncode == 0 and result.stderr == ""


def test_resume_auto_in_a_new_directory_names_the_run_it_may_mean(tmp_path, capsys):
    outputs = tmp_path / "outputs"
    earlier = outputs / "2026-11-30" / "10-00-00_fp32_mlp_digits"
    train(tiny_run("max_steps=2"), earlier)
    capsys.readouterr()
    report = train(tiny_run("max_steps=2", "resume=auto"), outputs / "2026-11-30" / "11-00-00_new")
    assert report["resumed"]["from"] is None
    note = report["resumed"]["note"]
    assert note.startswith(f"no checkpoint in {outputs / '2026-11-30' / '11-00-00_new'}")
    assert f" is {earlier}: mptrain resume=auto hydra.run.dir={earlier}" in note


def test_a_full_disk_while_writing_the_report_says_what_was_kept(tmp_path, monkeypatch):
    import errno

    from mptrain.report import render as report_module

    real_write = report_module.atomic_write_text

    def full_disk(path, text):
        if path.name == "report.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, text)

    monkeypatch.setattr(report_module, "atomic_write_text", full_disk)
    with pytest.raises(run_module.RunFailed) as err:
        train(tiny_run("max_steps=2"), tmp_path)
    reason = err.value.reason
    assert "\n" not in reason and reason.startswith("report.json not written (No space left")
    assert "checkpoints/step_00000002.pt (intact)" in reason


# ---------------------------------------------------------------------------- bad data files
def image_folders(root: Path, bad: dict[str, bytes]) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (12, 12), (40 * i, 80, 120)).save(folder / f"{i}.png")
    for name, content in bad.items():
        (root / name).write_bytes(content)


def test_a_text_file_named_jpg_stops_the_run_in_one_line_naming_it(tmp_path):
    data = tmp_path / "data"
    image_folders(data, {"train/cat/notes.jpg": b"not an image, just text\n"})
    overrides = (
        "dataset=imagefolder",
        f"dataset.root={data}",
        "dataset.image_size=8",
        "dataset.resize_size=8",
        "batch_size=9",
        "max_steps=2",
        "num_workers=1",
    )
    with pytest.raises(run_module.RunFailed) as err:
        train(tiny_run(*overrides), tmp_path / "run")
    reason = err.value.reason
    assert "\n" not in reason and "notes.jpg" in reason and "cannot identify image file" in reason
    on_disk = json.loads((tmp_path / "run" / "report.json").read_text())
    assert "Traceback" not in on_disk["reason"]


def test_skip_bad_files_skips_and_counts_them(tmp_path):
    data = tmp_path / "data"
    png = data / "x.png"
    image_folders(data, {"train/cat/notes.jpg": b"text", "val/dog/empty.png": b""})
    overrides = (
        "dataset=imagefolder",
        f"dataset.root={data}",
        "dataset.image_size=8",
        "dataset.resize_size=8",
        "batch_size=3",
        "max_steps=3",
        "num_workers=0",
        "dataset.skip_bad_files=true",
    )
    report = train(tiny_run(*overrides), tmp_path / "run")
    assert report["status"] == "completed"
    assert report["data"]["skipped_bad_files"] >= 2  # the train file when drawn, the val file
    assert not png.exists()


@pytest.mark.slow
def test_a_corrupt_cifar_batch_file_is_named(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(b"\x80\x04garbage")
    result = run_mptrain(
        tmp_path,
        "dataset=cifar10",
        f"dataset.root={tmp_path}",
        "max_steps=1",
        "epochs=null",
        *QUIET,
    )
    message = one_line_error(result)
    assert "data_batch_1 is not a readable cifar10 batch file" in message


def test_resume_auto_refuses_an_other_format_checkpoint_without_quarantining_it(tmp_path):
    train(tiny_run("max_steps=2"), tmp_path)
    path = tmp_path / "checkpoints" / "step_00000002.pt"
    payload = load_checkpoint(path)
    payload["format_version"] = 1
    torch.save(payload, path)
    with pytest.raises(ConfigError, match="not an mptrain checkpoint of this version"):
        train(tiny_run("max_steps=4", "resume=auto", "resume_allow_changes=true"), tmp_path)
    assert path.is_file() and not list((tmp_path / "checkpoints").glob("*.corrupt"))


@pytest.mark.slow
def test_a_metrics_row_cut_short_by_a_kill_does_not_stop_the_resume(tmp_path):
    common = ("log_every=1", "checkpoint.every_steps=2", "checkpoint.every_epoch=false")
    train(tiny_run("max_steps=2", *common), tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # the kill came mid-write
    report = train(
        tiny_run("max_steps=4", "resume=auto", "resume_allow_changes=true", *common), tmp_path
    )
    assert report["status"] == "completed" and metric_steps(tmp_path) == [1, 2, 3, 4]


def test_an_allowed_change_of_parameter_groups_resumes_with_fresh_optimizer_state(tmp_path):
    """weight_decay 0.01 -> 0 merges the decay/no-decay groups: the saved state cannot load."""
    train(tiny_run("max_steps=2"), tmp_path)
    report = train(
        tiny_run(
            "max_steps=4", "resume=auto", "resume_allow_changes=true", "optimizer.weight_decay=0"
        ),
        tmp_path,
    )
    assert report["status"] == "completed"
    assert any("optimizer state not resumed" in note for note in report["resumed"]["notes"])
