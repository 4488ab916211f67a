"""Capture under activation checkpointing (``torch.utils.checkpoint``, what Hugging Face's
``gradient_checkpointing_enable()`` uses), both kinds: the factors equal those of the same
model without checkpointing.

Reentrant checkpointing runs the first forward without grad (no hook captures there) and
captures in the recomputation inside the backward; non-reentrant checkpointing captures in
the first forward, and the recomputation's hooks register on outputs whose gradients never
arrive (their inputs are let go with the recomputed graph).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_cafin import AdaFisher


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.b(torch.relu(self.norm(self.a(x))))


class Net(nn.Module):
    """Checkpointed blocks between two plain layers (``reentrant`` None: no checkpointing)."""

    def __init__(self, reentrant=None):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x):
        x = self.inp(x)  # the blocks' input requires grad, as reentrant checkpointing needs
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def factors_after_two_captures(model):
    torch.manual_seed(1)
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="reference")
    for _ in range(2):
        x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.health["modules_not_fired"] == [] and opt.health["capture_steps"] == 2
    return {n: (c.H.clone(), c.S.clone()) for n, c in opt.binding.captures.items()}


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_capture_the_factors_of_the_plain_model(reentrant):
    torch.manual_seed(0)
    plain = Net()
    checkpointed = copy.deepcopy(plain)
    checkpointed.reentrant = reentrant
    want, got = factors_after_two_captures(plain), factors_after_two_captures(checkpointed)
    assert got.keys() == want.keys() and len(got) == 11
    for name in want:
        torch.testing.assert_close(got[name][0], want[name][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[name][1], want[name][1], rtol=1e-5, atol=1e-7)
