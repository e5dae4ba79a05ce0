"""Optimizer and learning-rate schedule builders.

Optimizer state is created lazily by torch in the dtype of the parameters: FP32 in every mixed
recipe (master weights), so moments and momentum buffers are FP32 too; FP16/BF16 in the "pure"
precisions (fp16_pure, bf16_pure), whose point is to show what that costs. AdamW's moments can be
stored in BF16 under any precision (``optimizer.state_dtype=bf16``: :class:`AdamWLowState`, as
torchtitan and DeepSeek-V3 keep them). The schedule is a pure function of the number of *applied*
optimizer steps: the loop calls ``scheduler.step()`` only after a step that was not skipped by the
loss scaler.
"""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mptrain.config.base import ConfigError, Option
from mptrain.config.optim import (
    AdamWConfig,
    LowBitAdamWConfig,
    OptimizerConfig,
    SchedulerConfig,
    SGDConfig,
)
from mptrain.precision.rounding import stochastic_round


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
    # Fused kernels update every parameter in one call, on CUDA and (torch >= 2.4) on CPU: faster
    # than torch's CPU default (single-tensor; BENCHMARKS.md).
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


def _adam_settings(cfg: AdamWConfig | LowBitAdamWConfig) -> dict[str, Any]:
    """The hyperparameters every AdamW here takes (torch's, ours, torchao's)."""
    betas = (cfg.betas[0], cfg.betas[1])
    return {"lr": cfg.lr, "betas": betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}


def _adamw(
    cfg: AdamWConfig, groups: list[dict], implementation: dict[str, bool]
) -> torch.optim.Optimizer:
    if cfg.state_dtype != "fp32":
        stochastic = cfg.state_rounding == "stochastic"
        return AdamWLowState(groups, **_adam_settings(cfg), stochastic=stochastic)
    return torch.optim.AdamW(groups, **_adam_settings(cfg), **implementation)


class AdamWLowState(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's single-tensor update) whose moments are stored in BF16: each
    step reads them into FP32, updates them and the parameter there, and stores them back rounded
    to nearest or, with ``stochastic``, unbiasedly (:func:`mptrain.precision.rounding.stochastic_round`,
    from a generator seeded by ``torch.initial_seed()``, saved in the state dict).

    Half the state's bytes of FP32 moments. A checkpoint holds the BF16 moments; torch's
    ``load_state_dict`` casts them to the parameters' dtype, and the next step stores them back in
    BF16 (exactly: they were BF16 values), so a resumed run continues bit for bit.
    """

    STATE_DTYPE = torch.bfloat16
    RNG_KEY = "mptrain_state_rounding_rng"

    def __init__(
        self,
        params: list[dict],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        stochastic: bool = False,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.stochastic = stochastic
        device = self.param_groups[0]["params"][0].device  # the parameters' device, its bits
        self.generator = torch.Generator(device).manual_seed(torch.initial_seed())

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        assert closure is None, "AdamWLowState takes no closure"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.STATE_DTYPE)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.STATE_DTYPE)
        grad = p.grad.float()
        exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["step"] += 1
        step = state["step"].item()
        p.mul_(1 - lr * group["weight_decay"])
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        p.addcdiv_(exp_avg.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1**step))
        state["exp_avg"], state["exp_avg_sq"] = self._stored(exp_avg), self._stored(exp_avg_sq)

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        if self.stochastic:
            return stochastic_round(x, generator=self.generator)
        return x.to(self.STATE_DTYPE)

    def state_dict(self) -> dict:
        return {**super().state_dict(), self.RNG_KEY: self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        if self.RNG_KEY in state_dict:
            self.generator.set_state(state_dict.pop(self.RNG_KEY))
        super().load_state_dict(state_dict)


# optimizer=<name> -> torchao.optim's class: AdamW with block-wise quantized moments (torchao's
# README: ViT-H 12.23 -> 8.33 GB with AdamW8bit). Real library code, imported when asked for.
LOW_BIT = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw_fp8": "AdamWFp8"}


def _low_bit_adamw(
    cfg: LowBitAdamWConfig, groups: list[dict], implementation: dict[str, bool]
) -> torch.optim.Optimizer:
    try:
        import torchao.optim
    except ImportError as exc:
        raise ConfigError(
            f"optimizer={cfg.name}: needs torchao, which is not installed (pip install torchao); "
            "or optimizer=adamw (optimizer.state_dtype=bf16 halves its states without it)"
        ) from exc
    return getattr(torchao.optim, LOW_BIT[cfg.name])(groups, **_adam_settings(cfg))


# The one list of optimizers: optimizer.name -> its schema and builder (conf/optimizer/<name>.yaml).
OPTIMIZERS: dict[str, Option] = {
    "sgd": Option(SGDConfig, _sgd),
    "adamw": Option(AdamWConfig, _adamw),
    **{name: Option(LowBitAdamWConfig, _low_bit_adamw) for name in LOW_BIT},
}


def build_optimizer(
    cfg: OptimizerConfig, model: nn.Module, fused: bool = True
) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters; fused kernels unless ``fused=False``
    (FSDP's sharded parameters take the foreach implementation)."""
    groups = parameter_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    return OPTIMIZERS[cfg.name].build(cfg, groups, _implementation(fused))


def state_dtypes(optimizer: torch.optim.Optimizer) -> list[str] | None:
    """The dtypes the optimizer's state is stored in, sorted, step counters left out (torchao's
    quantized states: their codes' and scales'); None before its first step."""
    tensors = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    if not tensors:
        return None
    found = set()
    for t in tensors:
        subclass = is_traceable_wrapper_subclass(t)  # DTensor's shard, torchao's codes and scales
        inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]] if subclass else [t]
        found |= {str(x.dtype) for x in inner if torch.is_tensor(x)}
    return sorted(d.removeprefix("torch.") for d in found)


def copy_for(
    optimizer: torch.optim.Optimizer, original: nn.Module, copy_of_it: nn.Module
) -> torch.optim.Optimizer:
    """A fresh copy of ``optimizer`` over the parameters of ``copy_of_it`` (a deep copy of
    ``original``), with an empty state and no hooks (``precision.update``'s stay the run's): its
    own attributes kept (``copy.deepcopy`` of an optimizer keeps only torch's state and groups,
    so torchao's settings would be lost), random generators copied (the original's untouched),
    each group's hyperparameters as they are."""
    params = dict(zip(map(id, original.parameters()), copy_of_it.parameters(), strict=True))
    own = {
        k: copy.deepcopy(v) if isinstance(v, torch.Generator) else v
        for k, v in vars(optimizer).items()
        if not k.startswith("_optimizer_") and k not in ("step", "state", "param_groups")
    }
    groups = [
        {**group, "params": [params[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    fresh = object.__new__(type(optimizer))
    # torch's own: empty hooks, the step function patched (as a deep copy would get them)
    fresh.__setstate__({**own, "state": collections.defaultdict(dict), "param_groups": groups})
    return fresh


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
