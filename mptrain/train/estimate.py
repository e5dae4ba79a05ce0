"""How long a run is expected to take here: its first steps timed, and the line that says it.

:func:`estimate_line` turns a step count and measured step times into one line, e.g.::

    recipe nanogpt_shakespeare_char: 5000 steps, about 2 h 10 min here at 1.56 s/step (measured over steps 2-5)

:class:`StepTimer`, a loop observer, times the steps after the first (which pays for lazy
initialisation, compilation and allocator warm-up) and says that line once. Only training steps
are timed: evaluations and checkpoint writes come on top.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mptrain.platform import hardware

if TYPE_CHECKING:
    from mptrain.train.state import LoopState


def estimate_line(
    label: str,
    total_steps: int,
    step_times_s: Sequence[float],
    first_measured: int,
    steps_done: int = 0,
) -> str:
    """``{label}: {total_steps} steps, about {duration} here at {time}/step (measured over steps
    {first_measured}-{last})``: the steps left (``total_steps - steps_done``; a resumed run says
    how many) times the median of ``step_times_s``, the times of consecutive steps from
    ``first_measured`` on (the median: one step slowed by a checkpoint write does not count).
    ValueError when ``step_times_s`` is empty."""
    if not step_times_s:
        raise ValueError("estimate_line: no step times measured")
    per_step = statistics.median(step_times_s)
    left = total_steps - steps_done
    steps = f"{total_steps} steps" + (f" ({left} left)" if steps_done else "")
    last = first_measured + len(step_times_s) - 1
    return (
        f"{label}: {steps}, about {duration_words(left * per_step)} here at "
        f"{step_time_words(per_step)}/step (measured over steps {first_measured}-{last})"
    )


def duration_words(seconds: float) -> str:
    """``45 s``, ``14 min``, ``2 h 10 min``, ``3 d 4 h``: as precise as a guess deserves."""
    if seconds < 90:
        return f"{round(seconds)} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    if minutes < 48 * 60:
        return f"{minutes // 60} h {minutes % 60} min"
    hours = round(seconds / 3600)
    return f"{hours // 24} d {hours % 24} h"


def step_time_words(seconds: float) -> str:
    """``1.56 s`` or ``12.3 ms``: three significant figures."""
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1000:.3g} ms"


class StepTimer:
    """A loop observer that times ``measure`` consecutive steps after the first and then says
    :func:`estimate_line` once through ``say``.

    Each timed step ends with a device synchronisation (CUDA: the time covers the kernels, not
    their launch), ``measure + 1`` in all, none after the line is said. An evaluation inside the
    window restarts it after the evaluation, so the line is of training steps only. ``clock``:
    seconds (tests give their own).
    """

    def __init__(
        self,
        label: str,
        total_steps: int,
        say: Callable[[str], None],
        device: torch.device,
        measure: int = 4,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.label, self.total_steps, self.say = label, total_steps, say
        self.device, self.measure, self.clock = device, measure, clock
        self.start_step: int | None = None  # the step the loop started from (a resumed run's)
        self.times: list[float] = []
        self.last_step: int | None = None  # the step self.last_at was read after
        self.last_at = 0.0
        self.done = False

    def on_step(self, state: LoopState) -> None:
        if self.done:
            return
        if self.start_step is None:
            self.start_step = state.step - 1
        hardware.synchronize(self.device)
        now = self.clock()
        if self.last_step is not None:
            self.times.append(now - self.last_at)
        self.last_step, self.last_at = state.step, now
        if len(self.times) == self.measure:
            self.done = True
            first = state.step - self.measure + 1
            if state.step < self.total_steps:  # a run already over needs no estimate
                self.say(
                    estimate_line(self.label, self.total_steps, self.times, first, self.start_step)
                )

    def on_eval(self, row: dict[str, Any]) -> None:
        # The evaluation ran after the last timed step: start the window again from here.
        if not self.done and self.last_step is not None:
            hardware.synchronize(self.device)
            self.times.clear()
            self.last_at = self.clock()

    def on_log(self, row: dict[str, Any]) -> None:
        """Nothing: the estimate is said once, not per row."""

    def on_warning(self, message: str) -> None:
        """Nothing: the display says warnings."""
