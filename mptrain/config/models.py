"""The model group's schemas: the base ``ModelConfig`` (``model: ModelConfig`` in Hydra's
structured-config sense) and one subclass per option, each with its ``validate()``; the
builders are :data:`mptrain.models.build.MODELS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING

from mptrain.config.base import (
    at_least,
    check_dropout,
    check_target,
    each_at_least,
    positive,
    require,
    setting,
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
    hidden_sizes: list[int] = setting(
        help="width of each hidden Linear layer", factory=lambda: [256, 256]
    )
    dropout: float = setting(0.0, "dropout after each hidden layer")

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        sizes = self.hidden_sizes
        require(all(h >= 1 for h in sizes), "model.hidden_sizes", sizes, "sizes >= 1")
        check_dropout(self.dropout)


@dataclass
class CNNConfig(ModelConfig):
    name: str = "cnn"
    widths: list[int] = setting(
        help="output channels of each conv block", factory=lambda: [32, 64, 128]
    )
    dropout: float = setting(0.0, "dropout before the classifier")

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
    small_stem: bool | None = setting(
        None,
        (
            "true: 3x3 stride-1 stem without max-pool (8-32 px images); false: ImageNet 7x7/2 + "
            "pool; null: small when input <= 32 px"
        ),
    )


@dataclass
class ViTConfig(ModelConfig):
    name: str = "vit"
    patch_size: int = setting(
        2, "square patch side in pixels; the image side must be a multiple of it"
    )
    dim: int = setting(64, "embedding width (a multiple of 16 keeps every Linear FP8-GEMM aligned)")
    depth: int = setting(4, "transformer blocks")
    heads: int = setting(4, "attention heads (dim must be divisible by heads)")
    mlp_ratio: float = setting(4.0, "MLP hidden width = dim x mlp_ratio")
    dropout: float = setting(0.0, "dropout on attention output and MLP")

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
    arch: str = setting(
        "resnet18",
        (
            "the model's name in torchvision's registry: resnet34, efficientnet_b0, "
            "convnext_tiny, vit_b_16, ..."
        ),
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(bool(self.arch.strip()), "model.arch", self.arch, "a torchvision model name")


@dataclass
class TimmModelConfig(ModelConfig):
    """Any timm model by name (timm.create_model, pretrained=False); needs mptrain[timm]."""

    name: str = "timm"
    arch: str = setting(
        "resnet18",
        (
            "the model's name in timm's registry: resnet18, efficientnet_b0, "
            "vit_tiny_patch16_224, ..."
        ),
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(bool(self.arch.strip()), "model.arch", self.arch, "a timm model name")


# Keys a custom option may add with Hydra's ``+model.width=64``: mptrain.cli.registry.to_run_config
# moves every key the schema does not declare into ``kwargs`` (the constructor's arguments).
@dataclass
class GPTConfig(ModelConfig):
    """A decoder-only transformer language model (mptrain.models.gpt); the vocabulary is the data's."""

    name: str = "gpt"
    layers: int = setting(4, "transformer blocks")
    heads: int = setting(4, "attention heads (width must be divisible by heads)")
    width: int = setting(
        128, "embedding width (a multiple of 16 keeps every Linear FP8-GEMM aligned)"
    )
    block_size: int = setting(
        128, "context length in tokens: the training and validation windows are this long"
    )
    dropout: float = setting(0.0, "dropout on embeddings, attention and MLP outputs")
    # Biases in the Linear and LayerNorm layers. True as nanoGPT's model.py GPTConfig
    # (``bias: bool = True``); its train.py, and so its recipes, set ``bias = False``.
    bias: bool = setting(
        True, "biases in the Linear and LayerNorm layers (false: none, as nanoGPT's train.py)"
    )

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
    _target_: str = setting(
        MISSING, "required: the import path of the nn.Module class (or a function returning one)"
    )
    kwargs: dict[str, Any] = setting(
        help="the constructor's keyword arguments (any key the schema does not declare lands here)",
        factory=dict,
    )
    # None: LM_BLOCK_SIZE (mptrain.config.run refuses it for a classifier).
    block_size: int | None = setting(
        None, "task=lm only: the window length in tokens, passed to a constructor that names it"
    )

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
    config_class: str = setting(
        "GPT2Config",
        "a configuration class of transformers by name: GPT2Config, LlamaConfig, ...",
    )
    config: dict[str, Any] = setting(help="the model config's keyword arguments", factory=dict)
    block_size: int = setting(
        128, "context length in tokens: the windows and the position table are this long"
    )

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
