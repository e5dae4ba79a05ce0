"""The loop's clocks: samples/s after warm-up (:class:`Throughput`), the split between training,
evaluations and checkpoint writes (:class:`LoopTime`), the stopwatch that pauses for what is not
training, and when periodic work is due by the clock (:class:`TimeCadence`:
``eval_every_minutes`` and ``checkpoint.every_minutes``).

Step and epoch cadences are exact and the same on every rank. A clock is not: two ranks of a
distributed run would read their clocks at slightly different moments, and a checkpoint (a
collective under FSDP) or an evaluation (an all-reduce) taken by one rank and not the other would
hang the job. So in a distributed run the clock is consulted only at log rows (every
``log_every`` steps), where rank 0's answer is broadcast to all ranks; a single process consults it
after every step (one ``time.monotonic()`` call).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mptrain.platform import hardware
from mptrain.platform.distributed import DistContext, broadcast_flag


@dataclass
class Throughput:
    """Training samples and time after warm-up, evaluation excluded."""

    measured_steps: int = 0
    measured_samples: int = 0
    measured_time_s: float = 0.0
    data_wait_s: float = 0.0
    # (steps, seconds) of each metrics-row interval measured whole (every step after warm-up),
    # timed to the row's device read: the spread of the run's speed (mptrain.pace.spread).
    windows: list[tuple[int, float]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float | None:
        if self.measured_time_s <= 0:
            return None
        return self.measured_samples / self.measured_time_s

    @property
    def data_wait_fraction(self) -> float | None:
        if self.measured_time_s <= 0:
            return None
        return self.data_wait_s / self.measured_time_s


@dataclass
class LoopTime:
    """Where the loop's wall time went, in seconds: steps, evaluations, checkpoint writes."""

    training_s: float = 0.0  # set by Monitor.end: the loop's time minus the pauses inside it
    evaluation_s: float = 0.0
    evaluations: int = 0
    checkpoint_s: float = 0.0
    checkpoints: int = 0

    def add(self, kind: str, seconds: float) -> None:
        """One pause of ``kind`` (evaluation | checkpoint)."""
        setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)
        setattr(self, f"{kind}s", getattr(self, f"{kind}s") + 1)


class Stopwatch:
    """Accumulates time into a :class:`Throughput`; pauses around evaluation.

    On CUDA it synchronises at each start/stop so the interval covers the kernels, not just their
    launch; it runs only at warm-up end, around evaluations and at the end of the run.
    """

    def __init__(self, device: torch.device, throughput: Throughput) -> None:
        self.device = device
        self.throughput = throughput
        self.started_at: float | None = None

    def start(self) -> None:
        hardware.synchronize(self.device)
        self.started_at = time.perf_counter()

    def stop(self) -> None:
        if self.started_at is not None:
            hardware.synchronize(self.device)
            self.throughput.measured_time_s += time.perf_counter() - self.started_at
            self.started_at = None

    @property
    def running(self) -> bool:
        return self.started_at is not None


@dataclass
class Interval:
    """Losses and timing since the last metrics row; read (one device sync) when a row is logged.

    The per-step losses stay on the device as a list (appending costs no kernel); the row sums
    them in one go.
    """

    started: float  # time.perf_counter() at the interval's start, evaluations excluded
    losses: list[torch.Tensor] = field(default_factory=list)
    measured: int = 0  # steps of the interval the throughput counted (after warm-up)

    def restart(self) -> None:
        self.losses.clear()
        self.measured = 0
        self.started = time.perf_counter()


def now() -> float:
    """The clock cadences read (seconds; tests replace it)."""
    return time.monotonic()


class TimeCadence:
    """Due once ``minutes`` have passed since :meth:`restart` (made at construction: the loop's
    start; then each time the work is done). ``minutes=None``: never due."""

    def __init__(self, minutes: float | None) -> None:
        self.minutes = minutes
        self.last = now()

    def restart(self) -> None:
        self.last = now()

    def due(self, step: int, log_every: int, dist: DistContext, device: torch.device) -> bool:
        """Whether the work is due after ``step``, the same answer on every rank (module doc)."""
        if self.minutes is None:
            return False
        if not dist.enabled:
            return self._elapsed()
        if step % log_every:
            return False
        return broadcast_flag(self._elapsed() and dist.is_main, dist, device)

    def _elapsed(self) -> bool:
        return now() - self.last >= 60.0 * self.minutes
