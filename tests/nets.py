"""Networks used across the tests: every supported layer type, plus the awkward cases."""

from __future__ import annotations

import torch
from torch import nn


class EveryLayer(nn.Module):
    """Embedding first, grouped/strided/padded/dilated convs with and without bias,
    BatchNorm2d, LayerNorm over a 3-D input, Linear with and without bias, a frozen
    layer and a free ``nn.Parameter``: every pairing hazard of the authors' code."""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=bias)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding="valid", groups=2, bias=bias)
        self.conv3 = nn.Conv2d(8, 8, 3, padding="same", dilation=2, groups=8, bias=not bias)
        self.frozen = nn.Linear(8, 8)
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.ln = nn.LayerNorm(6)
        self.seq = nn.Linear(6, 8, bias=bias)
        self.head = nn.Linear(16, 5, bias=not bias)
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, img: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(img)))
        x = torch.relu(self.conv2(x))
        x = self.conv3(x).mean((2, 3))
        x = self.frozen(x)
        t = self.seq(self.ln(self.embed(tokens))).mean(1)
        return self.head(torch.cat([x, t], 1)) * self.scale


def every_layer_batch(n: int = 4, dtype=torch.float32):
    img = torch.randn(n, 3, 9, 9, dtype=dtype)
    tokens = torch.randint(0, 11, (n, 7))
    target = torch.randint(0, 5, (n,))
    return img, tokens, target
