"""The live progress display: throttled per-step updates, the final step always shown."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from mptrain.output.progress import ProgressDisplay
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
