"""How long a run will take, and the words of the slow-path note (whether a precision is slow
here is decided and timed by :mod:`mptrain.pace.slowpath`; docs/trackers.md shows both lines).

:class:`Pace` times the loop's steps as they finish (on the host's clock: no device read). The
first step carries one-off costs (allocations, kernel selection, lazy imports) that later steps do
not, so the estimate of the whole run is ``steps x seconds per step measured after it``
(:func:`estimate_run`), made once (after :attr:`Pace.ESTIMATE_STEPS` steps past the first, or
sooner when they are slow: a run at 40 s/step should not wait minutes to be told it takes days)
and said in one line (:func:`estimate_line`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def rough_duration(seconds: float, down: bool = False) -> str:
    """``41 s``, ``3 min 20 s``, ``2 h 10 min``, ``3 d 4 h``: two units at most (an estimate).
    ``down``: never more than ``seconds`` (a lower bound, a time so far): rounded down at the
    precision shown, where otherwise the seconds are rounded to the nearest."""
    seconds = max(seconds, 0.0)
    if down:
        seconds = _floor_shown(seconds)
    s = math.floor(seconds) if down else round(seconds)
    if s < 60:
        return f"{seconds:.0f} s" if s >= 10 else f"{seconds:.2g} s"
    minutes, s = divmod(s, 60)
    if minutes < 60:
        return f"{minutes} min {s} s" if minutes < 10 and s else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


# Rounding down: 0.29 * 100 is 28.999999999999996 in binary floating point, not 29
FLOOR_SLACK = 1e-9


def _floor_shown(seconds: float) -> float:
    """``seconds`` rounded down to what :func:`rough_duration` shows of it: two significant
    digits below 10 s, whole seconds above (larger units drop the smaller ones anyway)."""
    if seconds >= 10 or seconds == 0:
        return float(math.floor(seconds + FLOOR_SLACK))
    scale = 10 ** (1 - math.floor(math.log10(seconds)))
    return math.floor(seconds * scale + FLOOR_SLACK) / scale


def step_time_text(step_s: float) -> str:
    """``1.56 s/step``, ``12.3 ms/step``: three significant digits."""
    if step_s < 1.0:
        return f"{step_s * 1000:.3g} ms/step"
    return f"{step_s:.3g} s/step"


def estimate_run(total_steps: int, measured: tuple[int, float]) -> float:
    """Seconds for ``total_steps`` at the pace of ``measured = (steps, seconds)``: steps timed
    after the first, whose one-off costs would inflate the estimate of a long run."""
    steps, seconds = measured
    if steps <= 0:
        raise ValueError(f"an estimate needs at least one measured step, got {steps}")
    return total_steps * seconds / steps


def estimate_line(total_steps: int, measured: tuple[int, float], first_measured: int = 2) -> str:
    """``about 2 h 10 min for 5,000 steps at 1.56 s/step (measured over steps 2-5)``:
    ``measured = (steps, seconds)`` timed from step ``first_measured`` (1-based) on."""
    steps, seconds = measured
    last = first_measured + steps - 1
    over = f"step {last}" if steps == 1 else f"steps {first_measured}-{last}"
    return (
        f"about {rough_duration(estimate_run(total_steps, measured))} for {total_steps:,} steps "
        f"at {step_time_text(seconds / steps)} (measured over {over})"
    )


@dataclass(frozen=True)
class RunEstimate:
    """The estimate of the run's time, as made once while it trained."""

    steps: int  # the steps it is for: the whole run (a resumed run: the steps it had left)
    measured_steps: int  # steps timed after the first
    measured_s: float
    first_measured: int  # the first timed step (1-based, the run's own numbering)
    made_after_s: float  # seconds after the loop started

    @property
    def total_s(self) -> float:
        return estimate_run(self.steps, (self.measured_steps, self.measured_s))

    @property
    def step_s(self) -> float:
        return self.measured_s / self.measured_steps

    def line(self) -> str:
        return estimate_line(
            self.steps, (self.measured_steps, self.measured_s), self.first_measured
        )

    def record(self, actual_s: float | None, actual_steps: int) -> dict[str, Any]:
        """The report's ``time.estimate``: the estimate, when it was made, and the actual loop
        time of the steps that ran (``actual_steps``; fewer than ``steps`` when it stopped)."""
        last = self.first_measured + self.measured_steps - 1
        return {
            "estimated_s": self.total_s,
            "steps": self.steps,
            "step_s": self.step_s,
            "measured_steps": [self.first_measured, last],
            "made_at_step": last,
            "made_after_s": self.made_after_s,
            "line": self.line(),
            "actual_s": actual_s,
            "actual_steps": actual_steps,
        }


