"""Models from elsewhere: torchvision's registry (``model.arch``), timm (``model.arch``; the
optional ``mptrain[timm]`` extra) and the user's own nn.Module (``model._target_``), each adapted
to the data (first convolution, classifier) with what was done recorded in :class:`ModelFacts`.
None loads pretrained weights.
"""

from __future__ import annotations

import difflib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.models import (
    CustomModelConfig,
    TimmModelConfig,
    TorchvisionModelConfig,
    lm_block_size,
)
from mptrain.config.targets import call_target, check_keys, first_line, locate, offered


# ------------------------------------------------------------------------- models from elsewhere
@dataclass
class ModelFacts:
    """What :func:`build_model` built: where from, the class, and how it was fitted to the data."""

    source: str  # builtin | torchvision | timm | custom | hf
    arch: str | None  # torchvision/timm model name, or the custom _target_; None for builtins
    class_name: str = ""  # module.qualname of the built model
    adaptations: list[str] = field(default_factory=list)
    convolutional: bool = False


# Facts per built model, without touching the user's object; gone with the model.
_FACTS: weakref.WeakKeyDictionary[nn.Module, ModelFacts] = weakref.WeakKeyDictionary()


def _recorded(model: nn.Module, facts: ModelFacts) -> nn.Module:
    _FACTS[model] = facts
    return model


def _suggest(name: str, names: list[str]) -> str:
    """``; did you mean a, b?`` for close matches of ``name``, or nothing."""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _with_optional_size(
    create: Any, size_key: str, size: Any, adaptations: list[str], **kwargs: Any
) -> nn.Module:
    """``create(**kwargs, size_key=size)`` when the architecture's class names ``size_key`` in its
    constructor (ViTs build their position table from it; recorded), else ``create(**kwargs)``.
    The class is found by building on the meta device (no memory, no weights initialised); many
    classes swallow unknown keywords in ``**kwargs``, so accepting the call proves nothing."""
    try:
        with torch.device("meta"):
            probe = create(**kwargs)
        takes_size = size_key in inspect.signature(type(probe).__init__).parameters
    except Exception:  # an init that cannot run on meta: build without the size
        takes_size = False
    if not takes_size:
        return create(**kwargs)
    adaptations.append(f"{size_key}={size} passed for the dataset's images")
    return create(**kwargs, **{size_key: size})


def adapt_first_conv(model: nn.Module, in_channels: int) -> list[str]:
    """Replace the first Conv2d when it does not take ``in_channels`` (same kernel, stride,
    padding; fresh weights). Returns what was done; ConfigError when there is no Conv2d to adapt."""
    first = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)
    if first is None:
        if in_channels == 3:
            return []
        raise ConfigError(f"no Conv2d first layer to adapt to {in_channels} input channels")
    name, conv = first
    if conv.in_channels == in_channels:
        return []
    if conv.groups != 1:
        raise ConfigError(
            f"first Conv2d {name} is grouped; cannot adapt it to {in_channels} channels"
        )
    replacement = nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
    )
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, replacement)
    plural = "s" if in_channels != 1 else ""
    return [f"{name} (Conv2d) replaced for {in_channels} input channel{plural}"]


# torchvision models whose training-mode forward returns auxiliary outputs besides the logits:
# the loop takes one tensor, so they are built without them.
_TORCHVISION_SINGLE_OUTPUT = frozenset({"inception_v3", "googlenet"})


