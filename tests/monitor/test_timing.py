"""StepTimer: spans recorded without reads, read once on drain."""

import time

import torch

from lightning_cafin.monitor.timing import StepTimer


def test_spans_drained_once():
    timer = StepTimer(torch.device("cpu"))
    for _ in range(3):
        timer.start()
        time.sleep(0.002)
        timer.stop()
    timer.stop()  # an unmatched stop is ignored
    assert timer.pending == 3
    spans = timer.drain()
    assert len(spans) == 3 and min(spans) >= 2.0
    assert timer.drain() == []
