"""Resuming after Ctrl-C by typing what mptrain said (issue 28): the interrupt message gives the
exact command, and the same command with resume=auto continues the run in its own (dated)
directory, bit for bit, instead of starting over in a new one."""

from __future__ import annotations

import json
import shlex
import signal

import pytest
import torch
from support.runs import run_cli

from mptrain.train import loop as loop_module

COMMAND = ["model=mlp", "device=cpu", "progress=false", "epochs=null", "max_steps=6", "log_every=1"]
COMMAND += ["threads=1"]  # compared bit for bit: no thread-count measuring (threads=auto)


def interrupt_at_step(monkeypatch, step: int) -> None:
    """Ctrl-C in the forward of optimizer step ``step`` (the run stops after it)."""
    real, calls = loop_module._forward, []

    def forward_backward(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_module, "_forward", forward_backward)


def run_dirs(root) -> list:
    return sorted(p for p in (root / "outputs").glob("*/*") if p.is_dir())


def final_weights(run_dir) -> dict:
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    return torch.load(checkpoint, weights_only=True)["model"]


@pytest.mark.slow
def test_the_same_command_with_resume_auto_continues_the_interrupted_run(tmp_path, monkeypatch):
    (tmp_path / "straight").mkdir()
    straight = run_cli(COMMAND, tmp_path / "straight", monkeypatch, jobs=True)
    assert straight.code == 0, straight
    with monkeypatch.context() as patched:
        interrupt_at_step(patched, 3)
        stopped = run_cli(COMMAND, tmp_path, patched, jobs=True)
    assert stopped.code == 130, stopped
    (interrupted,) = run_dirs(tmp_path)
    # The message's command is exact: the run's overrides, resume=auto and its directory.
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith("mptrain: to continue: mptrain ")
    typed = shlex.split(line.removeprefix("mptrain: to continue: "))[1:]
    assert f"hydra.run.dir={interrupted}" in typed and "resume=auto" in typed
    # Typing the same command with resume=auto (no directory) continues it where it is.
    resumed = run_cli([*COMMAND, "resume=auto"], tmp_path, monkeypatch, jobs=True)
    assert resumed.code == 0, resumed
    assert run_dirs(tmp_path) == [interrupted]
    report = json.loads((interrupted / "report.json").read_text())
    assert report["status"] == "completed" and report["resumed"]["step"] == 3
    (reference,) = run_dirs(tmp_path / "straight")
    expected, got = final_weights(reference), final_weights(interrupted)
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bit for bit


def test_resume_auto_without_a_run_to_continue_is_one_line(tmp_path, monkeypatch):
    refused = run_cli([*COMMAND, "resume=auto"], tmp_path, monkeypatch)
    assert refused.code == 2 and not refused.launched
    assert refused.stderr.startswith("mptrain: error: resume=auto: no run of this command to ")
    assert "\n" not in refused.stderr.strip()
