"""Model builders: a registry from model name to a function of plain arguments.

Every builder takes ``(cfg, in_channels, image_size, num_classes)`` and returns an ``nn.Module``
whose parameters are FP32; the precision recipe is applied afterwards (mptrain.train.build: autocast at
run time, FP8 layers, and for the "pure" precisions a cast of the whole model).

Sources (the report's ``model.source``): ``builtin`` (mlp, cnn, resnet18/50, vit),
``torchvision`` (any classification model of ``torchvision.models.get_model``, ``model.arch``),
``timm`` (``timm.create_model``, ``model.arch``; the optional ``mptrain[timm]`` extra) and
``custom`` (any importable nn.Module, ``model._target_``, see :mod:`mptrain.config.targets`). None loads
pretrained weights. :func:`build_model` records what it built and how it adapted it to the data
(:func:`model_facts`), and runs one FP32 forward pass of a dummy batch so that a model that cannot
take the dataset's images, or does not return ``(batch, num_classes)`` logits, is a ConfigError
before training starts.
"""

from __future__ import annotations

import difflib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.config.base import ConfigError, Option
from mptrain.config.models import (
    CNNConfig,
    CustomModelConfig,
    GPTConfig,
    MLPConfig,
    ModelConfig,
    ResNetConfig,
    TimmModelConfig,
    TorchvisionModelConfig,
    ViTConfig,
)
from mptrain.config.targets import call_target, check_keys, first_line, locate, offered
from mptrain.models.gpt import GPT, GPTShape


