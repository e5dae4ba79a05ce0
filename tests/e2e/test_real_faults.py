"""The fault behaviours docs/checkpoints.md promises, done for real: real processes, real signals,
a real SIGKILL (issue text: "a real kill -9 mid-run and mid-checkpoint, not an exception standing
in for it").

- kill -9 mid-run, then the same command with ``resume=auto``: bit for bit the uninterrupted
  run, every step logged once; the run lock of the killed holder is taken over, and while the
  run lived a second run was refused naming it;
- kill -9 in the middle of a checkpoint write (half the bytes in the temporary file): the resume
  starts from the previous complete checkpoint, leaves no temporary file, finishes bit for bit;
- a second stop signal during an evaluation stops at once; during a checkpoint write the
  checkpoint is finished first and is complete;
- ``checkpoint.signal=SIGUSR2`` saves and training goes on; SIGUSR1 and SIGUSR2 outside training
  are ignored (their default action would end the process);
- SIGTERM to torchrun stops both ranks with rank 0's report and a checkpoint; ``resume=auto``
  under torchrun completes the run.

Two tests are strict xfails, each naming a bug it found: the command line never says it took
over a killed holder's lock, and an evaluation stopped by a second signal is reported as a step
whose forward had run.

What tests/train/test_checkpoint.py and tests/e2e/test_reliability.py already cover (an exception
standing in for a kill during a save, a stale lock file written by hand, SIGTERM/SIGINT to the
CLI then a bit-identical resume) is not repeated. Runs are tiny and pinned (model=mlp, fp32,
threads=1: bit-for-bit comparisons need a pinned thread count); the hidden layers are widened to
~10 ms per step so a process polled from here is still training when the signal lands.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.processes import describe, run_command, signals_on_call
from support.runs import compose_run, tiny_run, train

from mptrain.checkpoint.file import load_checkpoint
from mptrain.config.base import ConfigError
from mptrain.rundir.layout import (
    CHECKPOINT_DIR,
    LATEST,
    LOCK_NAME,
    METRICS_JSONL,
    REPORT_JSON,
    step_checkpoint_name,
)
from mptrain.train import loop as loop_module
from mptrain.train.job import RunInterrupted

pytestmark = pytest.mark.slow

TIMEOUT_S = 150  # any one wait: a run, a step to be logged (a hang fails, never holds the suite)

# The command killed and resumed (tests 1 and 2), in the arguments both `mptrain` and
# tests/conftest.py's compose_run take. ~10 ms per step, 250 steps, a checkpoint every 100.
PINNED = (
    "model=mlp",
    "model.hidden_sizes=[1024,1024]",
    "precision=fp32",
    "device=cpu",
    "threads=1",
    "progress=false",
    "epochs=null",
    "log_every=1",
)
TOTAL = 250
EVERY = 100
COMMAND = (*PINNED, f"max_steps={TOTAL}", f"checkpoint.every_steps={EVERY}")

# Run by `python -c` with mptrain's arguments: the CLI, with torch.save replaced so that the
# KILL_ON-th step checkpoint gets half of its bytes into the temporary file, then a real SIGKILL.
KILLED_MID_SAVE = """
import io, os, signal, sys
import torch
from mptrain.cli import app as cli

KILL_ON = int(os.environ["KILL_ON_STEP_SAVE"])
real_save, step_saves = torch.save, []

def save_then_die(obj, f, *args, **kwargs):
    if "step_" in os.path.basename(os.readlink(f"/proc/self/fd/{f.fileno()}")):  # not best.pt
        step_saves.append(obj["loop"]["step"])
        if len(step_saves) == KILL_ON:
            whole = io.BytesIO()
            real_save(obj, whole, *args, **kwargs)
            f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)

torch.save = save_then_die
sys.argv[0] = "mptrain"
cli.main()
"""

# Run by `python -c`: the CLI, with SIGUSR1 and SIGUSR2 raised (for real, to this process) where
# no training runs: before the run directory is taken (cli.launch), while the run is built
# (job.build_run) and after training, while the report is written (job.write_report). Each
# place says so on stderr once the signals were survived.
USR_SIGNALS_OUTSIDE_TRAINING = """
import signal, sys
from mptrain.cli import app as cli
from mptrain.train import job

def signalled(where, real):
    def call(*args, **kwargs):
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR2)
        print(f"survived SIGUSR1 and SIGUSR2 in {where}", file=sys.stderr, flush=True)
        return real(*args, **kwargs)
    return call

