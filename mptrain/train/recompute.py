"""Activation checkpointing (``memory.activation_checkpointing``): recompute blocks in the backward.

``full`` checkpoints every transformer or residual block (:func:`blocks`), ``selective`` every
second one (torchtitan's layer-wise selective recomputation), with ``torch.utils.checkpoint`` in
its non-reentrant form: a checkpointed block keeps only its inputs for the backward, and runs its
forward again there, under the same autocast and with the same random state. The gradients
equal a plain step's bit for bit in every format but FP8 with delayed scaling, which is refused:
its forward records the amax history, so a recomputed forward would record it twice (Transformer
Engine issue 1190). Per format, in words: docs/report.md#activation-checkpointing;
tests/train/test_recompute.py compares the bits.

A block's class is swapped for a subclass whose ``forward`` checkpoints (:func:`apply`): module
names, ``state_dict`` keys and checkpoints are those of the plain model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mptrain.config.base import ConfigError

KEY = "memory.activation_checkpointing"
# While the memory accounting counts a step: what a checkpointed block keeps (its inputs).
saving_inputs: list[Callable[[torch.Tensor], Any]] = []


class _Recomputed:
    """Mixin of a checkpointed block: its forward runs under ``torch.utils.checkpoint``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for keep in saving_inputs:
            for a in args:
                if torch.is_tensor(a):
                    keep(a)
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer and residual blocks of ``model``, in order."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    from mptrain.models.builtin import TransformerBlock
    from mptrain.models.gpt import Block

    kinds = (Block, TransformerBlock, BasicBlock, Bottleneck)
    return [m for m in model.modules() if isinstance(m, kinds)]


def recomputed(model: nn.Module) -> int:
    """How many of ``model``'s blocks are checkpointed."""
    return sum(isinstance(m, _Recomputed) for m in model.modules())


def apply(model: nn.Module, mode: str, model_name: str, fp8_scaling: str | None) -> None:
    """Checkpoint ``model``'s blocks as ``mode`` says (see the module doc). ConfigError for a
    model without blocks or FP8 delayed scaling."""
    if mode == "none":
        return
    found = blocks(model)
    if not found:
        raise ConfigError(
            f"{KEY}={mode}: model={model_name} has no transformer or residual blocks to "
            "recompute; checkpointing works on model=gpt, vit, resnet18, resnet50 and "
            "torchvision's ResNets; or none"
        )
    if fp8_scaling == "delayed":
        raise ConfigError(
            f"{KEY}={mode}: fp8.scaling=delayed would record each amax twice (the forward runs "
            "again in the backward); use fp8.scaling=dynamic, or none"
        )
    chosen = found if mode == "full" else found[::2]
    for block in chosen:
        block.__class__ = _recomputed_class(type(block))


@functools.cache  # one checkpointing subclass per block class
def _recomputed_class(cls: type) -> type:
    if issubclass(cls, _Recomputed):
        return cls
    return type(f"Recomputed{cls.__name__}", (_Recomputed, cls), {"__module__": cls.__module__})
