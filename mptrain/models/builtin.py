"""The built-in models: an MLP, a small CNN with BatchNorm, ResNet-18/50 (torchvision's, adapted
to the data), a ViT, and the GPT of :mod:`mptrain.models.gpt` (builders: :mod:`.build`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.models import (
    CNNConfig,
    GPTConfig,
    MLPConfig,
    ResNetConfig,
    ViTConfig,
)
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


def build_gpt(cfg: GPTConfig, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """A GPT whose vocabulary is the data's (``num_classes`` = vocabulary size; the image
    arguments do not apply to token data)."""
    shape = GPTShape(
        num_classes, cfg.block_size, cfg.layers, cfg.heads, cfg.width, cfg.dropout, cfg.bias
    )
    return GPT(shape)