def build_mlp(cfg: MLPConfig, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * image_size * image_size
    for hidden in cfg.hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
        if cfg.dropout:
            layers.append(nn.Dropout(cfg.dropout))
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def build_cnn(cfg: CNNConfig, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """Conv-BN-ReLU blocks; a 2x2 max-pool between blocks while the feature map is at least 2 px."""
    layers: list[nn.Module] = []
    channels, side = in_channels, image_size
    for i, width in enumerate(cfg.widths):
        if i > 0 and side >= 2:
            layers.append(nn.MaxPool2d(2))
            side //= 2
        layers += [
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        ]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if cfg.dropout:
        layers.append(nn.Dropout(cfg.dropout))
    layers.append(nn.Linear(channels, num_classes))
    return nn.Sequential(*layers)


def build_resnet(
    cfg: ResNetConfig, in_channels: int, image_size: int, num_classes: int
) -> nn.Module:
    """torchvision ResNet (random init). The small stem (3x3/1 conv, no max-pool) suits 8-32 px."""
    import torchvision

    constructor = {"resnet18": torchvision.models.resnet18, "resnet50": torchvision.models.resnet50}
    model = constructor[cfg.name](weights=None, num_classes=num_classes)
    small = cfg.small_stem if cfg.small_stem is not None else image_size <= 32
    if small:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


class Attention(nn.Module):
    """Multi-head self-attention with nn.Linear projections (so FP8 recipes can convert them)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """ViT: Linear patch embedding, class token, learned positions, pre-norm blocks, Linear head."""

    def __init__(  # noqa: PLR0913 (a constructor: the architecture's hyperparameters)
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        patch_size: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_ratio: float,
        dropout: float,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ConfigError(
                f"model.patch_size={patch_size}: must divide the image side ({image_size} px)"
            )
        self.patch_size = patch_size
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(in_channels * patch_size * patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(
            *(TransformerBlock(dim, heads, mlp_ratio, dropout) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        # (B, C, H, W) -> (B, num_patches, C*p*p): non-overlapping patches as Linear inputs.
        patches = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)
        x = self.patch_embed(patches)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def build_vit(cfg: ViTConfig, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    return VisionTransformer(
        in_channels,
        image_size,
        num_classes,
        patch_size=cfg.patch_size,
        dim=cfg.dim,
        depth=cfg.depth,
        heads=cfg.heads,
        mlp_ratio=cfg.mlp_ratio,
        dropout=cfg.dropout,
    )


# ------------------------------------------------------------------------- models from elsewhere
@dataclass
class ModelFacts:
    """What :func:`build_model` built: where from, the class, and how it was fitted to the data."""

    source: str  # builtin | torchvision | timm | custom
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
_TORCHVISION_SINGLE_OUTPUT = {
    "inception_v3": {"aux_logits": False, "init_weights": True},
    "googlenet": {"aux_logits": False, "init_weights": True},
}


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
    extra = _TORCHVISION_SINGLE_OUTPUT.get(arch, {})
    if extra:
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
    keys), plus ``num_classes``, ``in_channels`` and ``image_size`` where the constructor takes
    them and the user did not set them (the user's value wins)."""
    key, target = "model._target_", cfg._target_
    built = locate(key, target)
    if inspect.isclass(built) and not issubclass(built, nn.Module):
        raise ConfigError(f"{key}={target!r}: {built.__qualname__} is not a torch.nn.Module")
    if not callable(built):
        raise ConfigError(f"{key}={target!r}: a {type(built).__name__}, not an nn.Module class")
    facts = {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}
    kwargs = offered(built, dict(cfg.kwargs), facts)
    check_keys(key, target, built, kwargs)
    model = call_target(key, target, kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{key}={target!r}: returned a {type(model).__name__}, not an nn.Module")
    adaptations = [
        f"{name}={value} passed from the dataset"
        for name, value in kwargs.items()
        if name in facts and name not in cfg.kwargs
    ]
    return _recorded(model, ModelFacts("custom", target, adaptations=adaptations))


def build_gpt(cfg: GPTConfig, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """A GPT whose vocabulary is the data's (``num_classes`` = vocabulary size; the image
    arguments do not apply to token data)."""
    shape = GPTShape(num_classes, cfg.block_size, cfg.layers, cfg.heads, cfg.width, cfg.dropout)
    return GPT(shape)


# The one list of models: model.name -> its schema and builder. Each name is also an option file
# conf/model/<name>.yaml (a test keeps the two in step).
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
}
# Builtin models with convolutions (FP16 convolutions crawl on CPUs). Models from torchvision, timm
# or user code are only known once built: has_convolutions(model) inspects the built model.
CONVOLUTIONAL = frozenset({"cnn", "resnet18", "resnet50"})


def has_convolutions(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is a convolution (1-D, 2-D or 3-D, transposed too)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def config_has_convolutions(cfg: ModelConfig) -> bool:
    """Whether the configured model has convolutions, before the data is known (``mptrain bench``
    skips FP16 on CPUs for them): builtin models by :data:`CONVOLUTIONAL`; torchvision, timm and
    custom models built on the meta device (no memory, no weights initialised) for 3 x 224 x 224
    images and 10 classes, and inspected."""
    if not isinstance(cfg, TorchvisionModelConfig | TimmModelConfig | CustomModelConfig):
        return cfg.name in CONVOLUTIONAL
    with torch.device("meta"):
        return has_convolutions(MODELS[cfg.name].build(cfg, 3, 224, 10))


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
    Token data (``sequence_length`` set): ``num_classes`` is the vocabulary size."""
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
    return f"model={cfg.name}"


def _dry_forward(
    model: nn.Module, key: str, make_input: Callable[[torch.device], torch.Tensor], what: str
) -> tuple[int, ...] | str:
    """One FP32 forward pass of the zero batch ``make_input(device)`` in eval mode (no statistics
    change, no random draws): the output's shape (or its type's name when not a tensor);
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
    return tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__


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
    """A dry forward pass of two windows of ``length`` zero token ids: ConfigError naming ``key``
    unless it returns ``(2, length, vocab_size)`` logits."""
    got = _dry_forward(
        model,
        key,
        lambda device: torch.zeros(2, length, dtype=torch.long, device=device),
        f"{length}-token windows",
    )
    if got != (2, length, vocab_size):
        raise ConfigError(
            f"{key}: returns {got} for 2 windows of {length} tokens; a language model must "
            f"return (batch, length, vocabulary) = (2, {length}, {vocab_size}) logits"
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
