"""Live terminal display: a rich progress bar with epoch, step, loss, loss scale and samples/s."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mptrain.loop import LoopState


class ProgressDisplay:
    """Shows progress while a run trains. Disabled, it does nothing (tests, non-terminal output)."""

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
        )
        self._task = self._progress.add_task(label, total=total_steps, status="")
        self._fields: dict[str, str] = {}

    def __enter__(self) -> ProgressDisplay:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def _refresh(self, state: LoopState) -> None:
        status = " ".join(f"{k} {v}" for k, v in self._fields.items())
        self._progress.update(
            self._task, completed=state.step, status=f"epoch {state.epoch} {status}"
        )

    def on_step(self, state: LoopState) -> None:
        if self.enabled:
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
