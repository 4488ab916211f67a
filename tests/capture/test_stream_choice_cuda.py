"""capture_stream="auto" on the GPU: the chooser times real capture steps with CUDA
events, chooses a stream without a host sync of its own, and the training is the same
bit for bit whichever stream the statistics ran on."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import streams as capture_streams
from lightning_cafin.capture.stream_choice import MAX_TRIALS_PER_STREAM, TRIALS_PER_STREAM

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_auto_times_capture_steps_each_way_chooses_and_trains_as_the_current_stream(fused_ok):
    previous = capture_streams.setting()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                              nn.Linear(16 * 8 * 8, 10)).cuda()
        twin = copy.deepcopy(model)
        opt = AdaFisher(model, TCov=1, capture_stream="auto")
        ref = AdaFisher(twin, TCov=1, capture_stream=False)
        seen_side = set()
        for _ in range(2 * MAX_TRIALS_PER_STREAM + 4):
            x = torch.randn(8, 3, 8, 8, device="cuda")
            for m, o in ((model, opt), (twin, ref)):
                o.zero_grad()
                m(x).logsumexp(1).sum().backward()
                if o is opt:
                    seen_side.add(capture_streams.enabled())
                o.step()
            torch.cuda.synchronize()  # (the test's own wait: every timed step's events done by the next poll)
        chooser = opt.stream_chooser
        assert seen_side == {True, False}  # both streams were tried
        assert chooser.choice is not None
        n = len(chooser.times[True])  # (as many pairs as it took the pairs to agree)
        assert TRIALS_PER_STREAM <= n <= MAX_TRIALS_PER_STREAM and len(chooser.times[False]) == n
        assert all(t > 0 for side in (True, False) for t in chooser.times[side])
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
    finally:
        capture_streams.set_enabled(previous)


def test_the_default_chooses_the_stream_by_timing_on_the_gpu(fused_ok):
    """capture_stream=None under the default process setting ("auto"): the capture steps try
    both streams, then one is chosen; the setting stays "auto" for other optimizers."""
    previous = capture_streams.set_enabled("auto")
    try:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()
        opt = AdaFisher(model, TCov=1)
        seen_side = set()
        for _ in range(2 * MAX_TRIALS_PER_STREAM + 4):
            opt.zero_grad()
            model(torch.randn(16, 32, device="cuda")).logsumexp(1).sum().backward()
            seen_side.add(capture_streams.enabled())
            opt.step()
            torch.cuda.synchronize()  # (every timed step's events done before the next poll)
        assert opt.capture_options.chooses_stream and seen_side == {True, False}
        assert opt.stream_chooser.choice is not None and capture_streams.setting() == "auto"
    finally:
        capture_streams.set_enabled(previous)
