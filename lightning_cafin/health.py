"""What went wrong or was worked around, counted and warned about once.

The optimizer records here what a capture step reported (layers whose hooks never
fired, layers whose statistics were not finite) and how many parameters use ``F = 1``.
Which layers had non-finite statistics is decided on the device by the capture
kernels; reading it would make every capture step wait for the GPU, so the report is
kept unread until the counters are read or the next capture step comes.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from torch import Tensor

from .capture.factors import CaptureReport


class Health:
    """Counters of one optimizer; :meth:`snapshot` returns a copy, never the live state."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the optimizer's class name, for warnings
        self.capture_steps = 0
        self.modules_not_fired: list[str] = []
        self.non_finite_statistics = 0
        self.params_f_one = 0
        self._warned: set[str] = set()
        self._unread: Optional[CaptureReport] = None

    def warn_once(self, key: str, message: str, stacklevel: int = 4) -> None:
        """Warn with ``message`` the first time ``key`` is seen by this optimizer."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{self.owner}: {message}", stacklevel=stacklevel)

    def first_time(self, key: str) -> bool:
        """True the first time ``key`` is asked about (for warnings worded elsewhere)."""
        if key in self._warned:
            return False
        self._warned.add(key)
        return True

    def record_capture(self, report: CaptureReport, trainable_not_fired: list[str], factors_kept: dict[str, bool]) -> None:
        """A capture step ran: count it, warn about layers it missed, keep its device verdicts unread."""
        self.settle()  # the previous capture's verdicts, before this one replaces them
        self.capture_steps += 1
        self.modules_not_fired = list(trainable_not_fired)
        self._unread = report
        if report.settled:
            self.settle()
        for name in trainable_not_fired:
            self.warn_once(
                f"notfired:{name}",
                f"no training forward/backward reached {name!r} before a capture step; "
                + ("its factors were kept" if factors_kept.get(name) else "its factors were not updated (F = 1 until they are)"),
                stacklevel=5,
            )

    def settle(self) -> None:
        """Read the last capture step's device verdicts (waits for that launch once)."""
        report, self._unread = self._unread, None
        if report is None:
            return
        self.non_finite_statistics += len(report.non_finite)
        for name in report.non_finite:
            self.warn_once(f"nonfinite:{name}", f"non-finite statistics for {name!r}: its factors were kept unchanged")

    def snapshot(self, skipped_steps: int) -> dict[str, Any]:
        """The counters as a new plain dict (``modules_not_fired`` a new list)."""
        self.settle()
        return {
            "skipped_steps": skipped_steps,
            "capture_steps": self.capture_steps,
            "modules_not_fired": list(self.modules_not_fired),
            "non_finite_statistics": self.non_finite_statistics,
            "params_f_one": self.params_f_one,
        }


def summary_text(title: str, groups: list[dict], n_layers: int, preconditioned: Callable[[Tensor], bool],
                 name_of: Callable[[Tensor], str]) -> str:
    """One paragraph: how many parameters are preconditioned and how many use F = 1."""
    pre_t = pre_n = one_t = one_n = 0
    plain = []
    for group in groups:
        for p in group["params"]:
            if preconditioned(p):
                pre_t, pre_n = pre_t + 1, pre_n + p.numel()
            else:
                one_t, one_n = one_t + 1, one_n + p.numel()
                plain.append(name_of(p))
    shown = ", ".join(plain[:6]) + (", ..." if len(plain) > 6 else "")
    text = (
        f"{title}: {pre_t} parameter tensors ({pre_n:,} elements) in {n_layers} layers are preconditioned; "
        f"{one_t} tensors ({one_n:,} elements) use F = 1"
    )
    return text + (f" ({shown})" if plain else "")
