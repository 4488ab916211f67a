"""A loss scaler's skipped steps, learned without making the host wait for the GPU.

Under ``torch.amp.GradScaler`` (Lightning's ``16-mixed``) every step receives a device
flag ``found_inf``.  The fused kernel honours it on the device (a flagged step changes
no parameter, momentum or step count), so the host need not read it to take the step.
The host still needs the *number* of steps actually taken, because factors are
re-estimated every ``TCov`` of them.  Reading the flag at once (``found_inf.item()``)
would stall the host until the backward pass has finished on the GPU, every step.

Instead each flag is copied to pinned host memory without blocking, with an event, and
read once the event has completed (``poll``, which never waits).  The host step count
is provisional by at most the number of flags still in flight; only when that
uncertainty decides whether a step is a capture step does the host wait (``settle``),
i.e. at most about once per ``TCov`` steps.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Tuple

import torch
from torch import Tensor


class DeferredSkips:
    """found_inf flags of steps already taken on the device, read when they are ready."""

    def __init__(self) -> None:
        self._in_flight: Deque[Tuple[Tensor, torch.cuda.Event]] = deque()

    def record(self, found_inf: Tensor) -> None:
        """Remember this step's flag (a non-blocking copy; nothing waits)."""
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(found_inf.reshape(()), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((host, event))

    @property
    def in_flight(self) -> int:
        """Flags recorded but not read yet."""
        return len(self._in_flight)

    def poll(self) -> int:
        """Read the flags whose copies have completed, oldest first; return how many of
        them were skipped steps.  Never waits."""
        skipped = 0
        while self._in_flight and self._in_flight[0][1].query():
            host, _ = self._in_flight.popleft()
            skipped += int(host.item() != 0)
        return skipped

    def settle(self) -> int:
        """Wait for every recorded flag and read it; return how many were skipped steps."""
        skipped = 0
        while self._in_flight:
            host, event = self._in_flight.popleft()
            event.synchronize()
            skipped += int(host.item() != 0)
        return skipped
