"""Capture under activation checkpointing (``torch.utils.checkpoint``, what Hugging Face's
``gradient_checkpointing_enable()`` uses), both kinds: the factors equal those of the same
model without checkpointing.

Reentrant checkpointing runs the first forward without grad (no hook captures there) and
captures in the recomputation inside the backward.  Non-reentrant checkpointing captures
in the first forward, where autograd drops the blocks' inputs, so their statistics are read
there instead of holding the inputs to the backward; the recomputation in the backward
captures nothing (its outputs' gradients never arrive).
"""

from __future__ import annotations

import copy
import statistics

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_cafin import AdaFisher

from .test_fused_stats import counting_stand_in


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


@pytest.fixture
def stand_in(monkeypatch):
    return counting_stand_in(monkeypatch)


@pytest.mark.parametrize("reentrant", [None, False, True])
def test_inputs_are_held_to_the_backward_only_where_autograd_keeps_them(stand_in, reentrant):
    """One ``layer_stats`` call in the backward per layer whose input is held there; under
    non-reentrant checkpointing the blocks' inputs are read in the forward instead (autograd
    dropped them), and the recomputation in the backward captures nothing."""
    torch.manual_seed(0)
    model = Net(reentrant)
    factors_after_two_captures(model)
    per_step = {name: stand_in.count(name) / 2 for name in ("layer_stats", "channel_stats", "conv_input_stats")}
    checkpointed_layers = 9 if reentrant is False else 0
    assert per_step["layer_stats"] == 11 - checkpointed_layers
    # read in the forward: each such layer's input, then its gradient, by one channel op each
    assert per_step["channel_stats"] == 2 * checkpointed_layers


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured on a CUDA device")
@pytest.mark.parametrize("tapped", [False, True])
def test_a_capture_step_under_checkpointing_peaks_where_a_normal_step_does(tapped):
    """Non-reentrant checkpointing of wide blocks: a capture step's peak allocation at most
    1.05x a normal step's (holding the blocks' inputs to the backward would bring back
    most of the activations the checkpointing dropped)."""
    from lightning_cafin.capture import taps

    dev = torch.device("cuda")
    torch.manual_seed(0)

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024))
                                        for _ in range(8))

        def forward(self, x):
            for block in self.blocks:
                x = x + checkpoint(block, x, use_reentrant=False)
            return x

    model = Wide().to(dev)
    x = torch.randn(4096, 1024, device=dev, requires_grad=True)
    opt = AdaFisher(model, lr=1e-4, TCov=1000, backend="fused")
    previous = taps.set_enabled(tapped)
    try:
        def peak(capture: bool) -> int:
            if capture:
                opt.capture_next_step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            model(x).square().mean().backward()
            opt.step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated(dev) - before

        for capture in (True, False, True, False):  # warm: state, factors, the allocator's pools
            peak(capture)
        # three interleaved pairs, each side's median: a normal step once peaked at 112 MB where
        # every other step of either kind peaked at 200 (an H100, the allocator's state)
        pairs = [(peak(False), peak(True)) for _ in range(3)]
    finally:
        taps.set_enabled(previous)
    normal, captured = (statistics.median(side) for side in zip(*pairs))
    assert captured <= 1.05 * normal, [(n / 2**20, c / 2**20) for n, c in pairs]


def test_offloaded_activations_are_read_in_the_forward_too(stand_in):
    """``save_on_cpu`` (activation offloading) keeps the saved inputs off the device: the capture
    reads every layer's input in the forward, with the factors of the plain run."""
    torch.manual_seed(0)
    plain = Net()
    offloaded = copy.deepcopy(plain)
    want = factors_after_two_captures(plain)
    assert stand_in.count("layer_stats") == 2 * 11
    with torch.autograd.graph.save_on_cpu():
        got = factors_after_two_captures(offloaded)
    assert stand_in.count("layer_stats") == 2 * 11  # none more: no input held to the backward
    for name in want:
        torch.testing.assert_close(got[name][0], want[name][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[name][1], want[name][1], rtol=1e-5, atol=1e-7)
