"""A run's precision as one object (issue 40; Lightning's precision plugin is the model): the
policy that says what runs, and everything that carries it out — the loss scaler, the FP8 and
block-scaled layers' report sections and their distributed sync, the weight-update rule of the
pure precisions (``precision.update``), the modules kept in FP32 and the TF32 flags.

The training loop touches the precision only through these calls, in this order per step:

- :meth:`Precision.begin` once before the first step (FP8's distributed sync starts);
- :meth:`Precision.count_quantizations` on/off around the forward and backward of a step that
  writes a metrics row (block-scaled layers count saturated, underflowed and zero blocks);
- per micro-batch, :meth:`Precision.model_input`, the forward under
  :meth:`Precision.forward_context` (autocast), ``Precision.scale(loss).backward()``;
- :meth:`Precision.after_backward` (data-parallel FP8: amaxes and counters agree over ranks),
  :meth:`Precision.unscale` before clipping, the optimizer step (the loop's, since it owns the
  skip rule's one host read), :meth:`Precision.after_optimizer_step` (torchao's FP8 all-gather:
  the weights' next scales).

The build calls :meth:`Precision.convert_module`, :meth:`Precision.sync_layers` and
:meth:`Precision.setup`, in that order; a checkpoint holds :meth:`Precision.state_dict`; a
precision schedule (:mod:`mptrain.train.switch`) swaps the run's whole object at the switch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.format_table import PRECISION_OF_GROUP
from mptrain.config.run import RunConfig
from mptrain.data.batches import DataBundle
from mptrain.platform.distributed import DistContext
from mptrain.precision.formats import convert_layers, layer_sync, run_sections
from mptrain.precision.policy import (
    PrecisionPolicy,
    build_grad_scaler,
    keep_in_fp32,
    to_model_input,
)
from mptrain.precision.quant.convert import BlockLayers
from mptrain.precision.quant.dist import FP8Sync
from mptrain.precision.update import WeightUpdate, build_weight_update


@dataclass
class Precision:
    """One run's precision (see the module doc). ``fp8``: the report's fp8 section (converted
    layers, FLOPs share), None without FP8 layers; ``blocks``: the block-scaled layers (their
    report section, counting, generators); ``fp32_modules``: the modules kept in FP32 by
    ``numerics.fp32_modules``; ``tf32``: the TF32 flags as set (report)."""

    policy: PrecisionPolicy
    scaler: torch.amp.GradScaler = field(default_factory=lambda: torch.amp.GradScaler("cpu", False))
    tf32: dict[str, Any] = field(default_factory=dict)
    fp8: dict[str, Any] | None = None
    fp32_modules: list[str] = field(default_factory=list)
    fp8_sync: FP8Sync = field(default_factory=FP8Sync)
    blocks: BlockLayers = field(default_factory=BlockLayers)
    update: WeightUpdate | None = None  # precision.update's hooks on the optimizer; None: nearest

    # ---------------------------------------------------------------------------- the build
    def convert_module(
        self,
        model: nn.Module,
        cfg: RunConfig,
        data: DataBundle,
        device: torch.device,
        fsdp: bool = False,
    ) -> nn.Module:
        """This precision applied to a freshly built, unwrapped ``model``: its Linear layers into
        the layer format's own (:data:`mptrain.precision.formats.LAYER_FORMATS`), the modules of
        ``numerics.fp32_modules`` kept in FP32 (ConfigError when no module name matches), a pure
        precision's parameters cast to its dtype. Sets ``fp8``, ``blocks`` and ``fp32_modules``;
        returns the model. ``device``: the run's (FP32 islands' autocast is turned off for its
        type). ``fsdp``: it will be sharded with FSDP2 (torchao's FP8 all-gather)."""
        section = convert_layers(model, self.policy, cfg, data, fsdp)
        self.fp8, self.blocks = run_sections(model, (self.policy, section))
        patterns = list(cfg.numerics.fp32_modules)
        self.fp32_modules = keep_in_fp32(model, patterns, device.type)
        if patterns and not self.fp32_modules:
            raise ConfigError(
                f"numerics.fp32_modules={patterns}: no module name matches; names look like "
                f"{', '.join(n for n, _ in list(model.named_modules())[1:6])}"
            )
        if not self.policy.master_weights:  # "pure" low precision: no FP32 copy of the weights
            model = model.to(self.policy.param_dtype)
        return model

    def sync_layers(self, model: nn.Module, dist: DistContext, cfg: RunConfig) -> None:
        """What the ranks agree on for the wrapped ``model``'s FP8 layers (recorded in the fp8
        section); nothing for other formats or a single process."""
        self.fp8_sync, self.fp8 = layer_sync(model, dist, cfg, self.policy, self.fp8)

    def setup(
        self,
        optimizer: torch.optim.Optimizer,
        cfg: RunConfig,
        dist: DistContext,
        device: torch.device,
    ) -> None:
        """Once the optimizer exists: ``precision.update``'s hooks on it (its random bits on
        ``device``, the run's) and the loss scaler."""
        self.update = build_weight_update(optimizer, cfg.precision.update, cfg.seed, device)
        self.scaler = build_grad_scaler(self.policy, dist)

    # ---------------------------------------------------------------------------- the loop's calls
    @property
    def loss_scaling(self) -> bool:
        """The loss is scaled (FP16): the optimizer step may be skipped on inf/NaN gradients."""
        return self.scaler.is_enabled()

    def begin(self) -> None:
        self.fp8_sync.begin()

    def count_quantizations(self, on: bool) -> None:
        self.blocks.sample(on)

    def model_input(self, inputs: torch.Tensor, channels_last: bool) -> torch.Tensor:
        return to_model_input(inputs, self.policy, channels_last)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.policy.autocast()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: scaled by the loss scale (FP16), else itself. The
        loop calls ``scale(loss).backward()`` outside autocast, AMP's own idiom."""
        return self.scaler.scale(loss)

    def after_backward(self) -> None:
        self.fp8_sync.after_backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients become true FP32 gradients (nothing to do without loss scaling)."""
        if self.loss_scaling:
            self.scaler.unscale_(optimizer)

    def after_optimizer_step(self) -> None:
        self.fp8_sync.after_optimizer_step()

    # ---------------------------------------------------------------------------- checkpoints
    def signs(self, key: str, switch_to: str | None) -> bool:
        """Whether the flattened training setting ``key`` is part of what a checkpoint of this
        precision signs for resume (:func:`mptrain.checkpoint.checkpointer.run_signature`): a
        precision's own settings group (``fp8.*``, ``mx.*``, ``nvfp4.*``) only where that
        precision runs in either phase of the schedule (``switch_to``: its second precision),
        ``precision.switch.*`` only with a schedule, ``precision.name`` never (the signature's
        ``precision`` is the one that ran, not the request); any other key, yes."""
        group = key.partition(".")[0]
        if group in PRECISION_OF_GROUP:
            return PRECISION_OF_GROUP[group] in {self.policy.name, switch_to}
        if key.startswith("precision.switch."):
            return switch_to is not None  # a run without a switch signs as before schedules
        return key != "precision.name"

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's precision entries: the loss scaler's state (None without scaling),
        the block layers' stochastic-rounding generators (nvfp4), precision.update's state."""
        return {
            "scaler": self.scaler.state_dict() if self.loss_scaling else None,
            "blocks": self.blocks.state_dict(),
            "update": self.update.state_dict() if self.update is not None else None,
        }

    def load_state_dict(self, saved: dict[str, Any], path: Path) -> list[str]:
        """Restore :meth:`state_dict`'s entries of the checkpoint at ``path`` (``saved``: its whole
        payload). Notes for the report where a part starts fresh; ConfigError when an FP16 run
        would start from a checkpoint without a loss-scaler state."""
        if self.loss_scaling:
            if saved.get("scaler") is None:
                raise ConfigError(
                    f"resume: {path} holds no loss-scaler state (saved without loss scaling); an "
                    "FP16 run cannot start from an empty scaler. Resume with the checkpoint's "
                    "precision"
                )
            self.scaler.load_state_dict(saved["scaler"])
        notes = self.blocks.load_state_dict(saved.get("blocks") or {})  # older: no such key
        return notes + self._load_update(saved.get("update"))

    def _load_update(self, saved: dict[str, Any] | None) -> list[str]:
        """precision.update's generator and Kahan buffers; a note where the checkpoint holds none
        of this rule's (saved with another rule, allowed by resume_allow_changes): they start
        fresh."""
        if self.update is None:
            return []
        if saved is None or saved.get("rule") != self.update.rule:
            was = "nearest" if saved is None else saved.get("rule")
            return [
                f"precision.update changed ({was} -> {self.update.rule}): its random bits and "
                "Kahan buffers start fresh"
            ]
        self.update.load_state_dict(saved)
        return []
