"""Where a run is: the loop's schedule (:class:`LoopSettings`) and its counters (:class:`LoopState`).

Plain data, shared by the loop, the monitor, checkpoints, observers and the report. Measurements
(throughput, scale history, health) belong to :class:`mptrain.train.monitor.Monitor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mptrain.platform.distributed import DistContext


@dataclass(frozen=True)
class LoopSettings:
    """The loop's schedule: how long, how the batch is split, and what is due when."""

    total_steps: int
    steps_per_epoch: int
    length: str = ""  # which limit ends the run: "max_steps=2000", "15 epochs", ...
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    eval_every: int | None = None  # with eval_every_minutes None: at the end of every epoch
    eval_every_minutes: float | None = None
    log_every: int = 50
    # The gradient/update probe's cadence (it costs a copy of the parameters and states).
    probe_every: int | None = 100
    channels_last: bool = False
    dist: DistContext = field(default_factory=DistContext)


@dataclass
class LoopState:
    """Where the run is: counters, skipped steps and evaluations (measurements: the monitor)."""

    step: int = 0  # optimizer steps attempted (applied + skipped)
    epoch: int = 0
    samples_seen: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    last_train_loss: float | None = None
    stopped: bool = False  # stopped on request (a signal) after finishing a step
    # Distributed runs: the ranks that asked to stop, each with its signal's number (STOP_ASKED:
    # asked without one), agreed by every rank at the step they stopped after.
    stop_signals: dict[int, int] = field(default_factory=dict)
    evaluating: bool = False  # inside an evaluation (a second signal may abandon it there)

    def advance(self, skipped: bool, samples: int, steps_per_epoch: int) -> bool:
        """Count one finished optimizer step; True when it ended an epoch."""
        self.step += 1
        if skipped:
            self.skipped_steps.append(self.step)
        self.samples_seen += samples
        end_of_epoch = self.step % steps_per_epoch == 0
        if end_of_epoch:
            self.epoch += 1
        return end_of_epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
            "skipped_steps": list(self.skipped_steps),
            "evals": list(self.evals),
            "last_train_loss": self.last_train_loss,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.step, self.epoch = saved["step"], saved["epoch"]
        self.samples_seen = saved["samples_seen"]
        self.skipped_steps = list(saved["skipped_steps"])
        self.evals = list(saved["evals"])
        self.last_train_loss = saved["last_train_loss"]
