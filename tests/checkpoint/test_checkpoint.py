"""Checkpoints, exact resume and fault handling (mptrain.checkpoint.file, mptrain.platform.signals, run.train).

CPU-only, model=mlp on digits (22 optimizer steps per epoch at batch 64). Every test checks that
nothing was lost: the previous checkpoint still loads, the resumed run reproduces an uninterrupted
one bit for bit, the report says what happened.

Stops are requested in-process the way a real signal does it: ``signal.raise_signal(SIGTERM)`` from
an observer at step N, while :class:`~mptrain.platform.signals.GracefulStop` has its handlers installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.runs import NoFigure, tiny_run, train
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mptrain.checkpoint.checkpointer import Checkpointer
from mptrain.checkpoint.file import (
    ADDED_SETTINGS,
    FORMAT_VERSION,
    CheckpointError,
    atomic_torch_save,
    load_checkpoint,
    remove_stray_temporaries,
)
from mptrain.config.base import ConfigError
from mptrain.output.metrics import MetricsLog, read_metrics
from mptrain.rundir.fileio import atomic_link
from mptrain.rundir.layout import LATEST, candidates
from mptrain.train import job as run_module
from mptrain.train.build import prepare_run
from mptrain.train.job import RunFailed, RunInterrupted
from mptrain.train.state import LoopState

STEPS_PER_EPOCH = 22  # digits, batch 64

# Metrics fields that must agree between a resumed and an uninterrupted run (not the timing).
ROW_FIELDS = (
    "step",
    "epoch",
    "loss",
    "lr",
    "loss_scale",
    "grad_norm",
    "skipped",
    "skipped_total",
    "zero_grad_fraction",
    "updates_lost_fraction",
)


# ----------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the mlp gains nothing from more, and the CLI test runs 3 processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_run_figure(monkeypatch):
    """Skip curves.png (matplotlib is most of a tiny run's time and nothing here reads it)."""
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)


def step_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def step_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))


def latest_target(run_dir: Path) -> str:
    return json.loads((run_dir / "checkpoints" / LATEST).read_text())["checkpoint"]


