"""A small custom language model for mptrain: ``task=lm model=custom model._target_=tiny_lm.TinyLM``.

mptrain passes ``vocab_size`` (the data's vocabulary) and ``block_size`` (``model.block_size``,
the window length) because the constructor names them; ``width`` comes from the command line
(``+model.width=64``). The contract: token ids ``(batch, length)`` (long) in, logits
``(batch, length, vocab_size)`` out; position t may only look at tokens 0..t.
"""

import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    """Token and position embeddings -> one causal self-attention layer -> MLP -> logits.

    Attention calls its own nn.Linear layers (``qkv``, ``proj``), which FP8 can convert;
    ``nn.MultiheadAttention`` reads its ``out_proj`` weight without calling the layer."""

    def __init__(self, vocab_size: int, block_size: int, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids):
        length = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        x = x + self.proj(self.attention(x))
        x = x + self.mlp(x)
        return self.head(self.norm(x))

    def attention(self, x):
        """Causal multi-head self-attention of ``x (batch, length, width)``."""
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(batch, length, width)
