"""The live progress display: throttled per-step updates, the final step always shown, plain
lines off a terminal, and the heartbeat while a step runs long (its ticks given by hand)."""

from __future__ import annotations

import io
import logging
import threading

import pytest
from rich.console import Console

from mptrain.pace.estimate import SlowPath
from mptrain.pace.progress import ProgressDisplay, Ticker
from mptrain.train.state import LoopState


def _terminal() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=120)


def test_updates_are_throttled_and_the_last_step_is_shown(monkeypatch):
    display = ProgressDisplay(1000, "fp32 mlp", _terminal(), enabled=True)
    refreshes = []
    original = display._refresh
    monkeypatch.setattr(display, "_refresh", lambda s: (refreshes.append(s.step), original(s)))
    state = LoopState()
    with display:
        for step in range(1, 1001):  # far faster than REFRESH_PER_S
            state.step = step
            display.on_step(state)
        during = list(refreshes)
    assert 1 <= len(during) < 50, during
    assert refreshes[-1] == 1000  # refreshed on exit with the final state
    task = display._progress.tasks[0]
    assert task.completed == 1000


def test_disabled_display_does_nothing():
    display = ProgressDisplay(10, "fp32 mlp", _terminal(), enabled=False)
    with display:
        display.on_step(LoopState(step=3))
        display.on_log(ROW)
    assert display._progress.tasks[0].completed == 0


ROW = {
    "kind": "train",
    "step": 20,
    "epoch": 1,
    "loss": 0.123456,
    "lr": 0.001,
    "loss_scale": 32768.0,
    "skipped_total": 2,
    "samples_per_s": 1234.4,
}


def test_without_a_terminal_each_row_and_evaluation_prints_one_plain_line():
    out = io.StringIO()
    plain = Console(file=out, width=100_000, soft_wrap=True)
    display = ProgressDisplay(100, "fp16 mlp", plain, enabled=True)
    with display:
        display.on_log(ROW)
        display.on_eval({"step": 25, "epoch": 1, "val_loss": 0.5, "val_accuracy": 0.9123})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(
        "train step=20/100 epoch=1 loss=0.1235 lr=0.001 loss_scale=32768 skipped=2 "
        "samples/s=1234 eta="
    )
    assert lines[1] == "eval step=25/100 epoch=1 val_loss=0.5000 val_accuracy=91.23%"
    assert "\x1b" not in out.getvalue()


def test_no_line_when_progress_is_off_or_the_bar_shows_but_the_log_records_it(caplog):
    caplog.set_level(logging.INFO, logger="mptrain")
    for console, enabled in ((_terminal(), True), (Console(file=io.StringIO()), False)):
        caplog.clear()
        display = ProgressDisplay(100, "fp16 mlp", console, enabled=enabled)
        with display:
            display.on_log(ROW)
        assert "train step=" not in console.file.getvalue()
        assert [r.getMessage()[:20] for r in caplog.records] == ["train step=20/100 ep"]


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Ticks:
    """The heartbeat's ticker without a thread (``ticker=``): the test calls :meth:`tick`."""

    def __init__(self) -> None:
        self.every_s: float | None = None
        self.tick = lambda: None
        self.running = False

    def __call__(self, every_s: float, tick) -> Ticks:
        self.every_s, self.tick = every_s, tick
        return self

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False


def _plain() -> Console:
    return Console(file=io.StringIO(), width=100_000, soft_wrap=True)


def test_off_a_terminal_a_line_after_the_first_step_then_at_least_every_30_s():
    clock, console = FakeClock(), _plain()
    display = ProgressDisplay(
        1000, "fp16 resnet50", console, enabled=True, clock=clock, ticker=Ticks()
    )
    state = LoopState()
    with display:
        for step, seconds in enumerate([41.0, 12.0, 12.0, 12.0, 12.0, 12.0], start=1):
            clock.t += seconds
            state.step = step
            display.on_step(state)
    lines = console.file.getvalue().splitlines()
    assert lines[0] == (
        "train step=1/1000 epoch=0 elapsed=0:00:41 s/step=41 eta=11:22:39 "
        "(first step, one-off costs included)"
    )
    # Step 4: steps 2-4 took 36 s, enough for the estimate (not waiting for step 5), and 36 s
    # have passed since the last line; step 6 comes 24 s after that one: no line.
    assert lines[1] == "about 3 h 20 min for 1,000 steps at 12 s/step (measured over steps 2-4)"
    assert lines[2] == "train step=4/1000 epoch=0 elapsed=0:01:17 s/step=12 eta=3:19:12"
    assert len(lines) == 3
    assert display.estimate.total_s == 12_000.0


