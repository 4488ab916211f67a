"""When the factors are re-estimated: every ``TCov`` optimizer steps actually taken.

The schedule counts the steps taken.  Under a loss scaler whose ``found_inf`` the host
does not read at once (``skips.DeferredSkips``), that count is provisional by the
flags still in flight.  Asking whether a step is a capture step (:attr:`due`) never
waits and never changes anything; learning the flags that have arrived, and waiting
for them where they decide the answer, is the explicit :meth:`settle`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor

from .skips import DeferredSkips


class CaptureSchedule:
    """The step count, the forced-capture flag and the skipped steps of one optimizer."""

    def __init__(self, every: int, deferred: Optional[DeferredSkips] = None) -> None:
        self.every = int(every)
        #: steps taken; provisional by the skip flags still in flight
        self.steps_taken = 0
        #: steps a loss scaler skipped, as far as the host knows
        self.skipped = 0
        self._forced = False
        self._deferred = deferred if deferred is not None else DeferredSkips()
        #: told :attr:`may_be_due` after every change (the owner arms its hooks by it)
        self.on_change: Optional[Callable[[bool], None]] = None

    # ------------------------------------------------------------------ queries
    @property
    def due(self) -> bool:
        """Whether the next step captures, as far as the host knows now (no wait, no change)."""
        return self._forced or self.steps_taken % self.every == 0

    def settled_due(self) -> bool:
        """:meth:`settle`, then :attr:`due`: what every captured layer's forward hook asks, in
        one call (with no skip flag in flight, nothing to settle)."""
        if self._deferred.in_flight:
            self.settle()
        return self.due

    @property
    def may_be_due(self) -> bool:
        """Whether the next step may capture once the skip flags in flight are known: each
        flag still to arrive may take one step off the count."""
        if self.due:
            return True
        return self.steps_taken % self.every <= self._deferred.in_flight

    @property
    def forced(self) -> bool:
        return self._forced

    @property
    def in_flight(self) -> int:
        """Skip flags recorded on the device and not read yet."""
        return self._deferred.in_flight

    # ------------------------------------------------------------------ changes
    def force_next(self, on: bool = True) -> None:
        """Make (or stop making) the next step a capture step whatever the count says."""
        self._forced = bool(on)
        self._changed()

    def settle(self) -> None:
        """Count the skip flags that have arrived; wait for the others only where they
        decide whether the next step captures (about once per ``every`` steps).  Every
        captured layer's forward hook asks this, so with no flag in flight it returns at once."""
        if not self._deferred.in_flight:
            return
        self._count(self._deferred.poll())
        unsure = self._deferred.in_flight  # each of these steps may yet turn out skipped
        if unsure and not self._forced and (self.steps_taken // self.every) * self.every >= self.steps_taken - unsure:
            self._count(self._deferred.settle())

    def settle_all(self) -> None:
        """Wait for every skip flag in flight (before the count is saved or replaced)."""
        self._count(self._deferred.settle())

    def poll(self) -> None:
        """Count the skip flags that have arrived, without waiting for any."""
        self._count(self._deferred.poll())

    def record_deferred(self, found_inf: Tensor) -> None:
        """This step was taken on the device subject to ``found_inf``, read later."""
        self._deferred.record(found_inf)

    def skipped_now(self) -> None:
        """The host read this step's ``found_inf`` and skipped it: nothing is counted as taken."""
        self.skipped += 1

    def advance(self, capture_next: bool = False) -> None:
        """One step was taken; ``capture_next`` forces the following one to capture."""
        self.steps_taken += 1
        self._forced = capture_next
        self._changed()

    def _count(self, skipped: int) -> None:
        if skipped:
            self.steps_taken -= skipped
            self.skipped += skipped
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.may_be_due)

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        self.settle_all()  # the saved step count must be exact
        return {"global_step": self.steps_taken, "force_capture": self._forced}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.settle_all()  # flags of steps before the load count there, not here
        self.steps_taken = int(state["global_step"])
        self._forced = bool(state["force_capture"])
        self._changed()
