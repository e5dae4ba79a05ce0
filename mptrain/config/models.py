"""The model group's schemas: the base ``ModelConfig`` (``model: ModelConfig`` in Hydra's
structured-config sense) and one subclass per option, each key's range rule on its field
(``validate()`` applies them, then the rules across keys); the builders are :data:`mptrain.models.build.MODELS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING

from mptrain.config.base import (
    IMPORT_PATH,
    Accepts,
    at_least_rule,
    check_settings,
    in_range_rule,
    positive_rule,
    require,
    setting,
)

DROPOUT = in_range_rule("[0, 1)")


# ------------------------------------------------------------------------------------------ models
@dataclass
class ModelConfig:
    """Base of every model schema; ``name`` is the option's (mptrain.models.build.MODELS)."""

    name: str = MISSING

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation. Here, the
        rules on the fields; a subclass adds its cross-key rules after them."""
        check_settings(self, "model.")


@dataclass
class MLPConfig(ModelConfig):
    name: str = "mlp"
    hidden_sizes: list[int] = setting(
        help="width of each hidden Linear layer",
        factory=lambda: [256, 256],
        accepts=Accepts(lambda v: all(h >= 1 for h in v), "sizes >= 1"),
    )
    dropout: float = setting(0.0, "dropout after each hidden layer", accepts=DROPOUT)


@dataclass
class CNNConfig(ModelConfig):
    name: str = "cnn"
    widths: list[int] = setting(
        help="output channels of each conv block",
        factory=lambda: [32, 64, 128],
        accepts=Accepts(
            lambda v: len(v) >= 1 and all(w >= 1 for w in v),
            "a non-empty list of channel counts >= 1",
        ),
    )
    dropout: float = setting(0.0, "dropout before the classifier", accepts=DROPOUT)


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
        2,
        "square patch side in pixels; the image side must be a multiple of it",
        accepts=at_least_rule(1),
    )
    dim: int = setting(
        64,
        "embedding width (a multiple of 16 keeps every Linear FP8-GEMM aligned)",
        accepts=at_least_rule(1),
    )
    depth: int = setting(4, "transformer blocks", accepts=at_least_rule(1))
    heads: int = setting(
        4, "attention heads (dim must be divisible by heads)", accepts=at_least_rule(1)
    )
    mlp_ratio: float = setting(4.0, "MLP hidden width = dim x mlp_ratio", accepts=positive_rule())
    dropout: float = setting(0.0, "dropout on attention output and MLP", accepts=DROPOUT)

    def validate(self) -> None:
        super().validate()  # heads >= 1 among them
        require(
            self.dim % self.heads == 0,
            "model.dim",
            self.dim,
            f"must be divisible by model.heads={self.heads}",
        )


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
        accepts=Accepts(lambda v: bool(v.strip()), "a torchvision model name"),
    )


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
        accepts=Accepts(lambda v: bool(v.strip()), "a timm model name"),
    )


@dataclass
class GPTConfig(ModelConfig):
    """A decoder-only transformer language model (mptrain.models.gpt); the vocabulary is the data's."""

    name: str = "gpt"
    layers: int = setting(4, "transformer blocks", accepts=at_least_rule(1))
    heads: int = setting(
        4, "attention heads (width must be divisible by heads)", accepts=at_least_rule(1)
    )
    width: int = setting(
        128,
        "embedding width (a multiple of 16 keeps every Linear FP8-GEMM aligned)",
        accepts=at_least_rule(1),
    )
    block_size: int = setting(
        128,
        "context length in tokens: the training and validation windows are this long",
        accepts=at_least_rule(2),
    )
    dropout: float = setting(
        0.0, "dropout on embeddings, attention and MLP outputs", accepts=DROPOUT
    )
    # True as nanoGPT's model.py GPTConfig; its train.py, and so its recipes, set bias = False.
    bias: bool = setting(
        True, "biases in the Linear and LayerNorm layers (false: none, as nanoGPT's train.py)"
    )

    def validate(self) -> None:
        super().validate()  # heads >= 1 among them
        require(
            self.width % self.heads == 0,
            "model.width",
            self.width,
            f"must be a multiple of model.heads={self.heads}",
        )


# Where an accepts_extra_keys schema's undeclared keys go (mptrain.cli.registry.to_run_config).
EXTRA_KEYS_FIELD = "kwargs"


@dataclass
class CustomModelConfig(ModelConfig):
    """Any importable nn.Module, built by hydra.utils.instantiate from ``_target_`` and ``kwargs``."""

    accepts_extra_keys: ClassVar[bool] = True
    name: str = "custom"
    _target_: str = setting(
        MISSING,
        "required: the import path of the nn.Module class (or a function returning one)",
        accepts=IMPORT_PATH,
    )
    kwargs: dict[str, Any] = setting(
        help="the constructor's keyword arguments (any key the schema does not declare lands here)",
        factory=dict,
    )
    # None: LM_BLOCK_SIZE (mptrain.config.run refuses it for a classifier).
    block_size: int | None = setting(
        None,
        "task=lm only: the window length in tokens, passed to a constructor that names it",
        accepts=at_least_rule(2, optional=True),
    )


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
        accepts=Accepts(
            lambda v: re.fullmatch(r"[A-Za-z_]\w*Config", v) is not None,
            "the name of a transformers configuration class, such as GPT2Config or LlamaConfig",
        ),
    )
    config: dict[str, Any] = setting(help="the model config's keyword arguments", factory=dict)
    block_size: int = setting(
        128,
        "context length in tokens: the windows and the position table are this long",
        accepts=at_least_rule(2),
    )

    def validate(self) -> None:
        super().validate()
        for key in ("vocab_size", "use_cache"):
            require(
                key not in self.config,
                f"model.config.{key}",
                self.config.get(key),
                "set by mptrain (the vocabulary is the data's; no key-value cache in training)",
            )