def test_a_log_row_at_the_first_step_is_its_only_line_and_rows_reset_the_silence():
    clock, console = FakeClock(), _plain()
    display = ProgressDisplay(100, "fp32 mlp", console, enabled=True, clock=clock, ticker=Ticks())
    with display:
        clock.t += 2.0
        display.on_log({**ROW, "step": 1, "epoch": 0})  # log_every=1: the row comes first
        display.on_step(LoopState(step=1))
        clock.t += 29.0
        display.on_eval({"step": 1, "epoch": 0, "val_loss": 0.5, "val_accuracy": 0.9})
        clock.t += 29.0
        display.on_step(LoopState(step=2))  # 29 s after the evaluation's line: no line yet
    lines = console.file.getvalue().splitlines()
    assert [line.split(" ")[:2] for line in lines] == [
        ["train", "step=1/100"],
        ["eval", "step=1/100"],
        ["about", "1"],  # step 2 took 58 s: the estimate does not wait for steps 3-5
    ]
    assert lines[0].endswith("eta=0:03:18")  # 99 steps at the first step's 2 s


def test_on_a_terminal_no_clock_lines_but_the_estimate_and_the_note_are_said():
    clock = FakeClock()
    console = Console(file=io.StringIO(), force_terminal=True, width=300, color_system=None)
    slow = SlowPath("FP16 convolutions are a slow path on this CPU", "fp16", "precision=fp32", 0.5)
    display = ProgressDisplay(
        100, "fp16 cnn", console, enabled=True, clock=clock, slow_path=slow, ticker=Ticks()
    )
    with display:
        for step in range(1, 7):
            clock.t += 40.0
            display.on_step(LoopState(step=step))
    out = console.file.getvalue()
    assert "train step=" not in out  # the bar shows the steps
    assert "about 1 h 6 min for 100 steps at 40 s/step (measured over step 2)" in out
    assert "one step took 40 s in fp16 vs 0.5 s in fp32 (80×)" in out
    assert display.notes == [
        "FP16 convolutions are a slow path on this CPU: one step took 40 s in fp16 vs 0.5 s in "
        "fp32 (80×); precision=fp32 is the fast choice here"
    ]


# ------------------------------------------------------------------------------ the heartbeat
FP16_CONV = "FP16 convolutions are a slow path on this CPU"


def test_a_long_first_step_gets_a_heartbeat_with_a_lower_bound_and_the_note_so_far(caplog):
    caplog.set_level(logging.INFO, logger="mptrain")
    clock, console, ticks = FakeClock(), _plain(), Ticks()
    slow = SlowPath(FP16_CONV, "fp16", "precision=bf16 (or fp32)", 0.98)
    display = ProgressDisplay(
        50_000, "fp16 resnet50", console, True, clock=clock, slow_path=slow, ticker=ticks
    )
    with display:
        assert ticks.running and ticks.every_s == ProgressDisplay.BEAT_POLL_S
        display.on_step_start(1)
        for seconds in (19.5, 0.5, 29.0, 1.0):  # heartbeats at 20 s, then 30 s after that one
            clock.t += seconds
            ticks.tick()
        clock.t += 12.0
        display.on_step(LoopState(step=1))  # the step took 62 s
    assert not ticks.running
    lines = console.file.getvalue().splitlines()
    assert lines == [
        "train step=1/50000 running for 20 s (first step, one-off costs included): the whole "
        "run takes at least 11 d 13 h at this pace",
        f"note: {FP16_CONV}: step 1 has run 20 s in fp16 so far vs 0.98 s for a whole fp32 step "
        "(≥20×); precision=bf16 (or fp32) is the fast choice here",
        "train step=1/50000 running for 50 s (first step, one-off costs included): the whole "
        "run takes at least 28 d 22 h at this pace",
        "train step=1/50000 epoch=0 elapsed=0:01:02 s/step=62 eta=35 days, 21:05:38 "
        "(first step, one-off costs included)",
        f"note: {FP16_CONV}: one step took 62 s in fp16 vs 0.98 s in fp32 (63×); "
        "precision=bf16 (or fp32) is the fast choice here",
    ]
    assert [r.getMessage() for r in caplog.records] == lines  # the log file has them all
    assert display.heartbeats == lines[:3]
    assert display.notes == [lines[4].removeprefix("note: ")]  # the report's: the measured one


