"""Optimizer and learning-rate schedule builders.

Optimizer state is created lazily by torch in the dtype of the parameters: FP32 in every mixed
recipe (master weights), so moments and momentum buffers are FP32 too; FP16/BF16 in the "pure"
precisions (fp16_pure, bf16_pure), whose point is to show what that costs. The schedule is a pure function of the number
of *applied* optimizer steps: the loop calls ``scheduler.step()`` only after a step that was not
skipped by the loss scaler.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from mptrain.config.base import Option
from mptrain.config.optim import AdamWConfig, OptimizerConfig, SchedulerConfig, SGDConfig


def parameter_groups(
    model: nn.Module, weight_decay: float, decay_norm_and_bias: bool
) -> list[dict]:
    """Split parameters so biases and normalisation weights (1-D tensors) get no weight decay."""
    if decay_norm_and_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _implementation(fused: bool) -> dict[str, bool]:
    # Fused kernels update every parameter in one call, on CUDA and (torch >= 2.4) on CPU: on the
    # digits MLP a fused AdamW step is ~28% faster than torch's CPU default (single-tensor).
    return {"fused": True} if fused else {"foreach": True}


def optimizer_implementation(optimizer: torch.optim.Optimizer) -> str:
    """fused | foreach | single-tensor: what the optimizer actually runs (for the report)."""
    if optimizer.defaults.get("fused"):
        return "fused"
    return "foreach" if optimizer.defaults.get("foreach") else "single-tensor"


def _sgd(cfg: SGDConfig, groups: list[dict], implementation: dict[str, bool]) -> torch.optim.SGD:
    return torch.optim.SGD(
        groups,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        **implementation,
    )


def _adamw(
    cfg: AdamWConfig, groups: list[dict], implementation: dict[str, bool]
) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **implementation,
    )


# The one list of optimizers: optimizer.name -> its schema and builder (conf/optimizer/<name>.yaml).
OPTIMIZERS: dict[str, Option] = {
    "sgd": Option(SGDConfig, _sgd),
    "adamw": Option(AdamWConfig, _adamw),
}


def build_optimizer(
    cfg: OptimizerConfig, model: nn.Module, fused: bool = True
) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters; fused kernels unless ``fused=False``
    (FSDP's sharded parameters take the foreach implementation)."""
    groups = parameter_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    return OPTIMIZERS[cfg.name].build(cfg, groups, _implementation(fused))


# ---------------------------------------------------------------------------------- schedules
# A schedule: (cfg, warm-up steps, total steps, steps per epoch) -> the lr factor after warm-up,
# as a function of the number of applied optimizer steps.
Decay = Callable[[int], float]


def _constant(cfg: SchedulerConfig, warmup: int, total_steps: int, steps_per_epoch: int) -> Decay:
    return lambda step: 1.0


def _cosine(cfg: SchedulerConfig, warmup: int, total_steps: int, steps_per_epoch: int) -> Decay:
    span = max(total_steps - warmup, 1)

    def factor(step: int) -> float:
        progress = min((step - warmup) / span, 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * cosine

    return factor


def _multistep(cfg: SchedulerConfig, warmup: int, total_steps: int, steps_per_epoch: int) -> Decay:
    milestones = [round(m * steps_per_epoch) for m in cfg.milestones]
    return lambda step: cfg.gamma ** sum(step >= m for m in milestones)


# The one list of schedules: scheduler.name -> its schema and decay (conf/scheduler/<name>.yaml).
SCHEDULES: dict[str, Option] = {
    "constant": Option(SchedulerConfig, _constant),
    "cosine": Option(SchedulerConfig, _cosine),
    "multistep": Option(SchedulerConfig, _multistep),
}


def lr_factor_fn(
    cfg: SchedulerConfig, steps_per_epoch: int, total_steps: int
) -> Callable[[int], float]:
    """The lr multiplier as a function of the number of applied optimizer steps so far: linear
    warm-up from ``warmup_start_factor`` over ``warmup_steps`` (or ``warmup_epochs`` of
    ``steps_per_epoch``), then the named schedule."""
    warmup = (
        cfg.warmup_steps
        if cfg.warmup_steps is not None
        else round(cfg.warmup_epochs * steps_per_epoch)
    )
    decay = SCHEDULES[cfg.name].build(cfg, warmup, total_steps, steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            start = cfg.warmup_start_factor
            return start + (1.0 - start) * step / warmup
        return decay(step)

    return factor


def build_scheduler(
    cfg: SchedulerConfig,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    total_steps: int,
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_factor_fn(cfg, steps_per_epoch, total_steps)
    )