class Pace:
    """Step times as the loop reports its finished steps (see the module doc).

    Call :meth:`start` when the loop starts and :meth:`step_done` after every step, with times
    from the same clock. ``start_step``: the step the run starts from (a resumed run).
    """

    ESTIMATE_STEPS = 4  # steps past the first the estimate waits for (steps 2-5)
    ESTIMATE_AFTER_S = 30.0  # ... or fewer, once the steps past the first took this long

    def __init__(self, total_steps: int, start_step: int = 0) -> None:
        self.total_steps, self.start_step = total_steps, start_step
        self.started = 0.0
        self.first_step_s: float | None = None  # the first step's seconds, one-off costs included
        self._first_done: float | None = None  # when the first step finished
        self._measured: tuple[int, float] = (0, 0.0)  # (steps, seconds) after the first
        self.estimate: RunEstimate | None = None
        self._origin: int | None = None  # the step timing restarted after (restart)
        self.restarted_why: str | None = None

    @property
    def first_step(self) -> int:
        return self.start_step + 1 if self._origin is None else self._origin

    def restart(self, step: int, now: float, why: str) -> None:
        """Time the steps after ``step`` afresh and make the estimate again from them: what ran
        before is no guide any more (threads=auto changed the thread count there: the first
        estimate, from steps at both counts, was 4-17x off). ``why`` is said with it."""
        if self._first_done is None:
            return  # the first step has not finished: nothing was measured yet
        self._origin, self._first_done, self._measured = step, now, (0, 0.0)
        self.estimate, self.restarted_why = None, why

    def start(self, now: float) -> None:
        self.started = now

    def step_done(self, step: int, now: float) -> RunEstimate | None:
        """Record that ``step`` finished at ``now``; return the run's estimate when it is made
        by this step (once per run), else None."""
        if self._first_done is None:
            self._first_done, self.first_step_s = now, now - self.started
            return None
        self._measured = (step - self.first_step, now - self._first_done)
        steps, seconds = self._measured
        if self.estimate is not None or steps <= 0:
            return None
        if steps >= self.ESTIMATE_STEPS or seconds >= self.ESTIMATE_AFTER_S:
            self.estimate = RunEstimate(
                self.total_steps - self.start_step,
                steps,
                seconds,
                self.first_step + 1,
                now - self.started,
            )
            return self.estimate
        return None

    @property
    def step_s(self) -> float | None:
        """Seconds per step after the first; the first step's until a second one finished."""
        steps, seconds = self._measured
        return seconds / steps if steps > 0 else self.first_step_s

    def remaining_s(self, step: int) -> float | None:
        """Seconds left after ``step`` at :attr:`step_s`; None before the first step finished."""
        step_s = self.step_s
        return None if step_s is None else step_s * (self.total_steps - step)

    def elapsed_s(self, now: float) -> float:
        return now - self.started


@dataclass(frozen=True)
class SlowPath:
    """A precision known to be far slower than FP32 on this device, and what to use instead."""

    what: str  # "FP16 convolutions are a slow path on this CPU"
    precision: str  # the precision that runs, e.g. "fp16"
    faster: str  # "precision=bf16 (or fp32)"
    fp32_step_s: float | None  # one FP32 step of the same model and batch; None: not timed
    not_timed: str | None = None  # why FP32 was not timed (e.g. "compile=true")


def slow_path_note(slow: SlowPath, step_s: float) -> str:
    """One line: what is slow, the run's first step against FP32's (their ratio), the faster
    choice. ``step_s`` is the run's first step (one-off costs included on both sides)."""
    took = f"one step took {step_s:.3g} s in {slow.precision}"
    if slow.fp32_step_s is None:
        took += f" (FP32 not timed: {slow.not_timed})"
    else:
        ratio = step_s / slow.fp32_step_s if slow.fp32_step_s > 0 else float("inf")
        took += f" vs {slow.fp32_step_s:.3g} s in fp32 ({_ratio_text(ratio)}×)"
    return f"{slow.what}: {took}; {slow.faster} is the fast choice here"


def slow_path_so_far_note(slow: SlowPath, step: int, running_s: float) -> str | None:
    """The note while the run's first step is still under way (the heartbeat's, before
    :func:`slow_path_note` can be given): the step's seconds so far against a whole FP32 step, a
    lower bound of their ratio (rounded down, ``≥``). None when FP32 was not timed: the note after
    the step says why."""
    if slow.fp32_step_s is None or slow.fp32_step_s <= 0:
        return None
    ratio = _ratio_text(running_s / slow.fp32_step_s, at_least=True)
    return (
        f"{slow.what}: step {step} has run {rough_duration(running_s, down=True)} in "
        f"{slow.precision} so far vs {slow.fp32_step_s:.3g} s for a whole fp32 step (≥{ratio}×); "
        f"{slow.faster} is the fast choice here"
    )


def _ratio_text(ratio: float, at_least: bool = False) -> str:
    """``66`` from 10 on, ``3.4`` below; to the nearest, or with ``at_least`` rounded down (the
    text of a lower bound must not exceed it)."""
    digits = 0 if ratio >= 10 else 1
    if at_least and math.isfinite(ratio):
        ratio = math.floor(ratio * 10**digits + FLOOR_SLACK) / 10**digits
    return f"{ratio:.{digits}f}"
