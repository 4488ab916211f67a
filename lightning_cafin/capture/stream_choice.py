"""``capture_stream="auto"``: the side stream or the current one, whichever made this
model's capture steps faster, measured on its own capture steps.

The side stream (``streams.py``) overlaps the statistics with the backward pass, which
pays where the backward keeps the device busy and costs where the host is the
bottleneck: in five runs of the bench matrix it took 0.95x-0.995x of the current
stream's capture step on ResNet-18 fp32, ResNet-50 and the GPT, and 1.01x-1.04x on the
host-bound bf16 + channels_last ResNet-18 in four of them.  Which one a model is cannot
be told from the model; its capture steps tell.

So, after the first capture step (which makes plans and pools, and is not timed), the
capture steps alternate between the two streams, each timed on the device by two CUDA
events: one recorded when the step's first hooked forward asks whether to capture, one
after its optimizer step.  The span is the step as the device ran it, the time it waited
for the host included.  Once ``TRIALS_PER_STREAM`` steps each way are timed and every
event has completed (asked with ``Event.query``, never waited for: no host sync), the
trials are compared in pairs (the i-th on each stream, taken one after the other, so a
drift of the host's speed falls on both alike): a stream that was faster in at least
three quarters of the pairs is kept for the rest of the run.  Where neither was, one more
pair is timed, and so on up to ``MAX_TRIALS_PER_STREAM`` pairs, after which the median of
the pairs' differences decides (a tie keeps the current stream, the one of less host
work).  The two medians of four trials, compared alone, chose wrong on noisy hosts: of
the 44 choices in the bench matrices kept in ``docs/results``, three took the stream that
the 30 paired rounds after them found more than 1% slower (ResNet-50 on an H200 at 0458b79:
the side stream, 1.019x the current one's capture step, from trials whose spread,
29.7-36.0 ms, was wider than the difference; the GPT on an H100 at 64dd55c: the current
stream, though the side stream was faster in three pairs of four and in the rounds).  By
pairs, 38 of the 44 are decided at four pairs (the GPT's for the side stream), none
against the rounds by more than 1%; the six others, the other two of those three among
them, would have timed more.  A capture step skipped by the loss scaler is not counted.
Off the GPU, and while a CUDA graph is being captured, the current stream is used and
nothing is timed.  The choice is not saved with the optimizer's state: a resumed run
measures again.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

#: timed capture steps on each stream before choosing
TRIALS_PER_STREAM = 4
#: the most timed capture steps on each stream, where the pairs do not agree sooner
MAX_TRIALS_PER_STREAM = 12


def decide(side_ms: list[float], current_ms: list[float], final: bool) -> Optional[bool]:
    """The stream from paired trials (``side_ms[i]`` beside ``current_ms[i]``): True (the side
    stream) or False where one was faster in at least three quarters of the pairs (a tie
    counts for the current stream); else, where ``final``, the sign of the pairs' median
    difference (zero: the current stream), or None (time another pair)."""
    pairs = list(zip(side_ms, current_ms))
    side_wins = sum(s < c for s, c in pairs)
    if 4 * side_wins >= 3 * len(pairs):
        return True
    if 4 * (len(pairs) - side_wins) >= 3 * len(pairs):
        return False
    if not final:
        return None
    return statistics.median(s - c for s, c in pairs) < 0


def cuda_timing_event() -> Any:
    """A CUDA event that records time (the chooser's clock)."""
    return torch.cuda.Event(enable_timing=True)


class StreamChooser:
    """One optimizer's choice of stream for its capture statistics (see the module)."""

    def __init__(self, event: Callable[[], Any] = cuda_timing_event, trials: int = TRIALS_PER_STREAM,
                 capturing: Callable[[], bool] = torch.cuda.is_current_stream_capturing,
                 max_trials: int = MAX_TRIALS_PER_STREAM) -> None:
        """``event`` makes the clock's events, ``capturing`` tells whether a CUDA graph is
        being captured now (both the CUDA ones unless a test stands in); ``trials`` and
        ``max_trials``: the fewest and the most timed capture steps on each stream."""
        if trials < 1:
            raise ValueError(f"trials must be >= 1, got {trials}")
        if max_trials < trials:
            raise ValueError(f"max_trials must be >= trials ({trials}), got {max_trials}")
        self._event, self._trials, self._max_trials, self._capturing = event, trials, max_trials, capturing
        self._needed = trials  # trials each way to read before deciding (grows while undecided)
        self.choice: Optional[bool] = None  # True: the side stream; None: not chosen yet
        self.times: dict[bool, list[float]] = {True: [], False: []}  # ms per timed capture step, once read
        self._timed: list[tuple[bool, Any, Any]] = []  # (side, start, end) not read yet
        self._open: Optional[tuple[bool, Any]] = None  # the capture step being timed: (side, start)
        self._warm = False  # the first capture step is over

    def side(self, on_cuda: bool) -> bool:
        """The stream for the capture step under way (asked at each of its hooks and at its
        optimizer step): the choice once made, else this step's trial, whose timing starts
        at the first ask."""
        if self.choice is not None:
            return self.choice
        if self._open is not None:
            return self._open[0]
        if not on_cuda or not self._warm or self._capturing():
            return False
        taken = len(self._timed) + len(self.times[True]) + len(self.times[False])
        if taken >= 2 * self._needed:
            return False  # every trial needed so far is taken; their events are still running
        side = taken % 2 == 1  # current, side, current, ...: as many each way
        start = self._event()
        start.record()
        self._open = (side, start)
        return side

    def current(self) -> bool:
        """The stream of the capture step under way without starting a trial: the choice once
        made, else the open trial's, else the current stream.  The factor update asks this: a
        capture step whose hooked forwards never asked computed no statistics on any stream,
        and a trial opened at its factor update would time that update alone."""
        if self.choice is not None:
            return self.choice
        return self._open[0] if self._open is not None else False

    def capture_step_done(self) -> None:
        """The capture step's optimizer step has been launched: its timing ends."""
        self._warm = True
        if self._open is not None:
            end = self._event()
            end.record()
            self._timed.append((self._open[0], self._open[1], end))
            self._open = None
        self.poll()

    def abandon(self) -> None:
        """The capture step was skipped (non-finite gradients): not counted."""
        self._open = None

    def poll(self) -> None:
        """Read the timed steps whose events have completed; choose once all are read."""
        if self.choice is not None:
            return
        while self._timed and self._timed[0][2].query():
            side, start, end = self._timed.pop(0)
            self.times[side].append(float(start.elapsed_time(end)))
        n = min(len(self.times[True]), len(self.times[False]))
        if n < self._needed:
            return
        side_ms, current_ms = self.times[True][:n], self.times[False][:n]
        self.choice = decide(side_ms, current_ms, final=n >= self._max_trials)
        if self.choice is None:
            self._needed = n + 1
            return
        log.info("capture_stream='auto': the %s stream (median capture step %.3f ms on the side stream, %.3f ms "
                 "on the current one; the side stream faster in %d of %d pairs)", "side" if self.choice else "current",
                 statistics.median(side_ms), statistics.median(current_ms),
                 sum(s < c for s, c in zip(side_ms, current_ms)), n)
