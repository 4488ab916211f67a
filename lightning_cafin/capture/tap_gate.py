"""When a captured layer's forward may repeat its last tap in C++ (``forward_capture.py``, the
extension's ``ForwardTapHook``): the step-level conditions, settled once per step.

The Python forward hook asks, at every captured layer's forward, whether this step
captures, whether taps are on and not blocked, which implementation and stream the
statistics use, and whether a ``no_capture()`` block is open.  Within a step the answers
do not change unless a setting or the schedule does, so the repeat asks one question
instead: is the owner's :class:`TapGate` open at the current :class:`SettingsEpoch`?

* The general path opens its owner's gate after it tapped a layer, with every condition
  just checked (and no ``no_capture()`` block open on any thread).
* Every change of a setting those answers read bumps the epoch, which leaves every open
  gate behind: ``no_capture()`` entered or left, taps or the side stream switched, the
  capture implementation set, compiled autograd configured or not.
* Every change of the owner's schedule closes its gate (``LayerBinding.arm``, which the
  schedule calls at each change): a step taken, a capture forced, skip flags counted.

A closed gate sends the forward to the Python hook, which decides as always; nothing here
decides what is captured, only when the Python answers may be reused.
"""

from __future__ import annotations


class SettingsEpoch:
    """A counter of changes to the settings the forward hooks read (process-wide)."""

    value = 0


def settings_changed() -> None:
    """Leave every open gate behind (call after any change of such a setting)."""
    SettingsEpoch.value += 1


class TapGate:
    """One optimizer's gate: ``epoch`` is the settings epoch it was opened at (-1: closed);
    ``side`` whether statistics go to the side stream then."""

    __slots__ = ("epoch", "side")

    def __init__(self) -> None:
        self.epoch = -1
        self.side = False

    def open(self, side: bool) -> None:
        self.epoch, self.side = SettingsEpoch.value, bool(side)

    def close(self) -> None:
        self.epoch = -1

    @property
    def is_open(self) -> bool:
        return self.epoch == SettingsEpoch.value
