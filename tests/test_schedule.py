"""The capture schedule: asking is free, settling is explicit (stand-in skip flags on the CPU)."""

from __future__ import annotations

import pytest

from lightning_cafin.schedule import CaptureSchedule


class FlagsInFlight:
    """Stand-in for ``DeferredSkips``: flags recorded with their verdict, arriving on ``deliver``."""

    def __init__(self) -> None:
        self.flags: list[bool] = []
        self.arrived = 0
        self.polls = self.waits = 0

    def record(self, skipped: bool) -> None:
        self.flags.append(skipped)

    @property
    def in_flight(self) -> int:
        return len(self.flags)

    def deliver(self, n: int) -> None:
        self.arrived = min(len(self.flags), self.arrived + n)

    def poll(self) -> int:
        self.polls += 1
        done, self.flags = self.flags[: self.arrived], self.flags[self.arrived :]
        self.arrived = 0
        return sum(done)

    def settle(self) -> int:
        self.waits += 1
        done, self.flags, self.arrived = self.flags, [], 0
        return sum(done)


def test_due_follows_the_count_and_the_forced_flag():
    s = CaptureSchedule(3)
    seen = []
    for _ in range(7):
        seen.append(s.due)
        s.advance()
    assert seen == [True, False, False, True, False, False, True]
    s.force_next()
    assert s.due and s.forced
    s.force_next(False)
    assert not s.due
    s.advance(capture_next=True)
    assert s.due and s.steps_taken == 8


def test_asking_never_reads_or_waits_for_flags():
    flags = FlagsInFlight()
    s = CaptureSchedule(4, deferred=flags)
    s.advance()
    for verdict in (True, False, False):
        flags.record(verdict)
        s.advance()
    flags.deliver(3)
    answers = {s.due for _ in range(5)}
    assert answers == {True} and s.steps_taken == 4  # provisional: 4 taken as far as the host knows
    assert flags.polls == flags.waits == 0 and flags.in_flight == 3 and s.skipped == 0


def test_settle_reads_what_arrived_and_waits_only_when_the_flags_decide():
    flags = FlagsInFlight()
    s = CaptureSchedule(10, deferred=flags)
    for _ in range(5):
        s.advance()
    flags.record(True)
    s.advance()  # step 6, flag in flight: cannot move the count across a multiple of 10
    s.settle()
    assert flags.waits == 0 and flags.polls == 1 and flags.in_flight == 1 and s.steps_taken == 6
    for _ in range(4):
        flags.record(False)
        s.advance()  # 10 provisional steps, 5 unsure: the next step's answer depends on them
    assert s.due
    s.settle()
    assert flags.waits == 1 and flags.in_flight == 0
    assert s.steps_taken == 9 and s.skipped == 1 and not s.due


def test_settled_due_is_settle_then_due():
    flags = FlagsInFlight()
    s = CaptureSchedule(10, deferred=flags)
    for _ in range(9):
        flags.record(False)
        s.advance()
    flags.record(True)
    s.advance()  # 10 provisional steps, the last one skipped: not due once settled
    assert s.due and flags.waits == 0
    assert s.settled_due() is False
    assert flags.waits == 1 and flags.in_flight == 0 and s.steps_taken == 9
    assert s.settled_due() is False and flags.polls == 1  # nothing in flight: nothing read again
    s.advance()
    assert s.settled_due() is True


def test_checkpoint_waits_for_every_flag():
    flags = FlagsInFlight()
    s = CaptureSchedule(5, deferred=flags)
    for verdict in (False, True):
        flags.record(verdict)
        s.advance()
    assert s.state_dict() == {"global_step": 1, "force_capture": False}
    assert flags.waits == 1
    s.load_state_dict({"global_step": 40, "force_capture": True})
    assert s.steps_taken == 40 and s.due


def test_optimizer_capture_due_is_side_effect_free():
    import torch
    from torch import nn

    from lightning_cafin import AdaFisher

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = AdaFisher(model, TCov=2, backend="foreach")
    flags = FlagsInFlight()
    opt.schedule = CaptureSchedule(2, deferred=flags)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
    before = (opt.schedule.steps_taken, opt.schedule.skipped)
    flags.record(True)
    flags.deliver(1)
    polls, waits = flags.polls, flags.waits
    assert [opt.capture_due for _ in range(3)] == [False] * 3
    assert (flags.polls, flags.waits, flags.in_flight) == (polls, waits, 1)
    assert (opt.schedule.steps_taken, opt.schedule.skipped) == before
    opt.capture_next_step()
    assert opt.capture_due
    opt.capture_next_step(False)
    assert not opt.capture_due
    assert opt.health["skipped_steps"] == 1  # reading health does read what has arrived
    assert opt.schedule.steps_taken == 2 and opt.capture_due


@pytest.mark.parametrize("every", [1, 7])
def test_every_step_or_every_seventh(every):
    s = CaptureSchedule(every)
    due = []
    for _ in range(15):
        due.append(s.due)
        s.advance()
    assert [i for i, d in enumerate(due) if d] == list(range(0, 15, every))


def test_may_be_due_counts_the_flags_in_flight_and_changes_are_announced():
    """The hooks are armed by ``may_be_due``: each flag still in flight may take a step off
    the count, so a count just past a capture may yet be one."""
    flags = FlagsInFlight()
    s = CaptureSchedule(5, flags)  # type: ignore[arg-type]
    told = []
    s.on_change = told.append
    for _ in range(6):
        s.advance()
    assert s.steps_taken == 6 and not s.due and not s.may_be_due and told == [False] * 4 + [True, False]
    s.record_deferred(True)  # type: ignore[arg-type]
    assert not s.due and s.may_be_due
    s.settle_all()  # the step was skipped: 5 taken, the next one captures
    assert s.steps_taken == 5 and s.due and told[-1] is True
    s.advance()
    s.record_deferred(False)  # type: ignore[arg-type]
    s.settle_all()  # taken after all: nothing changes, nothing announced
    assert s.steps_taken == 6 and not s.may_be_due and told[-1] is False and len(told) == 8
    s.force_next()
    assert told[-1] is True
