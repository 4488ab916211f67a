"""Latency of a code span, with CUDA events on a GPU and the wall clock on the CPU.

Events are recorded on every span without any host synchronisation; ``drain`` waits
once for the last recorded event and reads all completed spans, so only logging steps
pay for a synchronisation.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: Optional[object] = None
        self._done: list[tuple[object, object]] = []

    def start(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open = event
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self._open is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self._done.append((self._open, end))
        self._open = None

    @property
    def pending(self) -> int:
        return len(self._done)

    def drain(self) -> list[float]:
        """Milliseconds of every completed span since the last drain."""
        done, self._done = self._done, []
        if not done:
            return []
        if self.cuda:
            done[-1][1].synchronize()
            return [start.elapsed_time(end) for start, end in done]
        return [(end - start) * 1e3 for start, end in done]