def temporaries(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.tmp"))


def read_report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train_rows(run_dir: Path) -> list[tuple]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    return [tuple(r[k] for k in ROW_FIELDS) for r in rows if r["kind"] == "train"]


def eval_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    """Bit-identical (torch.equal) state dicts, nested dicts included."""
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if is_traceable_wrapper_subclass(x):  # torchao's quantized optimizer states
            assert type(x) is type(y), f"{what}: {key} differs"
            inner = x.__tensor_flatten__()[0]
            assert_same_tensors(
                {n: getattr(x, n) for n in inner},
                {n: getattr(y, n) for n in inner},
                f"{what}.{key}",
            )
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {key} differs"
        elif isinstance(x, dict):
            assert_same_tensors(x, y, f"{what}.{key}")
        else:
            assert x == y, f"{what}: {key} differs ({x!r} != {y!r})"


def saved_and_loaded(state: dict) -> dict:
    """A copy of ``state`` through torch.save (torchao's state tensors cannot be deep-copied)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


class FinalState:
    """The model, optimizer and scaler state right after train_loop returns (a run's final state)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.model: dict[str, torch.Tensor] | None = None
        self.optimizer: dict | None = None
        self.scaler: dict | None = None
        real_loop = run_module.train_loop

        def capturing_loop(run, hooks):
            state = real_loop(run, hooks)
            self.model = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
            self.optimizer = saved_and_loaded(run.optimizer.state_dict())
            self.scaler = run.precision.scaler.state_dict()
            return state

        monkeypatch.setattr(run_module, "train_loop", capturing_loop)

    def take(self) -> dict:
        taken = {"model": self.model, "optimizer": self.optimizer, "scaler": self.scaler}
        self.model = self.optimizer = self.scaler = None
        return taken


def run_stopped_at(
    monkeypatch: pytest.MonkeyPatch, cfg, out: Path, step: int, sig=signal.SIGTERM
) -> RunInterrupted:
    """Run ``cfg`` and deliver ``sig`` to this process at optimizer step ``step``."""

    def on_step(self, state):
        if state.step == step:
            signal.raise_signal(sig)

    with monkeypatch.context() as m:
        m.setattr(MetricsLog, "on_step", on_step)
        with pytest.raises(RunInterrupted) as err:
            train(cfg, out)
    return err.value


def assert_interrupted_at(err: RunInterrupted, out: Path, step: int, code: int, name: str) -> None:
    assert err.exit_code == code
    on_disk = read_report(out)
    assert on_disk["status"] == err.report.to_dict()["status"] == "interrupted"
    assert on_disk["reason"].startswith(f"{name} at step {step}")
    assert on_disk["training"]["steps"] == step
    assert latest_target(out) == step_name(step)
    assert on_disk["checkpoints"]["latest"] == str(out / "checkpoints" / step_name(step))
    payload = load_checkpoint(out / "checkpoints" / step_name(step))
    assert payload["loop"]["step"] == step
    assert not temporaries(out / "checkpoints")


def test_sighup_during_training_stops_after_the_step_with_a_checkpoint_and_exit_129(
    tmp_path, monkeypatch
):
    """SIGHUP (a closed terminal, a dropped ssh session) stops a run like SIGTERM."""

    def unhandled(signum, frame):  # where mptrain does not handle SIGHUP: fail, do not die
        raise AssertionError("SIGHUP was not handled by mptrain")

    previous = signal.signal(signal.SIGHUP, unhandled)
    try:
        err = run_stopped_at(
            monkeypatch, tiny_run("max_steps=8", "epochs=null"), tmp_path, 3, signal.SIGHUP
        )
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert_interrupted_at(err, tmp_path, 3, 129, "SIGHUP")


# ------------------------------------------------------------------ 1, 2. bitwise resume in-process
def interrupt_and_resume(tmp_path, monkeypatch, overrides, stop_step):
    """(uninterrupted report, its final state, resumed report, its final state, run dirs)."""
    capture = FinalState(monkeypatch)
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "resumed"
    ref_report = train(tiny_run(*overrides), ref_dir)
    ref_state = capture.take()

    err = run_stopped_at(monkeypatch, tiny_run(*overrides), run_dir, stop_step)
    assert_interrupted_at(err, run_dir, stop_step, 143, "SIGTERM")
    capture.take()

    report = train(tiny_run(*overrides, "resume=auto"), run_dir)
    state = capture.take()
    assert report["status"] == "completed"
    assert report["resumed"]["from"] == str(run_dir / "checkpoints" / step_name(stop_step))
    assert report["resumed"]["step"] == stop_step
    assert report["resumed"]["allowed_differences"] == [] and report["resumed"]["notes"] == []
    return ref_report, ref_state, report, state, ref_dir, run_dir


def assert_runs_identical(ref_report, ref_state, report, state, ref_dir, run_dir, total):
    assert_same_tensors(ref_state["model"], state["model"], "final parameters")
    assert_same_tensors(ref_state["optimizer"]["state"], state["optimizer"]["state"], "optimizer")
    assert ref_state["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    # metrics.jsonl is appended across the two runs: every step exactly once, same values.
    rows = train_rows(run_dir)
    assert [r[0] for r in rows] == list(range(1, total + 1))
    assert rows == train_rows(ref_dir)
    assert eval_rows(run_dir) == eval_rows(ref_dir)
    on_disk, ref_on_disk = read_report(run_dir), read_report(ref_dir)
    for key in ("steps", "epochs_completed", "samples_seen", "skipped_steps", "loss_scale"):
        assert on_disk["training"][key] == ref_on_disk["training"][key], key
    assert on_disk["training"]["final_train_loss"] == ref_on_disk["training"]["final_train_loss"]
    assert on_disk["evaluation"] == ref_on_disk["evaluation"]
    assert report["training"]["steps"] == ref_report["training"]["steps"] == total
    # The epoch-end checkpoint written after the resume equals the uninterrupted run's one.
    mine = load_checkpoint(run_dir / "checkpoints" / step_name(STEPS_PER_EPOCH))
    theirs = load_checkpoint(ref_dir / "checkpoints" / step_name(STEPS_PER_EPOCH))
    for part in ("model", "scheduler", "loop"):
        if part == "model":
            assert_same_tensors(mine[part], theirs[part], part)
        else:
            assert mine[part] == theirs[part], part
    assert_same_tensors(mine["optimizer"]["state"], theirs["optimizer"]["state"], "optimizer")
    assert mine["scaler"] == theirs["scaler"]


def test_fp32_resume_mid_epoch_is_bit_identical(tmp_path, monkeypatch):
    n = 15  # mid-epoch 0; the resumed half crosses the epoch boundary (22) and ends at 30
    # Dropout draws from torch's RNG every step: bitwise equality needs the RNG state restored.
    overrides = (
        "precision=fp32",
        f"max_steps={2 * n}",
        "log_every=1",
        "model.dropout=0.2",
        "checkpoint.every_epoch=true",  # the resumed run's epoch-end checkpoint is compared too
        "checkpoint.keep_last=5",  # keep the stop checkpoint for inspection after the resume
    )
    results = interrupt_and_resume(tmp_path, monkeypatch, overrides, n)
    assert_runs_identical(*results, total=2 * n)
    _, ref_state, report, state, _, run_dir = results
    assert ref_state["scaler"] == state["scaler"] == {}
    assert report["training"]["loss_scale"] is None
    assert load_checkpoint(run_dir / "checkpoints" / step_name(n))["scaler"] is None


@pytest.mark.parametrize(
    "state",
    [
        ("optimizer.state_dtype=bf16", "optimizer.state_rounding=nearest"),
        ("optimizer.state_dtype=bf16", "optimizer.state_rounding=stochastic"),
        pytest.param(("optimizer=adamw8bit",), marks=pytest.mark.slow),  # torch.compile: ~20 s
    ],
    ids=["bf16-nearest", "bf16-stochastic", "adamw8bit"],
)
def test_low_precision_optimizer_states_resume_bit_for_bit(tmp_path, monkeypatch, state):
    """optimizer.state_dtype=bf16: the checkpoint holds BF16 moments (and the stochastic
    rounding's generator), which torch's load_state_dict casts to FP32 and the next step stores
    back in BF16; torchao's 8-bit states load as saved. The resumed run equals the uninterrupted
    one bit for bit."""
    pytest.importorskip("torchao") if "optimizer=adamw8bit" in state else None
    n = 15
    overrides = (
        "precision=bf16",
        f"max_steps={2 * n}",
        "log_every=1",
        *state,
        "checkpoint.every_epoch=true",  # the epoch-end checkpoints are compared too
        "checkpoint.keep_last=5",
    )
    results = interrupt_and_resume(tmp_path, monkeypatch, overrides, n)
    assert_runs_identical(*results, total=2 * n)


def test_fp16_resume_replays_the_skipped_step_and_the_scaler(tmp_path, monkeypatch):
    n, interval = 15, 8
    overrides = (
        "precision=fp16",
        f"max_steps={2 * n}",
        "log_every=1",
        "checkpoint.every_epoch=true",
        "checkpoint.keep_last=5",
        f"debug.inject_inf_grad_steps=[{n + 3}]",
        # The scale grows after every 8 clean steps: at 8, then at 16 -- one step after the resume,
        # which happens on time only if the growth tracker (7 at the stop) came through.
        f"precision.scaler.growth_interval={interval}",
    )
    results = interrupt_and_resume(tmp_path, monkeypatch, overrides, n)
    assert_runs_identical(*results, total=2 * n)
    ref_report, ref_state, report, state, _, run_dir = results

    # The stop checkpoint holds the scaler as it was after step n: grown once, 7 clean steps since.
    stop = load_checkpoint(run_dir / "checkpoints" / step_name(n))
    saved = stop["scaler"]
    assert [tuple(c) for c in stop["loop"]["scale"]["changes"]] == [(interval, 131072.0)]
    assert saved["scale"] == 131072.0 and saved["_growth_tracker"] == n - interval
    fresh = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=3)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved, "scaler state does not round-trip"

    # Both runs: growth at 16, the injected inf skipped at 18 (backoff), growth 8 steps later.
    expected = [(interval, 131072.0), (n + 1, 262144.0), (n + 3, 131072.0), (n + 11, 262144.0)]
    for r in (ref_report, report):
        assert r["training"]["skipped_steps"] == {"count": 1, "steps": [n + 3]}
        assert r["training"]["loss_scale"]["changes"] == expected
    assert read_report(run_dir)["training"]["loss_scale"]["changes"] == [list(c) for c in expected]
    assert ref_state["scaler"] == state["scaler"]
    assert state["scaler"]["scale"] == 262144.0
    assert state["scaler"]["_growth_tracker"] == 2 * n - (n + 11)
    skipped_rows = [r[0] for r in train_rows(run_dir) if r[ROW_FIELDS.index("skipped")]]
    assert skipped_rows == [n + 3]


# ---------------------------------------------------------------- 3. real signals to a subprocess
SUBPROCESS_TIMEOUT_S = 180
# epochs=10 (220 steps) rather than 30: the same stop/resume path at a third of the file's run time.
COMMAND = (
    "model=mlp",
    "precision=fp32",
    "device=cpu",
    "epochs=10",
    "log_every=10",
    "progress=false",
    "hydra.run.dir=run",
    "checkpoint.every_steps=20",
)
TOTAL_STEPS = 10 * STEPS_PER_EPOCH


def start_mptrain(cwd: Path, *extra: str) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"  # same threads in every process; 3 run at once on 2 cores
    with (cwd / "stdout.txt").open("w") as out, (cwd / "stderr.txt").open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "mptrain", *COMMAND, *extra],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=err,
        )


