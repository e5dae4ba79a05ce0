"""Time-based cadences (``eval_every_minutes``, ``checkpoint.every_minutes``) and where a job's
time went (the report's ``time`` section)."""

from __future__ import annotations

import pytest
from support.runs import tiny_run, train

import mptrain.pace.clocks
from mptrain.checkpoint.checkpointer import Checkpointer
from mptrain.pace.clocks import TimeCadence
from mptrain.platform.distributed import DistContext
from mptrain.train.build import prepare_run
from mptrain.train.loop import LoopHooks, train_loop
from mptrain.train.state import LoopState

CPU = mptrain.pace.clocks.torch.device("cpu")


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(mptrain.pace.clocks, "now", fake)
    return fake


def test_time_cadence_is_due_after_its_minutes_and_restarts(clock):
    cadence = TimeCadence(1.5)
    single = DistContext()
    clock.t += 89
    assert not cadence.due(1, 50, single, CPU)
    clock.t += 1
    assert cadence.due(2, 50, single, CPU)
    cadence.restart()
    assert not cadence.due(3, 50, single, CPU)
    assert not TimeCadence(None).due(4, 50, single, CPU)


class Ticker:
    """An observer that lets 40 s pass on the fake clock with every step."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def on_step(self, state: LoopState) -> None:
        self.clock.t += 40

    def on_log(self, row: dict) -> None:
        pass

    def on_eval(self, row: dict) -> None:
        pass

    def on_warning(self, message: str) -> None:
        pass


def test_evaluations_and_checkpoints_by_the_clock(tmp_path, clock):
    """90 s cadences at 40 s per step: due after steps 3, 6 and 9; the last step is always
    evaluated. Epoch ends (every 22 steps) play no part once a time cadence is set."""
    cfg = tiny_run(
        "max_steps=25",
        "eval_every_minutes=1.5",
        "checkpoint.every_minutes=1.5",
        "checkpoint.every_epoch=false",
        "checkpoint.keep_last=20",
    )
    run = prepare_run(cfg)
    checkpointer = Checkpointer(tmp_path, run, signature={})
    hooks = LoopHooks(observers=(Ticker(clock),), checkpoint=checkpointer.after_step)
    state = train_loop(run, hooks)
    every_third = [3, 6, 9, 12, 15, 18, 21, 24]
    assert [e["step"] for e in state.evals] == [*every_third, 25]
    assert sorted(checkpointer.steps) == every_third
    assert run.monitor.time.evaluations == 9 and run.monitor.time.checkpoints == 8


def test_eval_every_steps_and_minutes_together(tmp_path, clock):
    cfg = tiny_run("max_steps=10", "eval_every=4", "eval_every_minutes=2")  # 120 s: 3 steps
    run = prepare_run(cfg)
    state = train_loop(run, LoopHooks(observers=(Ticker(clock),)))
    # 3 (time), 4 (steps; the clock restarts), 7 (time), 8 (steps), 10 (last)
    assert [e["step"] for e in state.evals] == [3, 4, 7, 8, 10]


def test_default_job_checkpoints_by_time_not_by_epoch(tmp_path):
    """Defaults: every 10 minutes, not every epoch; the final state is always saved."""
    report = train(tiny_run("epochs=3"), tmp_path)
    last = report["training"]["steps"]
    assert [p.rsplit("/", 1)[-1] for p in report["checkpoints"]["kept"]] == [f"step_{last:08d}.pt"]
    time = report["time"]
    assert time["evaluations"] == 3  # at every epoch end
    assert time["checkpoints"] >= 1  # the final save, and best.pt when an evaluation improved
    assert time["training_s"] > 0 and time["other_s"] >= 0
    assert "| time | training " in (tmp_path / "report.md").read_text()