@pytest.mark.parametrize("where", ["terminal", "progress=false"])
def test_the_first_heartbeat_is_said_whatever_the_display_later_ones_are_logged(caplog, where):
    caplog.set_level(logging.INFO, logger="mptrain")
    clock, ticks = FakeClock(), Ticks()
    if where == "terminal":
        console = Console(file=io.StringIO(), force_terminal=True, width=300, color_system=None)
    else:
        console = _plain()
    display = ProgressDisplay(
        100, "fp32 cnn", console, where == "terminal", clock=clock, ticker=ticks
    )
    with display:
        for seconds in (20.0, 30.0):
            clock.t += seconds
            ticks.tick()
    first = (
        "train step=1/100 running for 20 s (first step, one-off costs included): the whole run "
        "takes at least 33 min at this pace"
    )
    second = "train step=1/100 running for 50 s (first step"
    out = console.file.getvalue()
    assert first in out and second not in out
    assert [r.getMessage()[: len(second)] for r in caplog.records] == [first[: len(second)], second]


def test_after_the_first_step_the_heartbeat_names_the_step_running_or_the_time_between_steps():
    clock, console, ticks = FakeClock(), _plain(), Ticks()
    display = ProgressDisplay(100, "fp32 cnn", console, True, clock=clock, ticker=ticks)
    with display:
        for step in (1, 2):
            display.on_step_start(step)
            clock.t += 2.0
            display.on_step(LoopState(step=step))
        display.on_step_start(3)
        for seconds in (29.0, 1.0):  # step 3 has run 30 s
            clock.t += seconds
            ticks.tick()
        clock.t += 5.0
        display.on_step(LoopState(step=3))  # 5 s after the heartbeat: no line of its own
        clock.t += 30.0  # an evaluation, say: no step started
        ticks.tick()
    lines = console.file.getvalue().splitlines()
    assert lines[0].startswith("train step=1/100 epoch=0 elapsed=0:00:02 ")
    assert lines[1:] == [
        "train step=3/100 running for 30 s (pace so far: 2 s/step)",
        "about 30 min for 100 steps at 18.5 s/step (measured over steps 2-3)",
        "train step=3/100 done 30 s ago; no step running since (evaluation, checkpoint writes "
        "and loggers run between steps)",
    ]
    assert display.heartbeats == [lines[1], lines[3]]


def test_steps_that_end_often_enough_get_no_heartbeat():
    clock, console, ticks = FakeClock(), _plain(), Ticks()
    display = ProgressDisplay(100, "fp32 cnn", console, True, clock=clock, ticker=ticks)
    with display:
        for step, seconds in enumerate([19] + [25] * 9, start=1):  # the first within 20 s
            display.on_step_start(step)
            for _ in range(seconds):
                clock.t += 1.0
                ticks.tick()
            display.on_step(LoopState(step=step))
    assert display.heartbeats == []
    assert "running for" not in console.file.getvalue()


def test_a_resumed_run_bounds_the_steps_it_has_left():
    clock, console, ticks = FakeClock(), _plain(), Ticks()
    display = ProgressDisplay(
        5000, "fp16 cnn", console, True, start_step=1000, clock=clock, ticker=ticks
    )
    with display:
        clock.t += 20.0
        ticks.tick()
    assert display.heartbeats == [
        "train step=1001/5000 running for 20 s (first step, one-off costs included): the 4,000 "
        "steps left take at least 22 h 13 min at this pace"
    ]


def test_the_heartbeat_thread_ticks_until_the_display_exits_even_on_an_error(monkeypatch):
    ticked = threading.Event()
    ticker = Ticker(0.001, ticked.set)
    ticker.start()
    assert ticked.wait(timeout=60)
    ticker.stop()
    ticked.clear()
    assert not ticked.wait(timeout=0.05)  # stopped: no tick after stop() returned

    monkeypatch.setattr(ProgressDisplay, "BEAT_POLL_S", 0.001)
    read_by_the_thread = threading.Event()

    def clock() -> float:
        if threading.current_thread() is not threading.main_thread():
            read_by_the_thread.set()
        return 1000.0

    display = ProgressDisplay(100, "fp32 mlp", _plain(), True, clock=clock)
    with pytest.raises(RuntimeError, match="the step failed"), display:
        assert read_by_the_thread.wait(timeout=60)
        raise RuntimeError("the step failed")
    assert not [t for t in threading.enumerate() if t.name == "mptrain-heartbeat"]
