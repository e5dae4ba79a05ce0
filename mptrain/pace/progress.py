"""Progress while a run trains: the live bar on a terminal, plain lines everywhere else
(docs/trackers.md shows every line below and when it comes).

Off a terminal one line every ``log_every`` steps and one per evaluation (:func:`step_line`,
:func:`eval_line`) and, so that no run is silent for long, lines from the host's clock alone
(:func:`pace_line`: nothing read from the device). Whatever the display, once, the run's estimate
(:mod:`mptrain.pace.estimate`) and the slow-path note. While a step, or the time between two
steps, runs long, a heartbeat (a :class:`Ticker` thread) says so (:func:`first_step_beat_line`,
:func:`beat_line`). The job's log file (:mod:`mptrain.output.joblog`) records every line.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from mptrain.output.joblog import JobLog
from mptrain.output.metrics import StepCounters
from mptrain.pace.estimate import (
    Pace,
    RunEstimate,
    SlowPath,
    rough_duration,
    slow_path_note,
    slow_path_so_far_note,
    step_time_text,
)


class Ticker:
    """Calls ``tick()`` every ``every_s`` seconds on a daemon thread, from :meth:`start` until
    :meth:`stop`, which waits for a tick under way to end (so none comes after it). The progress
    display's heartbeat: its tick reads the clock and prints, never the device, the model or torch.
    A tick that raises ends the thread (Python prints its traceback); training goes on."""

    def __init__(self, every_s: float, tick: Callable[[], None]) -> None:
        self.every_s, self.tick = every_s, tick
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mptrain-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            self.tick()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


TickerFactory = Callable[[float, Callable[[], None]], Ticker]


class ProgressDisplay:
    """Shows progress while a run trains (see the module doc); a loop observer.

    ``enabled``: show progress on stdout at all (the bar on a terminal, lines elsewhere); the
    log file records the lines either way (when ``log`` is given and entered). ``start_step``: the
    step the run starts from (a resumed run), for the time left. ``clock``: seconds, read once per
    step and by the heartbeat (tests replace it). ``slow_path``: the note to give after the first
    step, when the precision is known to be far slower than FP32 here. ``ticker``: what calls
    :meth:`beat` (by default a :class:`Ticker` thread every :attr:`BEAT_POLL_S`, from ``__enter__``
    to ``__exit__``, whatever ends the block; tests pass one they tick by hand). After the run,
    :attr:`estimate` holds the estimate made (None for a run too short to make one), :attr:`notes`
    the notes given after steps and :attr:`heartbeats` what the heartbeat said (lines and note).

    The loop calls :meth:`on_step_start` as it starts a step and :meth:`on_step` when it finished,
    rows and evaluations in between. Those calls and the heartbeat's (on its own thread) hold one
    lock: a line is printed whole, and the heartbeat reads the counters as one call left them.
    """

    REFRESH_PER_S = 10  # rich's own redraw rate
    LINE_EVERY_S = 30.0  # off a terminal: the longest silence between lines; the heartbeat's wait
    FIRST_BEAT_S = 20.0  # the first step: its first heartbeat once it has run this long
    BEAT_POLL_S = 1.0  # how often the heartbeat reads the clock

    def __init__(  # noqa: PLR0913 (a constructor: the display's settings, named)
        self,
        total_steps: int,
        label: str,
        console: Console,
        enabled: bool,
        log: JobLog | None = None,
        start_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
        slow_path: SlowPath | None = None,
        ticker: TickerFactory | None = None,
    ) -> None:
        self.enabled = enabled and console.is_terminal  # the live bar
        self.lines = enabled and not console.is_terminal  # plain lines on stdout
        self.log = log if log is not None else JobLog(console)
        self.total_steps, self.start_step = total_steps, start_step
        self.clock, self.slow_path = clock, slow_path
        self.pace = Pace(total_steps, start_step)
        self.notes: list[str] = []
        self.heartbeats: list[str] = []
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            disable=not self.enabled,
            transient=False,
            refresh_per_second=self.REFRESH_PER_S,
        )
        self._task = self._progress.add_task(label, total=total_steps, status="")
        self._fields: dict[str, str] = {}
        self._state: StepCounters | None = None
        self._next_update = 0.0
        self._last_line = 0.0  # when the last line was given (clock)
        self._lined_step = start_step  # the step the last train line was about
        self._paced_step = start_step  # the last step Pace was told of
        self._lock = threading.Lock()
        self._ticker_factory = ticker
        self._ticker: Ticker | None = None
        self._running: int | None = start_step + 1  # the step under way; None between steps
        self._since = 0.0  # when it started, or (between steps) when the last one finished

    @property
    def estimate(self) -> RunEstimate | None:
        return self.pace.estimate

    def __enter__(self) -> ProgressDisplay:
        self._last_line = self._since = now = self.clock()
        self.pace.start(now)
        self._progress.start()
        if self.log.enabled:  # a rank that says nothing needs no heartbeat
            self._ticker = (self._ticker_factory or Ticker)(self.BEAT_POLL_S, self.beat)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ticker is not None:  # first, and without the lock: a tick under way takes it
            self._ticker.stop()
            self._ticker = None
        if self.enabled and self._state is not None:
            self._refresh(self._state)  # the final step, whenever the last update was
        self._progress.stop()

    def _refresh(self, state: StepCounters) -> None:
        status = " ".join(f"{k} {v}" for k, v in self._fields.items())
        eta = _duration(self.pace.remaining_s(state.step))
        self._progress.update(
            self._task, completed=state.step, status=f"epoch {state.epoch} {status} eta {eta}"
        )

    def on_step_start(self, step: int) -> None:
        """The loop starts ``step`` (1-based). The first step counts from the loop's start, as
        its line does (:attr:`Pace.first_step_s`)."""
        with self._lock:
            if step != self.pace.first_step:
                self._running, self._since = step, self.clock()

    def on_step(self, state: StepCounters) -> None:
        # Called every step: one clock read and a few comparisons. The bar redraws at
        # REFRESH_PER_S anyway, so updating it more often than that only costs the training loop
        # time (~10 us per update on a 1 ms step).
        with self._lock:
            self._state, now = state, self.clock()
            self._running, self._since = None, now
            self._step_done(state.step, now)
            first = state.step == self.pace.first_step
            # A line after the first step, or after a silence (unless the step's log row gave one).
            if (first or self._silent_since(now)) and self._lined_step != state.step:
                self._lined_step = state.step
                line = pace_line(state, self.total_steps, self.pace, now)
                self._line(f"{line} (first step, one-off costs included)" if first else line, now)
            if first and self.slow_path is not None:  # said even without progress, as notes are
                note = slow_path_note(self.slow_path, self.pace.first_step_s)
                self.notes.append(note)
                self.log.say(note, "note")
            if self.enabled and now >= self._next_update:
                self._next_update = now + 1 / self.REFRESH_PER_S
                self._refresh(state)

    def _silent_since(self, now: float) -> bool:
        """Off a terminal: no line for :attr:`LINE_EVERY_S` (the bar needs no such line)."""
        return self.lines and now - self._last_line >= self.LINE_EVERY_S

    def _step_done(self, step: int, now: float) -> None:
        """Time ``step`` once (a log row comes before the step's on_step); give the estimate
        when this step makes it."""
        if step == self._paced_step:
            return
        self._paced_step = step
        estimate = self.pace.step_done(step, now)
        if estimate is not None:
            again = self.pace.restarted_why
            # printed and logged whatever the display: a run's expected duration is worth a line
            self.log.say(f"re-estimated ({again}): {estimate.line()}" if again else estimate.line())

    def remeasure(self, step: int, why: str) -> None:
        """The steps after ``step`` run differently (threads=auto changed the thread count): the
        estimate is made again from them (:meth:`mptrain.pace.estimate.Pace.restart`)."""
        with self._lock:
            self.pace.restart(step, self.clock(), why)

    def beat(self) -> None:
        """The heartbeat's tick (see the module doc): a line when the step under way, or the
        time between steps, has lasted :attr:`FIRST_BEAT_S` (the first heartbeat of the first
        step) or :attr:`LINE_EVERY_S` with no line meanwhile. It reads the clock and the
        display's own counters: nothing of the device, the model or torch."""
        with self._lock:
            now = self.clock()
            first = self._running == self.pace.first_step
            wait = self.FIRST_BEAT_S if first and not self.heartbeats else self.LINE_EVERY_S
            if now - max(self._last_line, self._since) < wait:
                return
            running_s = now - self._since
            if first:
                self._first_step_beat(running_s, now)
                return
            line = beat_line(
                self._running, self._paced_step, self.total_steps, running_s, self.pace.step_s
            )
            self.heartbeats.append(line)
            self._line(line, now)

    def _first_step_beat(self, running_s: float, now: float) -> None:
        """The first step is still under way: a lower bound of the run's time and, once, the
        slow-path note with a lower bound of the ratio. The first such heartbeat is said whatever
        the display, as the estimate is (the bar has nothing to show yet); later ones are
        progress lines."""
        step, steps = self.pace.first_step, self.total_steps - self.start_step
        line = first_step_beat_line(step, self.total_steps, steps, running_s)
        said_before = bool(self.heartbeats)
        self.heartbeats.append(line)
        if said_before:
            self._line(line, now)
            return
        self._last_line = now
        self.log.say(line)
        if self.slow_path is None:
            return
        note = slow_path_so_far_note(self.slow_path, step, running_s)
        if note is not None:  # the note after the step still gives the measured ratio
            self.heartbeats.append(f"note: {note}")
            self.log.say(note, "note")

    def on_log(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._fields["loss"] = f"{row['loss']:.4f}"
            if row["loss_scale"] is not None:
                self._fields["scale"] = f"{row['loss_scale']:g}"
            self._fields["samples/s"] = f"{row['samples_per_s']:.0f}"
            if "tokens_per_s" in row:
                self._fields["tokens/s"] = f"{row['tokens_per_s']:.0f}"
            now = self.clock()
            self._step_done(row["step"], now)
            self._lined_step = row["step"]
            remaining = self.pace.remaining_s(row["step"])
            self._line(step_line(row, self.total_steps, remaining), now)

    def on_eval(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._fields["val_acc"] = f"{row['val_accuracy']:.2%}"
            self._line(eval_line(row, self.total_steps), self.clock())

    def on_warning(self, message: str) -> None:
        # Printed whether or not the bar is shown: a warning must reach the user once.
        with self._lock:
            self.log.warn(message)

    def _line(self, line: str, now: float) -> None:
        self._last_line = now
        if self.lines:
            self.log.say(line)
        else:  # the bar (or nothing, progress=false) on stdout; the line still goes to the log
            self.log.record(line)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    return str(dt.timedelta(seconds=round(seconds)))


def _perplexity(row: dict[str, Any]) -> str:
    return f" val_perplexity={row['val_perplexity']:.2f}" if "val_perplexity" in row else ""


def _tokens(row: dict[str, Any]) -> str:
    return f" tokens/s={row['tokens_per_s']:.0f}" if "tokens_per_s" in row else ""


def step_line(row: dict[str, Any], total_steps: int, eta_s: float | None) -> str:
    """One progress line for a metrics row."""
    scale = "off" if row["loss_scale"] is None else f"{row['loss_scale']:g}"
    return (
        f"train step={row['step']}/{total_steps} epoch={row['epoch']} loss={row['loss']:.4f} "
        f"lr={row['lr']:.4g} loss_scale={scale} skipped={row['skipped_total']} "
        f"samples/s={row['samples_per_s']:.0f}{_tokens(row)} eta={_duration(eta_s)}"
    )


def pace_line(state: StepCounters, total_steps: int, pace: Pace, now: float) -> str:
    """A line from the clock alone, between log rows: no loss, nothing read from the device."""
    step_s = pace.step_s
    speed = "?" if step_s is None else f"{step_s:.3g}"
    return (
        f"train step={state.step}/{total_steps} epoch={state.epoch} "
        f"elapsed={_duration(pace.elapsed_s(now))} s/step={speed} "
        f"eta={_duration(pace.remaining_s(state.step))}"
    )


def eval_line(row: dict[str, Any], total_steps: int) -> str:
    """One line for an evaluation row."""
    return (
        f"eval step={row['step']}/{total_steps} epoch={row['epoch']} "
        f"val_loss={row['val_loss']:.4f}{_perplexity(row)} val_accuracy={row['val_accuracy']:.2%}"
    )


def first_step_beat_line(step: int, total_steps: int, steps: int, running_s: float) -> str:
    """The heartbeat while the run's first step (``step``) is under way: ``steps`` (the run's, or
    what a resumed run has left) at no less than that step's seconds so far each, a lower bound
    "at this pace" (rounded down). The first step carries one-off costs, hence "at this pace"."""
    bound = rough_duration(steps * running_s, down=True)
    what = "the whole run takes" if steps == total_steps else f"the {steps:,} steps left take"
    return (
        f"train step={step}/{total_steps} running for {rough_duration(running_s, down=True)} "
        f"(first step, one-off costs included): {what} at least {bound} at this pace"
    )


def beat_line(
    running: int | None, done: int, total_steps: int, seconds: float, step_s: float | None
) -> str:
    """The heartbeat after the first step: step ``running`` under way for ``seconds`` (and the
    pace of the steps before it, ``step_s``), or with ``running=None`` no step under way for
    ``seconds`` since step ``done`` finished (evaluations, checkpoints and loggers run then)."""
    for_s = rough_duration(seconds, down=True)
    if running is None:
        return (
            f"train step={done}/{total_steps} done {for_s} ago; no step running since "
            "(evaluation, checkpoint writes and loggers run between steps)"
        )
    before = "" if step_s is None else f" (pace so far: {step_time_text(step_s)})"
    return f"train step={running}/{total_steps} running for {for_s}{before}"
