"""The one list of models (:data:`MODELS`: ``model.name`` -> schema and builder) and
:func:`build_model`.

Every builder takes ``(cfg, in_channels, image_size, num_classes)`` and returns an untrained
``nn.Module`` with FP32 parameters (none loads pretrained weights); the precision is applied
afterwards (:meth:`mptrain.precision.plugin.Precision.convert_module`). :func:`build_model` records
what it built and how it fitted it to the data (:func:`model_facts`, the report's ``model``
section) and checks it with one FP32 forward pass of a dummy batch, so that a model that cannot
take the data, or does not return logits of the right shape, is a ConfigError before training.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mptrain.config.base import ConfigError, Option
from mptrain.config.models import (
    CNNConfig,
    CustomModelConfig,
    GPTConfig,
    HFModelConfig,
    MLPConfig,
    ModelConfig,
    ResNetConfig,
    TimmModelConfig,
    TorchvisionModelConfig,
    ViTConfig,
)
from mptrain.config.targets import first_line
from mptrain.models.builtin import build_cnn, build_gpt, build_mlp, build_resnet, build_vit
from mptrain.models.external import (
    _FACTS,
    ModelFacts,
    _recorded,
    build_custom,
    build_timm,
    build_torchvision,
)
from mptrain.models.hf import build_hf
from mptrain.models.task import logits_of

# Each name is also an option file conf/model/<name>.yaml (a test keeps the two in step).
MODELS: dict[str, Option] = {
    "mlp": Option(MLPConfig, build_mlp),
    "cnn": Option(CNNConfig, build_cnn),
    "resnet18": Option(ResNetConfig, build_resnet),
    "resnet50": Option(ResNetConfig, build_resnet),
    "vit": Option(ViTConfig, build_vit),
    "gpt": Option(GPTConfig, build_gpt),
    "torchvision": Option(TorchvisionModelConfig, build_torchvision),
    "timm": Option(TimmModelConfig, build_timm),
    "custom": Option(CustomModelConfig, build_custom),
    "hf": Option(HFModelConfig, build_hf),
}
# Builtin models with convolutions (FP16 convolutions crawl on CPUs); the others are inspected.
CONVOLUTIONAL = frozenset({"cnn", "resnet18", "resnet50"})


def has_convolutions(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is a convolution (1-D, 2-D or 3-D, transposed too)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def config_has_convolutions(cfg: ModelConfig, tokens: bool = False) -> bool:
    """Whether the configured model has convolutions, before the data is known (``mptrain bench``
    skips FP16 on CPUs for them): builtin models by :data:`CONVOLUTIONAL`; torchvision, timm and
    custom models built on the meta device (no memory, no weights initialised) for 3 x 224 x 224
    images and 10 classes, or with ``tokens`` (task=lm) for token windows of a 256-token
    vocabulary, and inspected."""
    if not isinstance(cfg, TorchvisionModelConfig | TimmModelConfig | CustomModelConfig):
        return cfg.name in CONVOLUTIONAL
    shape = (0, 0, 256) if tokens else (3, 224, 10)  # token data: 0 channels (build_custom)
    with torch.device("meta"):
        return has_convolutions(MODELS[cfg.name].build(cfg, *shape))


def build_model(
    cfg: ModelConfig,
    in_channels: int,
    image_size: int,
    num_classes: int,
    device: torch.device | str = "cpu",
    sequence_length: int | None = None,
) -> nn.Module:
    """Build the configured model (FP32 parameters) for the dataset's shape on ``device``, record
    what was built (:func:`model_facts`) and check it with a dummy forward pass on that device
    (:func:`check_forward`: a model with device-only kernels is checked where it will run).
    Token data (``sequence_length`` set): ``num_classes`` is the vocabulary size; its bundle has
    0 channels and image size, by which a builder tells token data (:func:`build_custom`)."""
    model = MODELS[cfg.name].build(cfg, in_channels, image_size, num_classes).to(device)
    facts = _FACTS.get(model) or ModelFacts("builtin", None)
    facts.class_name = f"{type(model).__module__}.{type(model).__qualname__}"
    facts.convolutional = has_convolutions(model)
    _recorded(model, facts)
    if sequence_length is not None:
        check_token_forward(model, _model_key(cfg), sequence_length, num_classes)
    else:
        check_forward(model, _model_key(cfg), in_channels, image_size, num_classes)
    return model


def _model_key(cfg: ModelConfig) -> str:
    """The key that names what was built, for error messages: ``model.arch='resnet34'``, ..."""
    if isinstance(cfg, CustomModelConfig):
        return f"model._target_={cfg._target_!r}"
    if isinstance(cfg, TorchvisionModelConfig | TimmModelConfig):
        return f"model.arch={cfg.arch!r}"
    if isinstance(cfg, HFModelConfig):
        return f"model.config_class={cfg.config_class!r}"
    return f"model={cfg.name}"


def _dry_forward(
    model: nn.Module, key: str, make_input: Callable[[torch.device], torch.Tensor], what: str
) -> tuple[int, ...] | str:
    """One FP32 forward pass of the zero batch ``make_input(device)`` in eval mode (no statistics
    change, no random draws): the shape of its logits (a tensor, or an output's ``.logits``:
    :func:`~mptrain.models.task.logits_of`), or the output type's name when it holds neither;
    ConfigError naming ``key`` when the model raises."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(make_input(next(model.parameters(), torch.zeros(())).device))
    except Exception as exc:  # whatever the model raises: it cannot take this data
        raise ConfigError(f"{key}: a forward pass of {what} failed ({first_line(exc)})") from exc
    finally:
        model.train(was_training)
    try:
        return tuple(logits_of(out).shape)
    except TypeError:
        return f"a {type(out).__name__}"


