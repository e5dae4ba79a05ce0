"""Signals during training (issue 27, items 4 and 7): a second stop signal stops at once, and the
checkpoint signal (SIGUSR1, SLURM's pre-emption warning) saves and goes on, or stops when told.
Each test raises the signals from inside a step, where a user's or a scheduler's would land."""

from __future__ import annotations

import json
import signal

import pytest
from support.processes import signals_on_call
from support.runs import tiny_run, train

from mptrain.config.base import ConfigError
from mptrain.rundir.layout import CHECKPOINT_DIR, REPORT_JSON
from mptrain.train import job as job_module
from mptrain.train import loop as loop_module

QUICK = ("epochs=null", "max_steps=6", "log_every=1", "checkpoint.every_minutes=null")


@pytest.fixture(autouse=True)
def handlers_put_back():
    """Every signal handler as it was after each test: a signal mptrain left unhandled must fail
    the test, never end pytest (SIGUSR1's default would)."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    previous = {sig: signal.getsignal(sig) for sig in sigs}
    signal.signal(signal.SIGUSR1, _unhandled)
    signal.signal(signal.SIGUSR2, _unhandled)
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class Unhandled(Exception):
    pass


def _unhandled(signum, frame):
    raise Unhandled(f"{signal.Signals(signum).name} reached a handler mptrain did not install")


def signals_in(monkeypatch, name: str, at_call: int, *sigs: int) -> None:
    """Raise ``sigs`` inside the loop's ``name`` (a function of mptrain.train.loop) on its
    ``at_call``-th call (1-based), then let it run."""
    signals_on_call(monkeypatch, loop_module, name, at_call, *sigs)


def checkpoint_steps(directory) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (directory / CHECKPOINT_DIR).glob("step_*.pt"))


def test_a_second_ctrl_c_during_a_step_stops_at_once_with_the_last_completed_step(
    tmp_path, monkeypatch, capsys
):
    """Item 7: two Ctrl-Cs used to be ignored until the step ended (19.5 minutes of FP16
    ResNet-50 on a CPU); only kill -9 ended it, and nothing was saved."""
    signals_in(monkeypatch, "_forward", 3, signal.SIGINT, signal.SIGINT)
    with pytest.raises(job_module.RunInterrupted) as stopped:
        train(tiny_run(*QUICK), tmp_path)
    assert stopped.value.exit_code == 130
    report = json.loads((tmp_path / REPORT_JSON).read_text())
    assert report["status"] == "interrupted" and report["training"]["steps"] == 2
    assert report["reason"].startswith("SIGINT twice: stopped at once, step 3 abandoned")
    assert "checkpoint written" in report["reason"]
    assert checkpoint_steps(tmp_path) == [2]
    out = capsys.readouterr().out
    assert "SIGINT: stopping after this step (Ctrl-C again to stop now)" in out
    assert "SIGINT twice: stopping now" in out


def test_a_different_second_signal_is_named_as_it_came(tmp_path, monkeypatch, capsys):
    """Ctrl-C then SIGTERM (a scheduler's kill after a user's Ctrl-C) was reported as "SIGINT
    twice"; the first signal still decides the exit code."""
    signals_in(monkeypatch, "_forward", 3, signal.SIGINT, signal.SIGTERM)
    with pytest.raises(job_module.RunInterrupted) as stopped:
        train(tiny_run(*QUICK), tmp_path)
    assert stopped.value.exit_code == 130
    report = json.loads((tmp_path / REPORT_JSON).read_text())
    assert report["reason"].startswith("SIGINT then SIGTERM: stopped at once, step 3 abandoned")
    assert "SIGINT then SIGTERM: stopping now" in capsys.readouterr().out


def test_a_second_signal_during_the_update_lets_the_update_finish(tmp_path, monkeypatch):
    """Outside forward and backward the weights are being changed: the step completes first."""
    signals_in(monkeypatch, "_optimizer_step", 3, signal.SIGTERM, signal.SIGTERM)
    with pytest.raises(job_module.RunInterrupted) as stopped:
        train(tiny_run(*QUICK), tmp_path)
    assert stopped.value.exit_code == 143
    report = json.loads((tmp_path / REPORT_JSON).read_text())
    assert report["reason"].startswith("SIGTERM at step 3;")
    assert checkpoint_steps(tmp_path) == [3]


def test_the_checkpoint_signal_saves_and_training_goes_on(tmp_path, monkeypatch, capsys):
    """Item 4: SIGUSR1 (SLURM's --signal=USR1@T) took Python's default action: the process died
    with no checkpoint and no report."""
    signals_in(monkeypatch, "_forward", 2, signal.SIGUSR1)
    report = train(tiny_run(*QUICK, "checkpoint.keep_last=5"), tmp_path)
    assert report["status"] == "completed" and report["training"]["steps"] == 6
    assert checkpoint_steps(tmp_path) == [2, 6]
    assert "SIGUSR1: a checkpoint after this step; training goes on" in capsys.readouterr().out


def test_the_checkpoint_signal_can_stop_the_run_instead(tmp_path, monkeypatch):
    signals_in(monkeypatch, "_forward", 2, signal.SIGUSR1)
    with pytest.raises(job_module.RunInterrupted) as stopped:
        train(tiny_run(*QUICK, "checkpoint.on_signal=stop"), tmp_path)
    assert stopped.value.exit_code == 128 + signal.SIGUSR1
    report = json.loads((tmp_path / REPORT_JSON).read_text())
    assert report["reason"] == "SIGUSR1 at step 2; checkpoint written, resume with resume=auto"
    assert checkpoint_steps(tmp_path) == [2]


def test_the_checkpoint_signal_is_configurable(tmp_path, monkeypatch, capsys):
    """checkpoint.signal=SIGUSR2 (a scheduler told --signal=USR2@T): SIGUSR2 saves and goes on."""
    signals_in(monkeypatch, "_forward", 2, signal.SIGUSR2)
    report = train(
        tiny_run(*QUICK, "checkpoint.signal=SIGUSR2", "checkpoint.keep_last=5"), tmp_path
    )
    assert report["status"] == "completed" and report["training"]["steps"] == 6
    assert checkpoint_steps(tmp_path) == [2, 6]
    assert "SIGUSR2: a checkpoint after this step; training goes on" in capsys.readouterr().out


def test_another_checkpoint_signal_leaves_sigusr1_alone(tmp_path, monkeypatch):
    signals_in(monkeypatch, "_forward", 2, signal.SIGUSR1)  # no longer mptrain's
    with pytest.raises(job_module.RunFailed, match="SIGUSR1 reached a handler mptrain did not"):
        train(tiny_run(*QUICK, "checkpoint.signal=SIGUSR2"), tmp_path)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("checkpoint.signal=SIGTERM", "checkpoint.signal='SIGTERM': null or one of SIGUSR1"),
        ("checkpoint.on_signal=later", "checkpoint.on_signal='later': save (checkpoint and go on)"),
    ],
)
def test_checkpoint_signal_settings_are_checked(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        tiny_run(override)
