"""A GPT-2-shaped decoder language model: the transformer workload people train with AdamW.

Pre-norm blocks of LayerNorm and ``nn.Linear`` layers (every projection an ``nn.Linear``,
so AdaFisherW preconditions them all) and causal ``F.scaled_dot_product_attention``, which
picks the flash / memory-efficient kernels on a GPU.  The defaults are GPT-2 small
(12 layers x 768, 12 heads, vocabulary 50257, context 1024).  The output head is its own
``nn.Linear``, not tied to the token embedding, so each weight has one owner.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .transformer import Block


class GPT(nn.Module):
    """Tokens ``(B, T)`` -> next-token logits ``(B, T, vocab)``."""

    def __init__(self, vocab: int = 50257, dim: int = 768, depth: int = 12, heads: int = 12, max_len: int = 1024):
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads, causal=True, gelu="tanh") for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        T = tokens.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len ({self.max_len}); build GPT(max_len={T}) or shorten the input")
        x = self.tok(tokens) + self.pos(torch.arange(T, device=tokens.device))
        return self.head(self.ln(self.blocks(x)))


def gpt2_small(vocab: int = 50257, max_len: int = 1024) -> GPT:
    """GPT-2 small's shape: 12 layers x 768, 12 heads (about 163M parameters with the untied head, 124M tied)."""
    return GPT(vocab, 768, 12, 12, max_len)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
