"""The model group's schemas: the base ``ModelConfig`` (``model: ModelConfig`` in Hydra's
structured-config sense) and one subclass per option, each with its ``validate()``; the
builders are :data:`mptrain.models.build.MODELS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from mptrain.config.base import (
    at_least,
    check_dropout,
    check_target,
    each_at_least,
    positive,
    require,
)


# ------------------------------------------------------------------------------------------ models
@dataclass
class ModelConfig:
    """Base of every model schema; ``name`` is the option's (mptrain.models.build.MODELS)."""

    name: str = MISSING

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""


@dataclass
class MLPConfig(ModelConfig):
    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    dropout: float = 0.0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        sizes = self.hidden_sizes
        require(all(h >= 1 for h in sizes), "model.hidden_sizes", sizes, "sizes >= 1")
        check_dropout(self.dropout)


@dataclass
class CNNConfig(ModelConfig):
    name: str = "cnn"
    widths: list[int] = field(default_factory=lambda: [32, 64, 128])
    dropout: float = 0.0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(
            len(self.widths) >= 1 and all(w >= 1 for w in self.widths),
            "model.widths",
            self.widths,
            "a non-empty list of channel counts >= 1",
        )
        check_dropout(self.dropout)


@dataclass
class ResNetConfig(ModelConfig):
    name: str = "resnet18"
    small_stem: bool | None = None  # None: small stem when the input is at most 32 px


@dataclass
class ViTConfig(ModelConfig):
    name: str = "vit"
    patch_size: int = 2
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        each_at_least("model", self, ("patch_size", "dim", "depth", "heads"), 1)
        require(
            self.dim % self.heads == 0,
            "model.dim",
            self.dim,
            f"must be divisible by model.heads={self.heads}",
        )
        positive("model.mlp_ratio", self.mlp_ratio)
        check_dropout(self.dropout)


@dataclass
class TorchvisionModelConfig(ModelConfig):
    """Any torchvision classification model by its registry name (torchvision.models.get_model)."""

    name: str = "torchvision"
    arch: str = "resnet18"

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(bool(self.arch.strip()), "model.arch", self.arch, "a torchvision model name")


@dataclass
class TimmModelConfig(ModelConfig):
    """Any timm model by name (timm.create_model, pretrained=False); needs mptrain[timm]."""

    name: str = "timm"
    arch: str = "resnet18"

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(bool(self.arch.strip()), "model.arch", self.arch, "a timm model name")


# Keys a custom option may add with Hydra's ``+model.width=64``: mptrain.compose.registry.to_run_config
# moves every key the schema does not declare into ``kwargs`` (the constructor's arguments).
@dataclass
class GPTConfig(ModelConfig):
    """A decoder-only transformer language model (mptrain.models.gpt); the vocabulary is the data's."""

    name: str = "gpt"
    layers: int = 4
    heads: int = 4
    width: int = 128
    block_size: int = 128  # context length: the training windows are this long
    dropout: float = 0.0
    # Biases in the Linear and LayerNorm layers. True as nanoGPT's model.py GPTConfig
    # (``bias: bool = True``); its train.py, and so its recipes, set ``bias = False``.
    bias: bool = True

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        each_at_least("model", self, ("layers", "heads", "width"), 1)
        at_least("model.block_size", self.block_size, 2)
        require(
            self.width % self.heads == 0,
            "model.width",
            self.width,
            f"must be a multiple of model.heads={self.heads}",
        )
        check_dropout(self.dropout)


EXTRA_KEYS_FIELD = "kwargs"


@dataclass
class CustomModelConfig(ModelConfig):
    """Any importable nn.Module, built by hydra.utils.instantiate from ``_target_`` and ``kwargs``."""

    accepts_extra_keys: ClassVar[bool] = True
    name: str = "custom"
    _target_: str = MISSING
    kwargs: dict[str, Any] = field(default_factory=dict)
    # task=lm only: the window length in tokens, passed as block_size to a constructor that
    # names it; None: LM_BLOCK_SIZE (mptrain.config.run refuses it for a classifier).
    block_size: int | None = None

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        check_target("model._target_", self._target_)
        at_least("model.block_size", self.block_size, 2, allow_none=True)


# The window length of a custom language model that does not set model.block_size: model=gpt's.
LM_BLOCK_SIZE = 128


def lm_block_size(cfg: ModelConfig) -> int:
    """The window length in tokens a language model of ``cfg`` trains on: its ``block_size``,
    or :data:`LM_BLOCK_SIZE` for a custom model that leaves it unset."""
    block_size = getattr(cfg, "block_size", None)
    return LM_BLOCK_SIZE if block_size is None else block_size


@dataclass
class HFModelConfig(ModelConfig):
    """A Hugging Face ``transformers`` causal language model built from its configuration class
    (``AutoModelForCausalLM.from_config``: fresh weights, nothing downloaded); mptrain[hf]."""

    name: str = "hf"
    config_class: str = "GPT2Config"  # a configuration class of transformers, by name
    config: dict[str, Any] = field(default_factory=dict)  # its keyword arguments
    block_size: int = 128  # the window length in tokens; the position table is this long

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(
            re.fullmatch(r"[A-Za-z_]\w*Config", self.config_class) is not None,
            "model.config_class",
            self.config_class,
            "the name of a transformers configuration class, such as GPT2Config or LlamaConfig",
        )
        at_least("model.block_size", self.block_size, 2)
        for key in ("vocab_size", "use_cache"):
            require(
                key not in self.config,
                f"model.config.{key}",
                self.config.get(key),
                "set by mptrain (the vocabulary is the data's; no key-value cache in training)",
            )
