"""Where the loop's time goes: samples/s after warm-up (:class:`Throughput`), the split between
training, evaluations and checkpoint writes (:class:`LoopTime`), and the stopwatch that pauses
for what is not training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mptrain.platform import hardware


@dataclass
class Throughput:
    """Training samples and time after warm-up, evaluation excluded."""

    measured_steps: int = 0
    measured_samples: int = 0
    measured_time_s: float = 0.0
    data_wait_s: float = 0.0
    # (steps, seconds) of each metrics-row interval measured whole (every step after warm-up),
    # timed to the row's device read: the spread of the run's speed (mptrain.commands.spread).
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