def check_forward(
    model: nn.Module, key: str, in_channels: int, image_size: int, num_classes: int
) -> None:
    """A dry forward pass of two zero images: ConfigError naming ``key`` unless it returns
    ``(2, num_classes)`` logits."""
    shape = f"{in_channels}x{image_size}x{image_size}"
    got = _dry_forward(
        model,
        key,
        lambda device: torch.zeros(2, in_channels, image_size, image_size, device=device),
        f"the dataset's {shape} images",
    )
    if got != (2, num_classes):
        raise ConfigError(
            f"{key}: returns {got} for a batch of 2 {shape} images; mptrain needs one tensor "
            f"of (batch, num_classes) = (2, {num_classes}) logits"
        )


def check_token_forward(model: nn.Module, key: str, length: int, vocab_size: int) -> None:
    """A dry forward pass of two windows of ``length`` zero token ids (long): ConfigError naming
    ``key`` unless it returns ``(2, length, vocab_size)`` logits (or an object holding them in
    ``.logits``), saying which of the three sizes is wrong."""
    got = _dry_forward(
        model,
        key,
        lambda device: torch.zeros(2, length, dtype=torch.long, device=device),
        f"{length}-token windows",
    )
    expected = (2, length, vocab_size)
    if got == expected:
        return
    if isinstance(got, tuple) and len(got) == 3 and got[:2] == expected[:2]:
        raise ConfigError(
            f"{key}: returns logits over {got[2]} tokens; the data's vocabulary has {vocab_size} "
            "(mptrain passes it as vocab_size to a constructor that names it)"
        )
    raise ConfigError(
        f"{key}: returns {got} for 2 windows of {length} tokens; a language model must "
        f"return (batch, length, vocabulary) = {expected} logits, as a tensor or in .logits"
    )


def model_facts(model: nn.Module) -> ModelFacts | None:
    """What :func:`build_model` recorded for ``model`` (seen through DDP and torch.compile)."""
    for _ in range(4):  # DDP(compile(model)) and similar nestings
        if model in _FACTS:
            return _FACTS[model]
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return None


def compile_counts() -> dict[str, int]:
    """torch.compile's running totals in this process (TorchDynamo's counters): graphs compiled
    and graph breaks. A run reports how much they grew while it ran."""
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
