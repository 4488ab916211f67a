"""A small pre-norm transformer classifier: LayerNorm and Linear layers (AdaFisherW's use case).

Attention is written with plain Linear projections (not ``nn.MultiheadAttention``,
whose packed projection weight is not an ``nn.Linear``) so every projection is
preconditioned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """A pre-norm transformer block: attention through ``scaled_dot_product_attention`` (causal
    for a decoder), then a GELU MLP (``gelu="tanh"``: GPT-2's approximation); every
    projection is an ``nn.Linear``, so AdaFisher preconditions all of them."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, *, causal: bool = False, gelu: str = "none"):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.heads, self.causal, self.gelu = heads, causal, gelu
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.gelu))


class TransformerClassifier(nn.Module):
    """Tokens -> ``depth`` blocks -> mean pool -> classes."""

    def __init__(self, vocab: int = 1000, num_classes: int = 10, dim: int = 256, depth: int = 4,
                 heads: int = 4, max_len: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.ln(self.blocks(x)).mean(1))


class ImageTransformer(nn.Module):
    """Images cut into ``patch_size`` squares, each projected by a Linear layer, then ``depth`` blocks.

    A vision transformer small enough for a CPU: Fashion-MNIST with 7x7 patches is a
    sequence of 16 tokens.  Every projection (patch embedding included) is an
    ``nn.Linear`` and every norm a ``LayerNorm``, so AdaFisherW preconditions them all.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28, patch_size: int = 7,
                 dim: int = 128, depth: int = 4, heads: int = 4):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.patch_size = patch_size
        tokens = (image_size // patch_size) ** 2
        self.embed = nn.Linear(in_channels * patch_size * patch_size, dim)
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        p = self.patch_size
        patches = F.unfold(images, p, stride=p).transpose(1, 2)  # (B, tokens, C*p*p)
        x = self.embed(patches) + self.pos
        return self.head(self.ln(self.blocks(x)).mean(1))
