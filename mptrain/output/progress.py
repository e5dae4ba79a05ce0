"""Progress while a run trains: the live bar on a terminal, plain lines everywhere else.

On a terminal, a rich progress bar with epoch, step, loss, loss scale and samples/s. Anywhere else
(``> train.log``, ``| tee``, nohup, SLURM) one plain line every ``log_every`` steps and one per
evaluation, e.g.::

    train step=100/300 epoch=1 loss=0.4321 lr=0.001 loss_scale=65536 skipped=0 samples/s=2345 eta=0:00:12
    eval step=100/300 epoch=1 val_loss=0.3124 val_accuracy=91.23%

The job's log file (:mod:`mptrain.output.joblog`) records those lines in both cases.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mptrain.output.joblog import JobLog


class StepCounters(Protocol):
    """What observers read of the loop's counters (:class:`mptrain.train.state.LoopState` has
    them): the output layer sees the counters, never the loop's state object."""

    step: int
    epoch: int


class ProgressDisplay:
    """Shows progress while a run trains (see the module doc); a loop observer.

    ``enabled``: show progress on stdout at all (the bar on a terminal, lines elsewhere); the
    log file records the lines either way (when ``log`` is given and entered). ``start_step``: the
    step the run starts from (a resumed run), for the ETA.
    """

    REFRESH_PER_S = 10  # rich's own redraw rate

    def __init__(
        self,
        total_steps: int,
        label: str,
        console: Console,
        enabled: bool,
        log: JobLog | None = None,
        start_step: int = 0,
    ) -> None:
        self.enabled = enabled and console.is_terminal  # the live bar
        self.lines = enabled and not console.is_terminal  # plain lines on stdout
        self.log = log if log is not None else JobLog(console)
        self.total_steps, self.start_step = total_steps, start_step
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
        self._state: StepCounters | None = None
        self._next_update = 0.0
        self._started = time.monotonic()

    def __enter__(self) -> ProgressDisplay:
        self._started = time.monotonic()
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self._state is not None:
            self._refresh(self._state)  # the final step, whenever the last update was
        self._progress.stop()

    def _refresh(self, state: StepCounters) -> None:
        status = " ".join(f"{k} {v}" for k, v in self._fields.items())
        self._progress.update(
            self._task, completed=state.step, status=f"epoch {state.epoch} {status}"
        )

    def on_step(self, state: StepCounters) -> None:
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
        if "tokens_per_s" in row:
            self._fields["tokens/s"] = f"{row['tokens_per_s']:.0f}"
        self._line(step_line(row, self.total_steps, self._eta(row["step"])))

    def on_eval(self, row: dict[str, Any]) -> None:
        self._fields["val_acc"] = f"{row['val_accuracy']:.2%}"
        self._line(eval_line(row, self.total_steps))

    def on_warning(self, message: str) -> None:
        # Printed whether or not the bar is shown: a warning must reach the user once.
        self.log.warn(message)

    def _line(self, line: str) -> None:
        if self.lines:
            self.log.say(line)
        else:  # the bar (or nothing, progress=false) on stdout; the line still goes to the log
            self.log.record(line)

    def _eta(self, step: int) -> float | None:
        """Seconds left at the pace since the start (evaluations included: they recur)."""
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.monotonic() - self._started) / done * (self.total_steps - step)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    return str(dt.timedelta(seconds=round(seconds)))


def _perplexity(row: dict[str, Any]) -> str:
    return f" val_perplexity={row['val_perplexity']:.2f}" if "val_perplexity" in row else ""


def _tokens(row: dict[str, Any]) -> str:
    return f" tokens/s={row['tokens_per_s']:.0f}" if "tokens_per_s" in row else ""


def step_line(row: dict[str, Any], total_steps: int, eta_s: float | None) -> str:
    """One progress line for a metrics row (see the module doc for its form)."""
    scale = "off" if row["loss_scale"] is None else f"{row['loss_scale']:g}"
    return (
        f"train step={row['step']}/{total_steps} epoch={row['epoch']} loss={row['loss']:.4f} "
        f"lr={row['lr']:.4g} loss_scale={scale} skipped={row['skipped_total']} "
        f"samples/s={row['samples_per_s']:.0f}{_tokens(row)} eta={_duration(eta_s)}"
    )


def eval_line(row: dict[str, Any], total_steps: int) -> str:
    """One line for an evaluation row."""
    return (
        f"eval step={row['step']}/{total_steps} epoch={row['epoch']} "
        f"val_loss={row['val_loss']:.4f}{_perplexity(row)} val_accuracy={row['val_accuracy']:.2%}"
    )