def build_torchvision(
    cfg: TorchvisionModelConfig, in_channels: int, image_size: int, num_classes: int
) -> nn.Module:
    """``torchvision.models.get_model(arch, weights=None, num_classes=...)``; ``image_size``
    passed to the architectures that take it (ViTs); the first Conv2d adapted to the channels."""
    import torchvision

    arch = cfg.arch
    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        raise ConfigError(
            f"model.arch={arch!r}: not a torchvision classification model{_suggest(arch, names)} "
            "(torchvision.models.list_models(module=torchvision.models) lists them)"
        )
    adaptations = [f"classifier built for {num_classes} classes (num_classes={num_classes})"]
    extra = {}
    if arch in _TORCHVISION_SINGLE_OUTPUT:
        extra = {"aux_logits": False, "init_weights": True}
        adaptations.append("aux_logits=False (the training loop takes one output)")
    try:
        model = _with_optional_size(
            torchvision.models.get_model,
            "image_size",
            image_size,
            adaptations,
            name=arch,
            weights=None,
            num_classes=num_classes,
            **extra,
        )
        adaptations += adapt_first_conv(model, in_channels)
    except (ConfigError, TypeError, ValueError, AssertionError, RuntimeError) as exc:
        raise ConfigError(
            f"model.arch={arch!r}: torchvision cannot build it for {in_channels}x{image_size}x"
            f"{image_size} images and {num_classes} classes ({first_line(exc)})"
        ) from exc
    return _recorded(model, ModelFacts("torchvision", arch, adaptations=adaptations))


def build_timm(
    cfg: TimmModelConfig, in_channels: int, image_size: int, num_classes: int
) -> nn.Module:
    """``timm.create_model(arch, pretrained=False, num_classes=..., in_chans=...)`` (timm adapts
    the stem itself); ``img_size`` passed to the architectures that take it."""
    try:
        import timm
    except ImportError as exc:
        raise ConfigError(
            "model=timm: timm is not installed; install it with pip install 'mptrain[timm]'"
        ) from exc
    arch = cfg.arch
    if not timm.is_model(arch):
        raise ConfigError(
            f"model.arch={arch!r}: not a timm model{_suggest(arch, timm.list_models())} "
            "(timm.list_models() lists them)"
        )
    adaptations = [
        f"classifier built for {num_classes} classes (num_classes={num_classes})",
        f"stem built for {in_channels} input channels (in_chans={in_channels})",
    ]
    try:
        model = _with_optional_size(
            timm.create_model,
            "img_size",
            image_size,
            adaptations,
            model_name=arch,
            pretrained=False,
            num_classes=num_classes,
            in_chans=in_channels,
        )
    except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
        raise ConfigError(
            f"model.arch={arch!r}: timm cannot build it for {in_channels}x{image_size}x"
            f"{image_size} images and {num_classes} classes ({first_line(exc)})"
        ) from exc
    return _recorded(model, ModelFacts("timm", arch, adaptations=adaptations))


def build_custom(
    cfg: CustomModelConfig, in_channels: int, image_size: int, num_classes: int
) -> nn.Module:
    """``hydra.utils.instantiate`` of ``model._target_`` with ``model.kwargs`` (the ``+model.*``
    keys), plus what the data says where the constructor names it and the user did not set it
    (the user's value wins): a classifier's ``num_classes``, ``in_channels`` and ``image_size``;
    a language model's (token data: ``in_channels == 0``) ``vocab_size`` and ``block_size``."""
    key, target = "model._target_", cfg._target_
    built = locate(key, target)
    if inspect.isclass(built) and not issubclass(built, nn.Module):
        raise ConfigError(f"{key}={target!r}: {built.__qualname__} is not a torch.nn.Module")
    if not callable(built):
        raise ConfigError(f"{key}={target!r}: a {type(built).__name__}, not an nn.Module class")
    if in_channels == 0:  # token windows (mptrain.data.lm): the window is model.block_size
        facts = {"vocab_size": num_classes, "block_size": lm_block_size(cfg)}
    else:
        facts = {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}
    kwargs = offered(built, dict(cfg.kwargs), facts)
    check_keys(key, target, built, kwargs)
    model = call_target(key, target, kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{key}={target!r}: returned a {type(model).__name__}, not an nn.Module")
    adaptations = [
        f"{name}={value} passed from {'model.block_size' if name == 'block_size' else 'the dataset'}"
        for name, value in kwargs.items()
        if name in facts and name not in cfg.kwargs
    ]
    return _recorded(model, ModelFacts("custom", target, adaptations=adaptations))