def finish(proc: subprocess.Popen, cwd: Path) -> int:
    try:
        return proc.wait(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"mptrain in {cwd} did not finish:\n{(cwd / 'stderr.txt').read_text()}")


def logged_step(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    step = 0
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a row being written
            continue
        step = max(step, row.get("step", 0))
    return step


def signal_when_logged(*targets: tuple[subprocess.Popen, Path, int, int]) -> None:
    """For each (process, cwd, step, signal): send the signal once metrics.jsonl has a row past
    ``step``. All are watched at once, so none runs to completion while another is waited for."""
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    pending = list(targets)
    while pending:
        for target in list(pending):
            proc, cwd, step, sig = target
            if logged_step(cwd / "run" / "metrics.jsonl") > step:
                proc.send_signal(sig)
                pending.remove(target)
            elif proc.poll() is not None:
                pytest.fail(
                    f"mptrain exited {proc.returncode} early:\n{(cwd / 'stderr.txt').read_text()}"
                )
        if time.monotonic() > deadline:
            for proc, *_ in pending:
                proc.kill()
            pytest.fail(f"mptrain logged nothing past the steps of {pending}")
        time.sleep(0.01)


@pytest.fixture
def processes():
    """Started subprocesses; any still running when the test ends (failed) is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigterm_and_sigint_to_the_cli_then_resume_is_bit_identical(tmp_path, processes):
    term_cwd, ref_cwd, int_cwd = tmp_path / "term", tmp_path / "ref", tmp_path / "int"
    term = start_mptrain(term_cwd)
    ref = start_mptrain(ref_cwd)
    sigint = start_mptrain(int_cwd)
    processes += [term, ref, sigint]

    signal_when_logged((term, term_cwd, 40, signal.SIGTERM), (sigint, int_cwd, 20, signal.SIGINT))
    assert finish(term, term_cwd) == 143, (term_cwd / "stderr.txt").read_text()
    assert finish(sigint, int_cwd) == 130, (int_cwd / "stderr.txt").read_text()

    run_dir = term_cwd / "run"
    report = read_report(run_dir)
    stopped = report["training"]["steps"]
    assert report["status"] == "interrupted" and report["reason"].startswith(
        f"SIGTERM at step {stopped};"
    )
    assert 40 < stopped < TOTAL_STEPS
    assert latest_target(run_dir) == step_name(stopped)
    assert load_checkpoint(run_dir / "checkpoints" / step_name(stopped))["loop"]["step"] == stopped
    assert "SIGTERM" in (term_cwd / "stderr.txt").read_text()

    int_report = read_report(int_cwd / "run")
    int_step = int_report["training"]["steps"]
    assert int_report["status"] == "interrupted" and int_report["reason"].startswith(
        f"SIGINT at step {int_step};"
    )
    assert 20 < int_step < TOTAL_STEPS
    assert latest_target(int_cwd / "run") == step_name(int_step)
    payload = load_checkpoint(int_cwd / "run" / "checkpoints" / step_name(int_step))
    assert payload["loop"]["step"] == int_step

    resumed = start_mptrain(term_cwd, "resume=auto")
    processes.append(resumed)
    assert finish(resumed, term_cwd) == 0, (term_cwd / "stderr.txt").read_text()
    assert finish(ref, ref_cwd) == 0, (ref_cwd / "stderr.txt").read_text()

    report = read_report(run_dir)
    assert report["status"] == "completed"
    assert Path(report["resumed"]["from"]).name == step_name(stopped)
    assert report["resumed"]["step"] == stopped
    final = step_name(TOTAL_STEPS)
    mine = load_checkpoint(run_dir / "checkpoints" / final)
    theirs = load_checkpoint(ref_cwd / "run" / "checkpoints" / final)
    assert_same_tensors(mine["model"], theirs["model"], "final parameters")
    assert_same_tensors(mine["optimizer"]["state"], theirs["optimizer"]["state"], "optimizer")
    assert mine["loop"]["evals"] == theirs["loop"]["evals"]
    assert eval_rows(run_dir) == eval_rows(ref_cwd / "run")
    assert report["evaluation"] == read_report(ref_cwd / "run")["evaluation"]
    # Every logged step exactly once and identical, except the loss of the first row after the
    # resume: it averages the steps since the stop, not the last log_every steps.
    rows, ref_rows = train_rows(run_dir), train_rows(ref_cwd / "run")
    assert [r[0] for r in rows] == [r[0] for r in ref_rows]
    first_after = next(r[0] for r in rows if r[0] > stopped)
    loss = ROW_FIELDS.index("loss")
    assert [r[:loss] + r[loss + 1 :] for r in rows] == [r[:loss] + r[loss + 1 :] for r in ref_rows]
    assert [r for r in rows if r[0] != first_after] == [r for r in ref_rows if r[0] != first_after]


# ------------------------------------------------------------------------------ 4. kill during save
class SimulatedCrash(Exception):
    pass


def crash_in_save(monkeypatch: pytest.MonkeyPatch, step: int, how: str) -> None:
    """Make the save of ``step_<step>.pt`` die half-way: in the write, or at the rename."""
    if how == "partial_write":
        real_save = torch.save

        def half_save(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and obj.get("loop", {}).get("step") == step:
                buffer = io.BytesIO()
                real_save(obj, buffer, *args, **kwargs)
                f.write(buffer.getvalue()[: buffer.tell() // 2])
                raise SimulatedCrash("killed half-way through the write")
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", half_save)
    else:
        real_replace = os.replace

        def failing_replace(src, dst, *args, **kwargs):
            if Path(dst).name == step_name(step):
                raise SimulatedCrash("killed before the rename")
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", failing_replace)


@pytest.mark.parametrize("how", ["partial_write", "rename"])
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, how):
    overrides = ("precision=fp32", "max_steps=12", "checkpoint.every_steps=4", "log_every=4")
    capture = FinalState(monkeypatch)
    train(tiny_run(*overrides), tmp_path / "ref")
    ref = capture.take()

    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    with monkeypatch.context() as m:
        crash_in_save(m, 8, how)
        with pytest.raises(RunFailed) as err:
            train(tiny_run(*overrides), out)
    assert "SimulatedCrash" in err.value.reason
    assert read_report(out)["status"] == "failed"
    assert read_report(out)["training"]["steps"] == 8
    assert step_files(out) == [step_name(4)], "the half-written checkpoint must not appear"
    assert latest_target(out) == step_name(4)
    assert load_checkpoint(ckpts / step_name(4))["loop"]["step"] == 4
    assert not temporaries(ckpts), "the temporary file of the failed save was left behind"

    # A killed save (no cleanup ran) leaves a temporary behind: the next run start removes it.
    stray = ckpts / f".{step_name(12)}.abc.tmp"
    stray.write_bytes(b"\x00" * 100)
    report = train(tiny_run(*overrides, "resume=auto"), out)
    assert not stray.exists()
    assert report["resumed"]["from"] == str(ckpts / step_name(4))
    assert_same_tensors(ref["model"], capture.take()["model"], "parameters after the resume")


def test_stray_temporaries_are_removed_by_a_new_checkpointer(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    cfg = tiny_run(
        "max_steps=1",
        "checkpoint.every_steps=1",
        "checkpoint.every_epoch=false",
        "checkpoint.keep_best=false",
    )
    run = prepare_run(cfg)
    first = Checkpointer(directory, run, {"sig": 1})
    good = first.save(LoopState(step=3))
    strays = [directory / f".{step_name(5)}.abc.tmp", directory / f".{LATEST}.x1y2.tmp"]
    for stray in strays:
        stray.write_bytes(b"partial")
    before = sha256(good)

    Checkpointer(directory, run, {"sig": 1})
    assert not any(s.exists() for s in strays)
    assert sha256(good) == before and latest_target(tmp_path) == good.name
    assert_same_tensors(load_checkpoint(good)["model"], run.model.state_dict(), "model")
    assert remove_stray_temporaries(directory) == []


# ------------------------------------------------------------------- 5. truncated / corrupt files
def test_truncated_checkpoint_is_named_and_auto_falls_back(tmp_path):
    overrides = (
        "precision=fp32",
        "max_steps=12",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=2",
        "log_every=4",
    )
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    train(tiny_run(*overrides), out)
    assert step_files(out) == [step_name(8), step_name(12)]
    newest = ckpts / step_name(12)
    original = load_checkpoint(newest)
    older_hash = sha256(ckpts / step_name(8))
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])

    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        load_checkpoint(newest)
    assert str(newest) in str(err.value)

    # An explicit file that does not load is an error naming it; nothing is changed.
    with pytest.raises((RunFailed, ConfigError, CheckpointError)) as err:
        train(tiny_run(*overrides, f"resume={newest}"), tmp_path / "other")
    assert str(newest) in str(err.value)
    assert newest.stat().st_size == len(data) // 2 and sha256(ckpts / step_name(8)) == older_hash
    assert not (tmp_path / "other" / "checkpoints").exists()

    # auto skips it, resumes from step 8, records the skip, and re-creates step 12 exactly.
    report = train(tiny_run(*overrides, "resume=auto"), out)
    resumed = report["resumed"]
    assert resumed["from"] == str(ckpts / step_name(8)) and resumed["step"] == 8
    assert len(resumed["notes"]) == 2
    assert resumed["notes"][0].startswith("skipped") and str(newest) in resumed["notes"][0]
    assert resumed["notes"][0].endswith(f"quarantined as {step_name(12)}.corrupt")
    assert resumed["notes"][1] == "metrics.jsonl: 2 row(s) after step 8 removed"
    assert read_report(out)["resumed"]["notes"] == resumed["notes"]
    redone = load_checkpoint(newest)
    assert_same_tensors(redone["model"], original["model"], "re-created step 12")
    assert redone["loop"]["step"] == 12 and latest_target(out) == step_name(12)


def test_unreadable_checkpoints_are_named(tmp_path):
    missing = tmp_path / step_name(1)
    with pytest.raises(CheckpointError, match="no such file") as err:
        load_checkpoint(missing)
    assert str(missing) in str(err.value)
    junk = tmp_path / step_name(2)
    junk.write_bytes(b"not a zip file at all")
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        load_checkpoint(junk)
    assert str(junk) in str(err.value) and "weights_only" not in str(
        err.value
    )  # not torch's advice
    foreign = tmp_path / step_name(3)
    torch.save({"weights": torch.ones(2)}, foreign)
    with pytest.raises(CheckpointError, match="not an mptrain checkpoint") as err:
        load_checkpoint(foreign)
    assert str(foreign) in str(err.value)


def test_candidates_put_latest_first_and_survive_a_bad_pointer(tmp_path):
    for step in (4, 12, 8):
        (tmp_path / step_name(step)).write_bytes(b"x")
    (tmp_path / "best.pt").write_bytes(b"x")
    (tmp_path / f".{step_name(16)}.abc.tmp").write_bytes(b"x")
    newest_first = [tmp_path / step_name(s) for s in (12, 8, 4)]
    assert candidates(tmp_path) == newest_first
    (tmp_path / LATEST).write_text(json.dumps({"checkpoint": step_name(8), "step": 8}))
    assert candidates(tmp_path) == [tmp_path / step_name(s) for s in (8, 12, 4)]
    (tmp_path / LATEST).write_text('{"checkpoint": "step_000')  # torn pointer
    assert candidates(tmp_path) == newest_first
    (tmp_path / LATEST).write_text(json.dumps({"checkpoint": step_name(20), "step": 20}))
    assert candidates(tmp_path) == newest_first  # points to a pruned file


# ------------------------------------------------------------------------------------ 6. full disk
class DiskFullFile:
    """Wraps the checkpoint's file: takes ``room`` bytes, then fails like a full disk (ENOSPC)."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self._room:
            self._f.write(data[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def fill_disk_at(monkeypatch: pytest.MonkeyPatch, step: int, where: str) -> None:
    """ENOSPC while ``step_<step>.pt`` is written: raised out of torch.save itself (as a delayed
    write error at flush would be), or by the file's write() that torch.save calls."""
    real_save = torch.save

    def full_save(obj, f, *args, **kwargs):
        if not (isinstance(obj, dict) and obj.get("loop", {}).get("step") == step):
            return real_save(obj, f, *args, **kwargs)
        if where == "write":
            return real_save(obj, DiskFullFile(f, room=1000), *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[:1000])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_save)


def assert_full_disk_handled(out: Path, err: RunFailed, failed_step: int, previous: int) -> None:
    ckpts = out / "checkpoints"
    # Nothing lost: the previous checkpoint and the pointer are intact, no temporary is left.
    assert latest_target(out) == step_name(previous)
    assert load_checkpoint(ckpts / step_name(previous))["loop"]["step"] == previous
    assert not (ckpts / step_name(failed_step)).exists()
    assert not temporaries(ckpts)
    on_disk = read_report(out)
    assert on_disk["status"] == "failed" and on_disk["reason"] == err.reason
    # A clear reason naming the file.
    assert "no space left" in err.reason and str(ckpts / step_name(failed_step)) in err.reason


FULL_DISK_OVERRIDES = ("precision=fp32", "max_steps=12", "checkpoint.every_steps=4", "log_every=4")


def test_full_disk_during_save_fails_clearly(tmp_path, monkeypatch):
    out = tmp_path / "run"
    fill_disk_at(monkeypatch, 8, "raised")
    with pytest.raises(RunFailed) as err:
        train(tiny_run(*FULL_DISK_OVERRIDES), out)
    assert err.value.status == "failed"
    assert_full_disk_handled(out, err.value, 8, 4)


def test_full_disk_in_the_file_write_fails_clearly(tmp_path, monkeypatch):
    out = tmp_path / "run"
    fill_disk_at(monkeypatch, 8, "write")
    with pytest.raises(RunFailed) as err:
        train(tiny_run(*FULL_DISK_OVERRIDES), out)
    assert_full_disk_handled(out, err.value, 8, 4)


def test_full_disk_on_a_real_tmpfs(tmp_path):
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    probe = tmp_path / "probe"
    train(tiny_run("precision=fp32", "max_steps=4", "checkpoint.every_steps=4"), probe)
    size_kib = (probe / "checkpoints" / step_name(4)).stat().st_size // 1024 + 1
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    ckpts.mkdir(parents=True)
    # Room for 2.5 checkpoints: steps 4 and 8 fit, step 12 (written before pruning) does not.
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib * 5 // 2}k", "tmpfs", str(ckpts)],
        capture_output=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mount.stderr.decode().strip()}")
    try:
        with pytest.raises(RunFailed) as err:
            train(tiny_run(*FULL_DISK_OVERRIDES), out)
        assert_full_disk_handled(out, err.value, 12, 8)
    finally:
        subprocess.run(["umount", str(ckpts)], check=True)


# ------------------------------------------------------------------- 7. settings differ on resume
@pytest.fixture
def bf16_run(tmp_path):
    out = tmp_path / "bf16"
    train(tiny_run("precision=bf16", "max_steps=6", "checkpoint.every_steps=3"), out)
    return out


def assert_refused_cleanly(new_dir: Path, source: Path, hashes: dict[str, str]) -> None:
    """A refused resume leaves the source untouched and writes nothing into the new directory."""
    assert {p.name: sha256(p) for p in (source / "checkpoints").iterdir()} == hashes
    assert not (new_dir / "checkpoints").exists() and not (new_dir / "report.json").exists()


def test_precision_change_is_refused_unless_allowed(tmp_path, bf16_run):
    hashes = {p.name: sha256(p) for p in (bf16_run / "checkpoints").iterdir()}
    new_dir = tmp_path / "fp32"
    with pytest.raises(ConfigError) as err:
        train(tiny_run("precision=fp32", "max_steps=9", f"resume={bf16_run}"), new_dir)
    message = str(err.value)
    assert "precision: checkpoint 'bf16', now 'fp32'" in message
    assert "resume_allow_changes" in message and step_name(6) in message
    assert_refused_cleanly(new_dir, bf16_run, hashes)

    report = train(
        tiny_run(
            "precision=fp32", "max_steps=9", f"resume={bf16_run}", "resume_allow_changes=true"
        ),
        new_dir,
    )
    assert report["status"] == "completed" and report["training"]["steps"] == 9
    assert report["resumed"]["step"] == 6
    allowed = ["precision: checkpoint 'bf16', now 'fp32'", "max_steps: checkpoint 6, now 9"]
    assert report["resumed"]["allowed_differences"] == allowed
    assert read_report(new_dir)["resumed"]["allowed_differences"] == allowed
    # The history of the bf16 part came along.
    assert [e["step"] for e in report["evaluation"]["history"]] == [6, 9]


@pytest.mark.parametrize(
    ("override", "key"),
    [("model.hidden_sizes=[128]", "model.hidden_sizes"), ("batch_size=32", "batch_size")],
)
def test_model_or_data_change_is_refused(tmp_path, bf16_run, override, key):
    hashes = {p.name: sha256(p) for p in (bf16_run / "checkpoints").iterdir()}
    new_dir = tmp_path / "changed"
    with pytest.raises(ConfigError) as err:
        train(tiny_run("precision=bf16", "max_steps=6", override, f"resume={bf16_run}"), new_dir)
    assert f"{key}: checkpoint" in str(err.value) and "resume_allow_changes" in str(err.value)
    assert "precision" not in str(err.value).split("settings (")[1]
    assert_refused_cleanly(new_dir, bf16_run, hashes)


def test_fp16_never_resumes_without_scaler_state(tmp_path):
    source = tmp_path / "fp32"
    train(tiny_run("precision=fp32", "max_steps=3", "checkpoint.every_steps=3"), source)
    hashes = {p.name: sha256(p) for p in (source / "checkpoints").iterdir()}
    assert load_checkpoint(source / "checkpoints" / step_name(3))["scaler"] is None
    new_dir = tmp_path / "fp16"
    cfg = tiny_run("precision=fp16", "max_steps=6", f"resume={source}", "resume_allow_changes=true")
    with pytest.raises(ConfigError, match="no loss-scaler state") as err:
        train(cfg, new_dir)
    assert str(source / "checkpoints" / step_name(3)) in str(err.value)
    assert "checkpoint's precision" in str(err.value)
    assert_refused_cleanly(new_dir, source, hashes)


# ----------------------------------------------------------------------- 8. checkpoint contents
def test_checkpoint_contents_pruning_best_and_report(tmp_path, monkeypatch):
    capture = FinalState(monkeypatch)
    out = tmp_path / "run"
    cfg = tiny_run("precision=fp32", "max_steps=30", "checkpoint.every_steps=5")
    report = train(cfg, out)
    final = capture.take()
    ckpts = out / "checkpoints"

    # keep_last=2 of 5, 10, 15, 20, 22 (epoch end), 25, 30; best.pt beside them.
    assert step_files(out) == [step_name(25), step_name(30)]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        ["best.pt", LATEST, step_name(25), step_name(30)]
    )
    assert latest_target(out) == step_name(30)
    assert report["checkpoints"] == {
        "directory": str(ckpts),
        "kept": [str(ckpts / step_name(25)), str(ckpts / step_name(30))],
        "latest": str(ckpts / step_name(30)),
        "best": str(ckpts / "best.pt"),
    }
    assert read_report(out)["checkpoints"] == report["checkpoints"]

    payload = load_checkpoint(ckpts / step_name(30))
    assert {
        "format_version",
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "loop",
        "rng",
        "signature",
        "config",
    } <= set(payload)
    assert payload.get("world_size", 1) == 1
    assert_same_tensors(payload["model"], final["model"], "model")
    assert_same_tensors(payload["optimizer"]["state"], final["optimizer"]["state"], "optimizer")
    assert payload["optimizer"]["param_groups"] == final["optimizer"]["param_groups"]
    assert payload["scheduler"]["last_epoch"] == 30
    assert payload["scaler"] is None  # fp32: no loss scaling
    loop = payload["loop"]
    assert (loop["step"], loop["epoch"], loop["samples_seen"]) == (30, 1, 30 * 64)
    assert loop["skipped_steps"] == [] and loop["scale"] is None
    assert loop["evals"] == report["evaluation"]["history"]
    assert loop["last_train_loss"] == report["training"]["final_train_loss"]
    rng = payload["rng"]
    assert set(rng) == {"python", "numpy", "torch", "cuda"}
    assert isinstance(rng["python"], tuple) and len(rng["python"]) == 3  # random.getstate()
    assert rng["numpy"][0] == "MT19937" and rng["numpy"][1].shape == (624,)  # a tensor
    assert rng["torch"].dtype == torch.uint8 and rng["cuda"] is None  # CPU-only
    assert payload["signature"]["precision"] == "fp32"
    assert payload["signature"]["model.hidden_sizes"] == [256, 256]
    assert payload["signature"]["batch_size"] == 64
    assert payload["signature"]["optimizer.lr"] == 0.003 and "seed" in payload["signature"]
    assert "log_every" not in payload["signature"] and "fp8.format" not in payload["signature"]
    assert payload["config"] == dataclasses.asdict(cfg)

    # best.pt: the state of the best evaluation (evaluations at 22 and 30 are both saves).
    best = load_checkpoint(ckpts / "best.pt")
    assert best["loop"]["step"] == report["evaluation"]["best_step"]
    assert best["loop"]["evals"][-1]["val_accuracy"] == report["evaluation"]["best_val_accuracy"]
    if best["loop"]["step"] == 30:
        assert_same_tensors(best["model"], final["model"], "best model")