cli.launch = signalled("launch", cli.launch)
job.build_run = signalled("build_run", job.build_run)
job.write_report = signalled("write_report", job.write_report)
sys.argv[0] = "mptrain"
cli.main()
"""


# --------------------------------------------------------------------------------- helpers
@dataclass
class Started:
    """A process started by a test, its output going to files in its own folder."""

    popen: subprocess.Popen
    folder: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> tuple[str, str]:
        return (self.folder / "stdout.txt").read_text(), (self.folder / "stderr.txt").read_text()

    def describe(self) -> str:
        out, err = self.output()
        return f"exit {self.popen.poll()}\nstdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}"

    def finish(self, timeout: float = TIMEOUT_S) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout} s (a hang):\n{self.describe()}")


def environment() -> dict[str, str]:
    """This process's environment without Hydra's tracebacks or a terminal size."""
    drop = ("HYDRA_FULL_ERROR", "COLUMNS", "LINES")
    return {k: v for k, v in os.environ.items() if k not in drop}


def start(folder: Path, *command: str, env: dict[str, str] | None = None) -> Started:
    """Start ``command`` in ``folder`` (its own session: a group to kill whole if left over)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "stdout.txt").open("w") as out, (folder / "stderr.txt").open("w") as err:
        popen = subprocess.Popen(
            list(command),
            cwd=folder,
            env=environment() | (env or {}),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    return Started(popen, folder)


def stop_leftover(started: Started) -> None:
    """SIGKILL what is left of a process this module started (its group: torchrun's ranks too)."""
    if started.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.killpg(started.pid, signal.SIGKILL)
        started.popen.wait(timeout=30)


@pytest.fixture
def processes():
    """Processes started by the test; whatever is still running at its end is killed."""
    started: list[Started] = []
    yield started
    for each in started:
        stop_leftover(each)


class Unhandled(Exception):
    pass


def _unhandled(signum, frame):
    raise Unhandled(f"{signal.Signals(signum).name} reached a handler mptrain did not install")


@pytest.fixture(autouse=True)
def handlers_put_back():
    """Every signal handler as it was after each test (the in-process runs install mptrain's).
    Meanwhile a SIGTERM, SIGHUP, SIGUSR1 or SIGUSR2 that mptrain leaves unhandled fails the test
    instead of ending pytest (their default action)."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    previous = {sig: signal.getsignal(sig) for sig in sigs}
    for sig in sigs[1:]:
        signal.signal(sig, _unhandled)
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def mptrain(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "mptrain", *args)


def rows(run_dir: Path, kind: str) -> list[dict]:
    """metrics.jsonl's rows of ``kind`` (a row cut short by a kill is left out)."""
    path = run_dir / METRICS_JSONL
    found = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == kind:
            found.append(row)
    return found


def logged_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in rows(run_dir, "train")]


def last_logged(run_dir: Path) -> int:
    return max(logged_steps(run_dir), default=0)


def latest_step(run_dir: Path) -> int | None:
    """The step latest.json points to (None before the first checkpoint)."""
    path = run_dir / CHECKPOINT_DIR / LATEST
    return json.loads(path.read_text())["step"] if path.is_file() else None


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.stem[5:]) for p in (run_dir / CHECKPOINT_DIR).glob("step_*.pt"))


def temporaries(run_dir: Path) -> list[Path]:
    return sorted((run_dir / CHECKPOINT_DIR).glob(".*.tmp"))


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / REPORT_JSON).read_text())


def wait_until(started: Started, ready: Callable[[], bool], what: str) -> None:
    """Poll ``ready`` (every 5 ms) until it holds; fail if the process ended first or the
    deadline passed."""
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        if started.popen.poll() is not None:
            pytest.fail(f"ended before {what}:\n{started.describe()}")
        if time.monotonic() > deadline:
            pytest.fail(f"not {what} within {TIMEOUT_S} s:\n{started.describe()}")
        time.sleep(0.005)


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "samples_per_s"}


