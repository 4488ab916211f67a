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
    """Spans opened by :meth:`start` and closed by :meth:`stop`, read in :meth:`drain`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        # One pair of lists per clock, so that each is typed: CUDA events on a GPU, seconds on the CPU.
        self._open_event: Optional[torch.cuda.Event] = None
        self._open_time: Optional[float] = None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._times: list[tuple[float, float]] = []

    def start(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open_event = event
        else:
            self._open_time = time.perf_counter()

    def stop(self) -> None:
        if self._open_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._open_event, end))
            self._open_event = None
        elif self._open_time is not None:
            self._times.append((self._open_time, time.perf_counter()))
            self._open_time = None

    @property
    def pending(self) -> int:
        return len(self._events) + len(self._times)

    def drain(self) -> list[float]:
        """Milliseconds of every completed span since the last drain."""
        events, self._events = self._events, []
        times, self._times = self._times, []
        if events:
            events[-1][1].synchronize()
        return [start.elapsed_time(end) for start, end in events] + [(end - start) * 1e3 for start, end in times]
