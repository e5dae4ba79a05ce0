"""The optimizer and scheduler groups' schemas and their range rules; the builders are
:data:`mptrain.train.optim.OPTIMIZERS` and :data:`mptrain.train.optim.SCHEDULES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import MISSING

from mptrain.config.base import positive, require


# -------------------------------------------------------------------------------------- optimizers
@dataclass
class OptimizerConfig:
    """Base of every optimizer schema: what every optimizer takes."""

    name: str = MISSING
    lr: float = MISSING
    weight_decay: float = 0.0
    decay_norm_and_bias: bool = False

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        positive("optimizer.lr", self.lr)
        require(
            0 <= self.weight_decay < math.inf,
            "optimizer.weight_decay",
            self.weight_decay,
            "must be >= 0 and finite",
        )


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    decay_norm_and_bias: bool = False

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        super().validate()
        require(
            0 <= self.momentum < math.inf,
            "optimizer.momentum",
            self.momentum,
            "must be >= 0 and finite",
        )
        require(
            not self.nesterov or self.momentum > 0,
            "optimizer.nesterov",
            self.nesterov,
            "needs momentum > 0",
        )


@dataclass
class AdamWConfig(OptimizerConfig):
    name: str = "adamw"
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_norm_and_bias: bool = False

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        super().validate()
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            self.betas,
            "two values in [0, 1)",
        )
        positive("optimizer.eps", self.eps)


@dataclass
class SchedulerConfig:
    """The LR schedule by name (mptrain.train.optim.SCHEDULES), with linear warm-up for all."""

    name: str = "cosine"
    warmup_epochs: float = 0.0
    warmup_steps: int | None = None  # the warm-up in optimizer steps instead (step-based runs)
    warmup_start_factor: float = 0.1
    min_lr_factor: float = 0.0
    milestones: list[float] = field(default_factory=list)
    gamma: float = 0.1

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(
            self.warmup_epochs >= 0, "scheduler.warmup_epochs", self.warmup_epochs, "must be >= 0"
        )
        require(
            self.warmup_steps is None or self.warmup_steps >= 0,
            "scheduler.warmup_steps",
            self.warmup_steps,
            "must be >= 0",
        )
        require(
            self.warmup_steps is None or self.warmup_epochs == 0,
            "scheduler.warmup_steps",
            self.warmup_steps,
            f"give the warm-up in steps or in epochs, not both (scheduler.warmup_epochs="
            f"{self.warmup_epochs}); set scheduler.warmup_epochs=0",
        )
        require(
            0 < self.warmup_start_factor <= 1,
            "scheduler.warmup_start_factor",
            self.warmup_start_factor,
            "must be in (0, 1]",
        )
        require(
            0 <= self.min_lr_factor <= 1,
            "scheduler.min_lr_factor",
            self.min_lr_factor,
            "must be in [0, 1]",
        )
        require(0 < self.gamma <= 1, "scheduler.gamma", self.gamma, "must be in (0, 1]")
        require(
            list(self.milestones) == sorted(self.milestones)
            and all(m > 0 for m in self.milestones),
            "scheduler.milestones",
            self.milestones,
            "increasing epoch numbers > 0",
        )