def test_checkpoints_disabled_writes_none(tmp_path):
    out = tmp_path / "run"
    cfg = tiny_run("precision=fp32", "max_steps=6", "checkpoint.enabled=false")
    report = train(cfg, out)
    assert report["status"] == "completed" and report["training"]["steps"] == 6
    assert not (out / "checkpoints").exists() and not list(out.rglob("*.pt"))
    assert report["checkpoints"] is None and read_report(out)["checkpoints"] is None


# ------------------------------------------------------------------------- 9. what resume= accepts
@pytest.fixture(scope="module")
def stopped_source(tmp_path_factory):
    """A 9-step run stopped at step 6 (checkpoints 3 and 6) and the uninterrupted run's result."""
    root = tmp_path_factory.mktemp("source")
    mp = pytest.MonkeyPatch()
    try:
        capture = FinalState(mp)
        train(tiny_run("precision=fp32", "max_steps=9", "checkpoint.every_steps=3"), root / "ref")
        reference = capture.take()
        run_stopped_at(
            mp,
            tiny_run("precision=fp32", "max_steps=9", "checkpoint.every_steps=3"),
            root / "src",
            6,
        )
    finally:
        mp.undo()
    assert step_files(root / "src") == [step_name(3), step_name(6)]
    return root / "src", reference


