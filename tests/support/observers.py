"""Loop observers for tests (mptrain.train.monitor.LoopObserver): what a run looked like after
every optimizer step. Imported as ``from support.observers import ...``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class PerStep:
    """An observer recording, after every step, ``(step, record(run))``; log rows, evaluations
    and warnings are not its business."""

    def __init__(self, run, record: Callable[[Any], Any]) -> None:
        self.run, self.record = run, record
        self.rows: list[tuple[int, Any]] = []

    def on_step(self, state) -> None:
        self.rows.append((state.step, self.record(self.run)))

    def on_log(self, row) -> None:
        pass

    def on_eval(self, row) -> None:
        pass

    def on_warning(self, message) -> None:
        pass
