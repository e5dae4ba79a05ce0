"""A decoder-only transformer language model (GPT): the workload where BF16 and FP8 matter.

Pre-norm blocks of causal self-attention (``scaled_dot_product_attention(is_causal=True)``) and a
4x-wide GELU MLP; token and learned position embeddings; the output head tied to the token
embedding, without bias (what each setting does: docs/language-models.md). The attention
projections and the MLP's Linears are the layers FP8 converts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTShape:
    """The model's size: vocabulary, context, depth, heads, width, dropout, and whether the
    Linear and LayerNorm layers have biases."""

    vocab_size: int = 256
    block_size: int = 128
    layers: int = 4
    heads: int = 4
    width: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions <= t only."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.heads, self.dropout = shape.heads, shape.dropout
        self.qkv = nn.Linear(shape.width, 3 * shape.width, bias=shape.bias)
        self.proj = nn.Linear(shape.width, shape.width, bias=shape.bias)
        self.resid_drop = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, length, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.fc = nn.Linear(shape.width, 4 * shape.width, bias=shape.bias)
        self.proj = nn.Linear(4 * shape.width, shape.width, bias=shape.bias)
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        norm = functools.partial(nn.LayerNorm, shape.width, bias=shape.bias)
        self.norm1, self.attn = norm(), CausalSelfAttention(shape)
        self.norm2, self.mlp = norm(), MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token ids ``(batch, length <= block_size)`` -> next-token logits ``(batch, length, vocab)``."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.width)
        self.pos_emb = nn.Embedding(shape.block_size, shape.width)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width, bias=shape.bias)
        self.head = nn.Linear(shape.width, shape.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one matrix for both ends
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2: residual projections scaled by depth
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * shape.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.shape.block_size:
            raise ValueError(f"{length} tokens: the model's block_size is {self.shape.block_size}")
        positions = torch.arange(length, device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
