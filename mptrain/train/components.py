"""A run ready to train (:class:`Run`): what :func:`mptrain.train.build.build_run` makes and the
loop consumes; and a run's precision schedule when it has none (:class:`PrecisionSchedule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mptrain.config.run import RunConfig
from mptrain.data.batches import DataBundle
from mptrain.models.task import Task
from mptrain.platform.distributed import DistContext, unwrap
from mptrain.precision.plugin import Precision
from mptrain.train.monitor import LossWindow, Monitor
from mptrain.train.state import LoopSettings, LoopState
from mptrain.train.threads import ThreadChoice


class PrecisionSchedule:
    """A run without ``precision.switch``: every call does nothing. A switch from one precision
    to another during the run is :class:`mptrain.train.switch.Switch`, with the same calls."""

    emulated = False  # phase 2 ran emulated (its speed is not comparable)
    say: Callable[[str], None] | None = None  # the job's one line at the switch (job sets it)

    def before_step(self, run: Run, steps_done: int) -> None:
        """Before each optimizer step (``steps_done`` steps finished)."""

    def loss_window(self) -> LossWindow | None:
        """The steps whose losses the monitor keeps for :meth:`describe`."""
        return None

    def state_dict(self) -> dict[str, Any] | None:
        """A checkpoint's record of the schedule (which phase it was saved in)."""
        return None

    def load_state_dict(self, run: Run, saved: dict[str, Any] | None) -> list[str]:
        """Before a checkpoint's states load into ``run``: its phase. Returns notes."""
        return []

    def describe(self, run: Run, state: LoopState) -> dict[str, Any] | None:
        """The report's ``precision.switch``."""
        return None


@dataclass
class Run:
    """A run ready to train: its components, its decisions, and its progress (``state``)."""

    cfg: RunConfig
    device: torch.device
    precision: Precision  # what runs and how: policy, loss scaler, FP8/block layers, FP32 islands
    dist: DistContext
    data: DataBundle
    model: torch.nn.Module  # what the loop calls (wrapped, torch.compile'd when compile=true)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets)
    settings: LoopSettings
    monitor: Monitor
    num_parameters: int
    task: Task = field(default_factory=Task)  # the loss's shape, metrics and ranking
    state: LoopState = field(default_factory=LoopState)
    threads: ThreadChoice | None = None  # the intra-op thread count set for the run (build_run)
    # precision.switch: swaps ``precision`` for phase 2's between two steps
    schedule: PrecisionSchedule = field(default_factory=PrecisionSchedule)

    @property
    def checkpoint_model(self) -> torch.nn.Module:
        """The module whose state a checkpoint holds: FSDP's sharded one, else the user's."""
        return self.model if self.dist.strategy == "fsdp" else unwrap(self.model)
