"""Live terminal display: a rich progress bar with epoch, step, loss, loss scale and samples/s."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mptrain.state import LoopState


class ProgressDisplay:
    """Shows progress while a run trains. Disabled, it does nothing (tests, non-terminal output)."""

    REFRESH_PER_S = 10  # rich's own redraw rate

    def __init__(self, total_steps: int, label: str, console: Console, enabled: bool) -> None:
        self.enabled = enabled and console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=console,
            disable=not self.enabled,
            transient=False,
            refresh_per_second=self.REFRESH_PER_S,
        )
        self._task = self._progress.add_task(label, total=total_steps, status="")
        self._fields: dict[str, str] = {}
        self._state: LoopState | None = None
        self._next_update = 0.0

    def __enter__(self) -> ProgressDisplay:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self._state is not None:
            self._refresh(self._state)  # the final step, whenever the last update was
        self._progress.stop()

    def _refresh(self, state: LoopState) -> None:
        status = " ".join(f"{k} {v}" for k, v in self._fields.items())
        self._progress.update(
            self._task, completed=state.step, status=f"epoch {state.epoch} {status}"
        )

    def on_step(self, state: LoopState) -> None:
        # Called every step; the bar redraws at REFRESH_PER_S anyway, so updating it more often
        # than that only costs the training loop time (~10 us per update on a 1 ms step).
        self._state = state
        if self.enabled and (now := time.monotonic()) >= self._next_update:
            self._next_update = now + 1 / self.REFRESH_PER_S
            self._refresh(state)

    def on_log(self, row: dict[str, Any]) -> None:
        self._fields["loss"] = f"{row['loss']:.4f}"
        if row["loss_scale"] is not None:
            self._fields["scale"] = f"{row['loss_scale']:g}"
        self._fields["samples/s"] = f"{row['samples_per_s']:.0f}"

    def on_eval(self, row: dict[str, Any]) -> None:
        self._fields["val_acc"] = f"{row['val_accuracy']:.2%}"

    def on_warning(self, message: str) -> None:
        # Printed whether or not the bar is shown: a warning must reach the user once.
        self._progress.console.print(f"[yellow]warning:[/yellow] {escape(message)}")
