"""What a capture step's factor work costs, timed around that work itself.

The optimizer calls ``before_capture`` / ``after_capture`` around the capture step's
work inside ``step()``: joining the statistics stream, reducing the statistics across
ranks, normalising and folding them into the factors.  On a GPU that span is timed with
CUDA events (device time, read on logging steps only) and with the host clock (the
Python and launch time the host spends on it); on the CPU the two are the same, the
wall time.  Both are durations of one span, so neither can be negative.

The statistics themselves are computed during the backward pass, beside it on a side
stream; their cost shows here only where joining that stream has to wait for them.
"""

from __future__ import annotations

import time

import torch

from .timing import StepTimer


class CaptureCost:
    """Device and host milliseconds of every capture step's factor work since the last drain."""

    def __init__(self, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        self._device = StepTimer(device)
        self._host_start: float | None = None
        self._host: list[float] = []

    def start(self) -> None:
        self._device.start()
        self._host_start = time.perf_counter()

    def stop(self) -> None:
        if self._host_start is None:
            return
        self._device.stop()
        self._host.append((time.perf_counter() - self._host_start) * 1e3)
        self._host_start = None

    @property
    def pending(self) -> int:
        return len(self._host)

    def drain(self) -> tuple[list[float], list[float]]:
        """``(device_ms, host_ms)`` per capture step; on the CPU both are the wall time."""
        host, self._host = self._host, []
        device = self._device.drain()
        return (device if self.on_gpu else list(host)), host