@pytest.mark.parametrize(
    ("where", "expected"),
    [("file", 3), ("run_dir", 6), ("checkpoints_dir", 6)],
)
def test_resume_accepts_a_file_a_run_dir_and_its_checkpoints_dir(
    tmp_path, monkeypatch, stopped_source, where, expected
):
    source, reference = stopped_source
    path = {
        "file": source / "checkpoints" / step_name(3),
        "run_dir": source,
        "checkpoints_dir": source / "checkpoints",
    }[where]
    capture = FinalState(monkeypatch)
    report = train(
        tiny_run("precision=fp32", "max_steps=9", "checkpoint.every_steps=3", f"resume={path}"),
        tmp_path / "new",
    )
    assert report["resumed"]["from"] == str(source / "checkpoints" / step_name(expected))
    assert report["resumed"]["step"] == expected
    assert report["training"]["steps"] == 9
    assert_same_tensors(reference["model"], capture.take()["model"], "final parameters")
    assert step_files(source) == [step_name(3), step_name(6)]  # the source is not touched


def test_resume_from_a_directory_without_checkpoints_is_refused(tmp_path):
    for empty in (tmp_path / "empty_run", tmp_path / "with_dir"):
        empty.mkdir()
    (tmp_path / "with_dir" / "checkpoints").mkdir()
    (tmp_path / "with_dir" / "checkpoints" / "notes.txt").write_text("keep me")
    for source, named in (
        (tmp_path / "empty_run", tmp_path / "empty_run"),
        (tmp_path / "with_dir", tmp_path / "with_dir" / "checkpoints"),
    ):
        with pytest.raises(ConfigError, match="no checkpoint") as err:
            train(tiny_run("max_steps=2", f"resume={source}"), tmp_path / "new")
        assert str(named) in str(err.value)
    assert (tmp_path / "with_dir" / "checkpoints" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ConfigError, match="no such file") as err:
        train(tiny_run("max_steps=2", f"resume={tmp_path / 'nowhere.pt'}"), tmp_path / "new")
    assert "nowhere.pt" in str(err.value)
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_resume_auto_in_an_empty_run_directory_starts_fresh(tmp_path, monkeypatch):
    capture = FinalState(monkeypatch)
    overrides = ("precision=fp32", "max_steps=5")
    train(tiny_run(*overrides), tmp_path / "plain")
    plain = capture.take()
    report = train(tiny_run(*overrides, "resume=auto"), tmp_path / "auto")
    assert report["resumed"]["requested"] == "auto" and report["resumed"]["from"] is None
    assert "started fresh" in report["resumed"]["note"]
    assert read_report(tmp_path / "auto")["resumed"] == report["resumed"]
    assert report["training"]["steps"] == 5
    assert_same_tensors(plain["model"], capture.take()["model"], "fresh start")