def assert_finished_like(run_dir: Path, reference: Path) -> None:
    """The resumed run ended bit for bit where the uninterrupted one did: the report's final
    losses, every weight and optimizer moment, every metrics row (each step once)."""
    mine, theirs = report(run_dir), report(reference)
    assert mine["status"] == theirs["status"] == "completed"
    for section, key in (("training", "final_train_loss"), ("evaluation", "final_val_loss")):
        assert mine[section][key] == theirs[section][key], f"{key} differs from the reference"
    final = step_checkpoint_name(TOTAL)
    a = load_checkpoint(run_dir / CHECKPOINT_DIR / final)
    b = load_checkpoint(reference / CHECKPOINT_DIR / final)
    for name in b["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"weight {name} differs"
    for index, state in b["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(a["optimizer"]["state"][index][name], value), f"{index}.{name}"
    assert logged_steps(run_dir) == list(range(1, TOTAL + 1)), "a step logged twice or never"
    assert [without_timing(r) for r in rows(run_dir, "train")] == [
        without_timing(r) for r in rows(reference, "train")
    ]
    assert rows(run_dir, "eval") == rows(reference, "eval")


@dataclass
class Reference:
    """The uninterrupted run of :data:`COMMAND`, started once for the module and run beside the
    tests that compare with it (two cores: it costs them little)."""

    started: Started
    run_dir: Path

    def finished(self) -> Path:
        code = self.started.finish()
        assert code == 0, self.started.describe()
        return self.run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[Reference]:
    folder = tmp_path_factory.mktemp("reference")
    run_dir = folder / "run"
    started = start(folder, *mptrain(*COMMAND, f"hydra.run.dir={run_dir}"))
    yield Reference(started, run_dir)
    stop_leftover(started)


# ------------------------------------------------------------------ 1. kill -9 mid-run + lock
def test_kill_9_mid_run_then_resume_auto_is_bit_identical_and_takes_over_the_lock(
    tmp_path, processes, reference
):
    """A real SIGKILL after a checkpoint, between two: ``resume=auto`` with the same command
    continues from that checkpoint and ends bit for bit as the uninterrupted run, each step
    logged once. The lock: while the run lived, a second run in its directory was refused
    naming its pid; after the kill the lock file still names it, and the resume takes it over
    (the kernel freed the flock) instead of refusing the directory as in use."""
    run_dir = tmp_path / "run"
    second = compose_run(*COMMAND, "resume=auto")  # composed before: the refusal is instant
    victim = start(tmp_path, *mptrain(*COMMAND, f"hydra.run.dir={run_dir}"))
    processes.append(victim)

    wait_until(victim, lambda: last_logged(run_dir) >= 1, "training")
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {victim.pid} on "):
        train(second, run_dir)

    def past_a_checkpoint() -> bool:
        saved = latest_step(run_dir)
        return saved is not None and last_logged(run_dir) >= saved + 5

    wait_until(victim, past_a_checkpoint, "past its first checkpoint")
    os.kill(victim.pid, signal.SIGKILL)
    assert victim.finish() == -signal.SIGKILL, "the run ended before the kill came"
    saved, killed_at = latest_step(run_dir), last_logged(run_dir)
    assert saved is not None and saved < killed_at < TOTAL, (saved, killed_at)
    assert not (run_dir / REPORT_JSON).exists()
    holder = json.loads((run_dir / LOCK_NAME).read_text())
    assert holder["pid"] == victim.pid, "the lock file should still name the killed holder"

    resumed = run_command(tmp_path, *mptrain(*COMMAND, f"hydra.run.dir={run_dir}", "resume=auto"))
    assert resumed.returncode == 0, describe(resumed)  # not refused as "in use"
    assert not (run_dir / LOCK_NAME).exists(), "the resumed run left its lock behind"
    resume = report(run_dir)["resumed"]
    assert resume["step"] == saved and Path(resume["from"]).name == step_checkpoint_name(saved)
    assert any(f"row(s) after step {saved} removed" in n for n in resume["notes"]), resume
    assert_finished_like(run_dir, reference.finished())


HOLDS_THE_LOCK = """
import sys, time
from pathlib import Path
from mptrain.rundir.lock import RunDirLock

with RunDirLock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_the_next_command_says_it_took_over_the_lock_of_a_killed_holder(tmp_path, processes):
    """The lock's holder really killed (kill -9, the file still names it): the next
    ``mptrain`` in the directory runs and says whose lock it took over."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = start(tmp_path / "holder", sys.executable, "-c", HOLDS_THE_LOCK, str(run_dir))
    processes.append(holder)
    wait_until(holder, lambda: "holding" in holder.output()[0], "holding the lock")
    os.kill(holder.pid, signal.SIGKILL)
    assert holder.finish() == -signal.SIGKILL
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == holder.pid

    result = run_command(tmp_path, *mptrain(*PINNED, "max_steps=2", f"hydra.run.dir={run_dir}"))
    assert result.returncode == 0, describe(result)
    assert f"took over the lock of a run that is gone (pid {holder.pid} on " in result.stdout


# ------------------------------------------------------------------ 2. kill -9 mid-checkpoint
def test_kill_9_in_the_middle_of_a_checkpoint_write_resumes_from_the_previous_one(
    tmp_path, processes, reference
):
    """A real SIGKILL with half of the second checkpoint's bytes in its temporary file: the
    previous checkpoint and latest.json are untouched, ``resume=auto`` continues from them,
    removes the temporary file and ends bit for bit as the uninterrupted run."""
    run_dir = tmp_path / "run"
    victim = start(
        tmp_path,
        sys.executable, "-c", KILLED_MID_SAVE, *COMMAND, f"hydra.run.dir={run_dir}",
        env={"KILL_ON_STEP_SAVE": "2"},
    )  # fmt: skip
    processes.append(victim)
    assert victim.finish() == -signal.SIGKILL, victim.describe()
    partial = temporaries(run_dir)
    assert [p.name.startswith(f".{step_checkpoint_name(2 * EVERY)}.") for p in partial] == [True], (
        f"the killed write should have left one temporary file, found {partial}"
    )
    assert partial[0].stat().st_size > 0, "the kill should have come with bytes written"
    assert checkpoint_steps(run_dir) == [EVERY], "a partly written checkpoint under its name"
    assert latest_step(run_dir) == EVERY
    assert load_checkpoint(run_dir / CHECKPOINT_DIR / step_checkpoint_name(EVERY))

    resumed = run_command(tmp_path, *mptrain(*COMMAND, f"hydra.run.dir={run_dir}", "resume=auto"))
    assert resumed.returncode == 0, describe(resumed)
    assert temporaries(run_dir) == [], "the killed write's temporary file was left behind"
    resume = report(run_dir)["resumed"]
    assert resume["step"] == EVERY and Path(resume["from"]).name == step_checkpoint_name(EVERY)
    assert_finished_like(run_dir, reference.finished())


# ---------------------------------------------------------- 3. a second signal, in-process
def interrupted(cfg, run_dir: Path) -> RunInterrupted:
    """Train in-process; the RunInterrupted a stop ends the run with. Anything else fails the
    test: a StopNow or Terminated escaping the run is a KeyboardInterrupt, which would end
    pytest's whole session instead."""
    try:
        train(cfg, run_dir)
    except RunInterrupted as exc:
        return exc
    except KeyboardInterrupt as exc:
        pytest.fail(f"{type(exc).__name__} escaped the run instead of RunInterrupted")
    pytest.fail("the run completed: it was not interrupted")


SHORT = (
    "epochs=null",
    "max_steps=8",
    "log_every=1",
    "checkpoint.every_minutes=null",
    "checkpoint.keep_last=10",
)


def stopped_in_evaluation(tmp_path, monkeypatch) -> tuple[dict, list[int], RunInterrupted]:
    """SIGTERM in step 4's forward, then SIGTERM again in the second of the four batches of
    step 4's evaluation: the report, the evaluation's batches counted, the exception."""
    cfg = tiny_run(*SHORT, "eval_every=4", "eval_batch_size=100", "checkpoint.every_steps=2")
    signals_on_call(monkeypatch, loop_module, "_forward", 4, signal.SIGTERM)
    batches = signals_on_call(monkeypatch, loop_module, "correct_predictions", 2, signal.SIGTERM)
    stopped = interrupted(cfg, tmp_path)
    return report(tmp_path), batches, stopped


def test_a_second_signal_during_an_evaluation_stops_it_at_once(tmp_path, monkeypatch, capsys):
    """The first SIGTERM (in the forward) lets step 4 finish; the second, in the middle of the
    evaluation after it, stops at once: the evaluation's last two batches never run, no
    evaluation row is written for it, step 4 (the last completed step) is checkpointed, and
    every checkpoint loads."""
    on_disk, batches, stopped = stopped_in_evaluation(tmp_path, monkeypatch)
    assert stopped.exit_code == 143
    assert len(batches) == 2, "the evaluation went on after the second signal"
    assert on_disk["status"] == "interrupted" and on_disk["training"]["steps"] == 4
    assert on_disk["reason"].startswith("SIGTERM twice: stopped at once")
    assert on_disk["reason"].endswith("checkpoint written, resume with resume=auto")
    assert rows(tmp_path, "eval") == []
    assert checkpoint_steps(tmp_path) == [2, 4] and latest_step(tmp_path) == 4
    for step in (2, 4):
        payload = load_checkpoint(tmp_path / CHECKPOINT_DIR / step_checkpoint_name(step))
        assert payload["loop"]["step"] == step
    out = capsys.readouterr().out
    assert "SIGTERM: stopping after this step (SIGTERM again to stop now)" in out
    assert "SIGTERM twice: stopping now" in out


def test_a_stopped_evaluation_is_reported_as_such(tmp_path, monkeypatch):
    """The report says the evaluation was abandoned, not a step whose forward never ran."""
    on_disk, _, _ = stopped_in_evaluation(tmp_path, monkeypatch)
    reason = on_disk["reason"]
    assert "evaluation" in reason, reason
    assert "step 5" not in reason and "forward had run" not in reason, reason


@pytest.mark.parametrize(
    ("first_in", "stopped_at"),
    [("torch.save", 4), ("_forward", 3)],
    ids=["both-during-a-periodic-checkpoint", "second-during-the-final-checkpoint"],
)
def test_a_second_signal_during_a_checkpoint_write_lets_it_finish(
    tmp_path, monkeypatch, capsys, first_in, stopped_at
):
    """A second SIGTERM that lands half-way through writing a checkpoint's bytes: the write
    finishes (the file loads, holds the step, is as long as torch.save makes it), no temporary
    file is left, and the run stops after that step, reported as a stop at that step.
    Periodic: both signals in the save of step 4 (every 2 steps). Final: the first in step 3's
    forward, the second in the save of step 3 made because the run stops."""
    cfg = tiny_run(*SHORT, "checkpoint.every_steps=2")
    if first_in == "_forward":
        signals_on_call(monkeypatch, loop_module, first_in, 3, signal.SIGTERM)
    real_save, sizes = torch.save, {}

    def save_under_fire(obj, f, *args, **kwargs):
        whole = io.BytesIO()
        real_save(obj, whole, *args, **kwargs)
        data, step = whole.getvalue(), obj["loop"]["step"]
        sizes[step] = len(data)
        f.write(data[: len(data) // 2])
        if step == stopped_at:
            if first_in == "torch.save":
                signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
        f.write(data[len(data) // 2 :])

    monkeypatch.setattr(torch, "save", save_under_fire)
    assert interrupted(cfg, tmp_path).exit_code == 143
    on_disk = report(tmp_path)
    assert on_disk["status"] == "interrupted" and on_disk["training"]["steps"] == stopped_at
    expected = f"SIGTERM at step {stopped_at}; checkpoint written, resume with resume=auto"
    assert on_disk["reason"] == expected
    assert checkpoint_steps(tmp_path) == sorted({2, stopped_at})
    assert latest_step(tmp_path) == stopped_at and temporaries(tmp_path) == []
    path = tmp_path / CHECKPOINT_DIR / step_checkpoint_name(stopped_at)
    assert path.stat().st_size == sizes[stopped_at], "the checkpoint is not complete"
    assert load_checkpoint(path)["loop"]["step"] == stopped_at
    assert "SIGTERM twice: stopping now" in capsys.readouterr().out


# ----------------------------------------------------------------- 4. and 5. SIGUSR1, SIGUSR2
def test_sigusr2_as_the_checkpoint_signal_saves_and_training_goes_on(tmp_path, processes):
    """``checkpoint.signal=SIGUSR2``: a real SIGUSR2 mid-run writes a checkpoint after the step
    under way and the run completes (exit 0). A SIGUSR1 before it (no longer the checkpoint
    signal) is ignored: no checkpoint, no death."""
    run_dir = tmp_path / "run"
    command = (
        *PINNED, "max_steps=300", "checkpoint.signal=SIGUSR2", "checkpoint.every_minutes=null",
        "checkpoint.keep_last=5", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    started = start(tmp_path, *mptrain(*command))
    processes.append(started)
    wait_until(started, lambda: last_logged(run_dir) >= 10, "training")
    os.kill(started.pid, signal.SIGUSR1)
    wait_until(started, lambda: last_logged(run_dir) >= 30, "at step 30")
    sent_after = last_logged(run_dir)
    os.kill(started.pid, signal.SIGUSR2)
    assert started.finish() == 0, started.describe()
    saved = checkpoint_steps(run_dir)
    assert len(saved) == 2 and sent_after <= saved[0] < 300 and saved[1] == 300, saved
    assert (
        load_checkpoint(run_dir / CHECKPOINT_DIR / step_checkpoint_name(saved[0]))["loop"]["step"]
        == saved[0]
    )
    assert report(run_dir)["status"] == "completed"
    out, _ = started.output()
    assert out.count("SIGUSR2: a checkpoint after this step; training goes on") == 1, out
    assert "SIGUSR1" not in out


def test_sigusr1_and_sigusr2_outside_training_are_ignored(tmp_path):
    """SIGUSR1 and SIGUSR2 (SLURM's pre-emption warnings) raised during start-up (before the
    run directory is taken, while the run is built) and after training (while the report is
    written) neither end the process nor change the run: exit 0, a completed report."""
    run_dir = tmp_path / "run"
    result = run_command(
        tmp_path,
        sys.executable, "-c", USR_SIGNALS_OUTSIDE_TRAINING, *PINNED, "max_steps=5",
        f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert result.returncode == 0, describe(result)
    for where in ("launch", "build_run", "write_report"):
        assert f"survived SIGUSR1 and SIGUSR2 in {where}" in result.stderr, describe(result)
    on_disk = report(run_dir)
    assert on_disk["status"] == "completed" and on_disk["training"]["steps"] == 5
    assert checkpoint_steps(run_dir) == [5]


# ------------------------------------------------------------------------------ 6. torchrun
def torchrun(*args: str) -> tuple[str, ...]:
    return (
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "mptrain", *args,
    )  # fmt: skip


def test_sigterm_to_torchrun_stops_both_ranks_with_a_report_and_resume_completes(
    tmp_path, processes
):
    """SIGTERM to the torchrun process once both ranks train: torchrun passes it to its ranks,
    which agree to stop after the same step; rank 0 writes one interrupted report naming
    SIGTERM and a checkpoint of that step; nothing hangs. ``resume=auto`` under torchrun then
    completes the run, each step logged once. (torchrun itself exits 1 with its own
    SignalException traceback: its way of ending on a signal, not mptrain's.)"""
    run_dir = tmp_path / "run"
    total = 300
    command = (
        "model=mlp", "precision=fp32", "device=cpu", "threads=1", "progress=false",
        "epochs=null", "log_every=1", f"max_steps={total}", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    launcher = start(tmp_path / "first", *torchrun(*command))
    processes.append(launcher)
    # Only rank 0 logs, and a DDP step needs both ranks: rows mean both ranks train.
    wait_until(launcher, lambda: last_logged(run_dir) >= 5, "both ranks training")
    os.kill(launcher.pid, signal.SIGTERM)
    assert launcher.finish() != 0, launcher.describe()
    on_disk = report(run_dir)
    stopped = on_disk["training"]["steps"]
    assert on_disk["status"] == "interrupted", launcher.describe()
    # torchrun passes the signal to its ranks one after the other: on a loaded machine the
    # ranks may agree to stop before the second has it, and the reason then names the rank that
    # had it ("SIGTERM on rank 0"). Either way both stop after the same step.
    assert re.fullmatch(
        rf"SIGTERM( on rank [01])? at step {stopped}; checkpoint written, resume with resume=auto",
        on_disk["reason"],
    ), on_disk["reason"]
    assert on_disk["distributed"]["world_size"] == 2 and on_disk["distributed"]["rank"] == 0
    assert 5 <= stopped < total
    assert latest_step(run_dir) == stopped
    payload = load_checkpoint(run_dir / CHECKPOINT_DIR / step_checkpoint_name(stopped))
    assert payload["loop"]["step"] == stopped and payload["world_size"] == 2

    resumed = start(tmp_path / "second", *torchrun(*command, "resume=auto"))
    processes.append(resumed)
    assert resumed.finish() == 0, resumed.describe()
    on_disk = report(run_dir)
    assert on_disk["status"] == "completed" and on_disk["training"]["steps"] == total
    assert on_disk["resumed"]["step"] == stopped
    assert logged_steps(run_dir) == list(range(1, total + 1))
