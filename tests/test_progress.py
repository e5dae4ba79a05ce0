"""The live progress display: throttled per-step updates, the final step always shown."""

from __future__ import annotations

import io

from rich.console import Console

from mptrain.progress import ProgressDisplay
from mptrain.state import LoopState


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
        display.on_log({"loss": 1.0, "loss_scale": None, "samples_per_s": 10.0})
    assert display._progress.tasks[0].completed == 0
