"""The optimizer and scheduler groups' schemas and their range rules; the builders are
:data:`mptrain.train.optim.OPTIMIZERS` and :data:`mptrain.train.optim.SCHEDULES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import MISSING

from mptrain.config.base import (
    Accepts,
    check_settings,
    in_range_rule,
    non_negative_rule,
    one_of_rule,
    positive_rule,
    require,
    setting,
)

STATE_DTYPES = ("fp32", "bf16")  # optimizer.state_dtype
STATE_ROUNDINGS = ("nearest", "stochastic")  # optimizer.state_rounding
NON_NEGATIVE_FINITE = Accepts(lambda v: 0 <= v < math.inf, "must be >= 0 and finite")


# -------------------------------------------------------------------------------------- optimizers
@dataclass
class OptimizerConfig:
    """Base of every optimizer schema: what every optimizer takes."""

    name: str = MISSING
    lr: float = MISSING
    weight_decay: float = 0.0
    decay_norm_and_bias: bool = setting(
        False, "false: no weight decay on biases and normalisation parameters"
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        check_settings(self, "optimizer.")  # the rules on the fields
        # lr and weight_decay: each option's schema redeclares them (its own default and help)
        positive_rule().check("optimizer.lr", self.lr)
        NON_NEGATIVE_FINITE.check("optimizer.weight_decay", self.weight_decay)


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = "sgd"
    lr: float = setting(0.1, "peak learning rate (after warm-up)")
    momentum: float = setting(
        0.9,
        "momentum factor",
        accepts=NON_NEGATIVE_FINITE,
    )
    nesterov: bool = setting(False, "Nesterov momentum")
    weight_decay: float = setting(5e-4, "L2 weight decay")

    def validate(self) -> None:
        super().validate()
        require(
            not self.nesterov or self.momentum > 0,
            "optimizer.nesterov",
            self.nesterov,
            "needs momentum > 0",
        )


@dataclass
class AdamBase(OptimizerConfig):
    """What every AdamW option takes (torch's, and torchao's low-bit ones)."""

    lr: float = setting(3e-3, "peak learning rate (after warm-up)")
    betas: list[float] = setting(
        help="moment decay rates",
        factory=lambda: [0.9, 0.999],
        accepts=Accepts(
            lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1)"
        ),
    )
    eps: float = setting(1e-8, "denominator epsilon", accepts=positive_rule())
    weight_decay: float = setting(0.01, "decoupled weight decay")


@dataclass
class AdamWConfig(AdamBase):
    name: str = "adamw"
    state_dtype: str = setting(
        "fp32",
        "the moments' dtype: fp32 | bf16 (half the state's bytes; each step updates them in FP32 "
        "and stores them back)",
        accepts=one_of_rule(STATE_DTYPES),
    )
    state_rounding: str = setting(
        "nearest",
        "state_dtype=bf16: how the updated moments are stored, nearest | stochastic (unbiased, "
        "seeded; mptrain.precision.rounding)",
        accepts=one_of_rule(STATE_ROUNDINGS),
    )


@dataclass
class LowBitAdamWConfig(AdamBase):
    """torchao's AdamW with 8-bit, 4-bit or FP8 moments (optimizer=adamw8bit | adamw4bit |
    adamw_fp8; mptrain.train.optim.LOW_BIT): block-wise quantized states, updated in FP32."""

    name: str = MISSING


@dataclass
class SchedulerConfig:
    """The LR schedule by name (mptrain.train.optim.SCHEDULES), with linear warm-up for all."""

    name: str = "cosine"
    warmup_epochs: float = setting(
        0.0, "linear warm-up length in epochs (fractions allowed)", accepts=non_negative_rule()
    )
    warmup_steps: int | None = setting(
        None,
        "or in optimizer steps (step-based runs, task=lm); with warmup_epochs=0",
        accepts=non_negative_rule(optional=True),
    )
    warmup_start_factor: float = setting(
        0.1, "lr at the first step = this x peak lr", accepts=in_range_rule("(0, 1]")
    )
    min_lr_factor: float = setting(
        0.0, "cosine only: final lr = this x peak lr", accepts=in_range_rule("[0, 1]")
    )
    milestones: list[float] = setting(
        help="multistep only: epochs at which lr is multiplied by gamma",
        factory=list,
        accepts=Accepts(
            lambda v: list(v) == sorted(v) and all(m > 0 for m in v),
            "increasing epoch numbers > 0",
        ),
    )
    gamma: float = setting(
        0.1, "multistep only: decay factor per milestone", accepts=in_range_rule("(0, 1]")
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        check_settings(self, "scheduler.")  # the rules on the fields
        require(
            self.warmup_steps is None or self.warmup_epochs == 0,
            "scheduler.warmup_steps",
            self.warmup_steps,
            f"give the warm-up in steps or in epochs, not both (scheduler.warmup_epochs="
            f"{self.warmup_epochs}); set scheduler.warmup_epochs=0",
        )