# -------------------------------------------------------------------- 10. unwritable output dir
def test_unwritable_output_directory_is_found_before_training(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")

    def must_not_build(*args, **kwargs):
        raise AssertionError("training was set up for an unwritable output directory")

    monkeypatch.setattr(run_module, "build_run", must_not_build)
    out = blocker / "run"
    with pytest.raises(ConfigError, match="output directory") as err:
        train(tiny_run("max_steps=2"), out)
    assert str(out) in str(err.value)
    assert blocker.read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` unwritable for this process: a user's ``chmod -w``; for root, which ignores
    permissions, a read-only tmpfs mounted over it (a read-only file system, as a full quota or
    a read-only remount of a cluster's scratch gives). Skips where root cannot mount."""
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(directory)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"root cannot mount a read-only tmpfs here: {mount.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="chmod and mount as on Linux")
def test_read_only_output_directory_is_found_before_training(tmp_path):
    out = tmp_path / "ro"
    with read_only(out):
        with pytest.raises(ConfigError, match="not writable") as err:
            train(tiny_run("max_steps=2"), out)
        assert str(out) in str(err.value)
        assert list(out.iterdir()) == []


# ------------------------------------------------------------------------- bugs found (xfail)
def test_keep_last_holds_after_a_resume(tmp_path, monkeypatch):
    overrides = ("precision=fp32", "max_steps=20", "checkpoint.every_steps=3")
    out = tmp_path / "run"
    run_stopped_at(monkeypatch, tiny_run(*overrides), out, 7)
    assert step_files(out) == [step_name(6), step_name(7)]
    report = train(tiny_run(*overrides, "resume=auto"), out)
    assert report["training"]["steps"] == 20
    # Saves at 9, 12, 15, 18 and the final step 20; keep_last=2 leaves the last two.
    assert latest_target(out) == step_name(20)
    assert step_files(out) == [step_name(18), step_name(20)]


def test_best_checkpoint_is_kept_whatever_the_eval_cadence(tmp_path):
    out = tmp_path / "run"
    cfg = tiny_run("precision=fp32", "max_steps=14", "eval_every=5", "checkpoint.every_steps=3")
    report = train(cfg, out)
    assert [e["step"] for e in report["evaluation"]["history"]] == [5, 10, 14]
    assert step_files(out) == [step_name(12), step_name(14)]  # 14: the final state is saved
    assert report["checkpoints"]["best"] == str(out / "checkpoints" / "best.pt")
    best = load_checkpoint(out / "checkpoints" / "best.pt")
    assert best["loop"]["step"] == report["evaluation"]["best_step"]


def test_best_checkpoint_on_a_saved_step_is_a_link_that_outlives_pruning(tmp_path, monkeypatch):
    """Every evaluation falls on a save: best.pt is never serialised separately, is the same file
    as its step checkpoint while that exists, and still loads after keep_last=1 pruned it."""
    writes = []
    real_save = torch.save

    def counting_save(obj, f, *args, **kwargs):
        writes.append(obj["loop"]["step"])
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting_save)
    out = tmp_path / "run"
    cfg = tiny_run(
        "precision=fp32",
        "max_steps=15",
        "eval_every=5",
        "checkpoint.every_steps=5",
        "checkpoint.keep_last=1",
    )
    report = train(cfg, out)
    assert writes == [5, 10, 15]  # one torch.save per step; none for best.pt
    ckpts = out / "checkpoints"
    assert step_files(out) == [step_name(15)]
    best_step = report["evaluation"]["best_step"]
    best = load_checkpoint(ckpts / "best.pt")
    assert best["loop"]["step"] == best_step
    assert best["loop"]["evals"][-1]["val_accuracy"] == report["evaluation"]["best_val_accuracy"]
    if best_step == 15:
        assert (ckpts / "best.pt").samefile(ckpts / step_name(15))
    else:  # its step file was pruned; the link keeps the bytes
        assert (ckpts / "best.pt").stat().st_nlink == 1
    assert not temporaries(ckpts)


def test_atomic_link_replaces_atomically_and_copies_where_links_are_refused(tmp_path, monkeypatch):
    source, target = tmp_path / "step.pt", tmp_path / "best.pt"
    source.write_bytes(b"new state")
    target.write_bytes(b"old state")
    atomic_link(source, target)
    assert target.samefile(source) and target.read_bytes() == b"new state"
    source.unlink()  # pruned: the other name keeps the bytes
    assert target.read_bytes() == b"new state"

    def no_links(src, dst):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    source.write_bytes(b"newer state")
    atomic_link(source, target)
    assert not target.samefile(source) and target.read_bytes() == b"newer state"

    with pytest.raises(FileNotFoundError):
        atomic_link(tmp_path / "missing.pt", target)
    assert target.read_bytes() == b"newer state" and not temporaries(tmp_path)


def test_interrupt_without_checkpoints_does_not_claim_a_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = tiny_run("precision=fp32", "max_steps=12", "checkpoint.enabled=false")
    err = run_stopped_at(monkeypatch, cfg, out, 5)
    assert err.exit_code == 143
    assert read_report(out)["status"] == "interrupted"
    assert read_report(out)["training"]["steps"] == 5
    assert not (out / "checkpoints").exists()
    assert "checkpoint written" not in err.report.to_dict()["reason"]


def test_atomic_save_never_leaves_a_partial_file(tmp_path, monkeypatch):
    """A write interrupted by KeyboardInterrupt: old content stays, no temporary, error re-raised."""
    path = tmp_path / step_name(1)
    atomic_torch_save({"format_version": FORMAT_VERSION, "x": torch.arange(4)}, path)
    before = sha256(path)
    real_save = torch.save

    def interrupted_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"format_version": FORMAT_VERSION, "x": torch.zeros(4)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert sha256(path) == before and not temporaries(tmp_path)
    assert torch.equal(load_checkpoint(path)["x"], torch.arange(4))


def test_interrupt_while_the_report_is_written_still_leaves_a_report(tmp_path, monkeypatch):
    def interrupted_plot(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module.FigureWorker, "plot_run", interrupted_plot)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run("precision=fp32", "max_steps=6", "checkpoint.every_steps=3"), out)
    assert load_checkpoint(out / "checkpoints" / step_name(6))["loop"]["step"] == 6
    assert read_report(out)["status"] in ("interrupted", "completed")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_checkpoint_from_before_the_added_settings_resumes(tmp_path, precision):
    """A checkpoint whose signature lacks settings added later (task, fp8.pow2_scales,
    fp8.min_features) resumes when the run keeps their older behaviour, and is refused when it
    changes it."""
    run_dir = tmp_path / "run"
    common = (f"precision={precision}", "max_steps=6", "checkpoint.every_steps=3")
    train(tiny_run(*common), run_dir)
    path = run_dir / "checkpoints" / step_name(3)
    payload = torch.load(path, weights_only=False)
    for key in ADDED_SETTINGS:
        payload["signature"].pop(key, None)  # as an older mptrain wrote it
    payload["signature"]["advise.budget_s"] = 90.0  # signed before advise.* was non-training
    atomic_torch_save(payload, path)
    report = train(tiny_run(*common, f"resume={path}"), tmp_path / "resumed")
    assert report["resumed"]["step"] == 3 and report["resumed"]["allowed_differences"] == []
    if precision == "fp8":
        with pytest.raises(ConfigError, match=r"fp8\.pow2_scales: checkpoint False, now True"):
            train(
                tiny_run(*common, f"resume={path}", "fp8.pow2_scales=true"),
                tmp_path / "changed",
            )
