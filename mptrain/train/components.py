"""A run ready to train: what :func:`mptrain.train.build.build_run` makes and the loop consumes.

:class:`Run` holds the built components (data, model, optimizer, schedule, scaler, the task's loss), the
decisions made for them (device, precision policy, TF32 flags, FP8 and block-scaled layers, FP32
islands), the
loop's settings, the monitor, and the run's progress (``state``).
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
from mptrain.platform.threads import ThreadChoice
from mptrain.precision.blocks.convert import BlockLayers
from mptrain.precision.fp8.dist import FP8Sync
from mptrain.precision.policy import PrecisionPolicy
from mptrain.train.monitor import Monitor
from mptrain.train.state import LoopSettings, LoopState


@dataclass
class Run:
    """A run ready to train: its components, its decisions, and its progress (``state``)."""

    cfg: RunConfig
    device: torch.device
    policy: PrecisionPolicy
    dist: DistContext
    tf32: dict[str, Any]  # the TF32 flags as set (report)
    data: DataBundle
    model: torch.nn.Module  # what the loop calls (wrapped, torch.compile'd when compile=true)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets)
    settings: LoopSettings
    monitor: Monitor
    num_parameters: int
    task: Task = field(default_factory=Task)  # the loss's shape, metrics and ranking
    fp8: dict[str, Any] | None = None  # the report's fp8 section (converted layers, FLOPs share)
    fp32_modules: list[str] = field(default_factory=list)
    fp8_sync: FP8Sync = field(default_factory=FP8Sync)  # FP8 state the ranks agree on (loop calls)
    # Block-scaled layers (mxfp8, nvfp4, blockwise fp8): counting on log rows, their generators
    blocks: BlockLayers = field(default_factory=BlockLayers)
    state: LoopState = field(default_factory=LoopState)
    threads: ThreadChoice | None = None  # the intra-op thread count set for the run (build_run)

    @property
    def checkpoint_model(self) -> torch.nn.Module:
        """The module whose state a checkpoint holds: FSDP's sharded one, else the user's."""
        return self.model if self.dist.strategy == "fsdp" else unwrap(self.model)
