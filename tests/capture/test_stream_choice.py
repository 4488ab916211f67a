"""capture_stream="auto": the chooser's trials, reads and choice, on a stand-in clock (the
real one is the GPU's: ``tests/capture/test_stream_choice_cuda.py``)."""

from __future__ import annotations

import pytest

from lightning_cafin.capture.stream_choice import StreamChooser, decide


class Clock:
    """Stand-in CUDA events: ``record`` stamps the clock's time, ``query`` is True once the
    clock has passed ``done_at`` (a test moves it), ``elapsed_time`` the stamps' difference."""

    def __init__(self) -> None:
        self.now, self.done_at, self.made = 0.0, 0.0, 0

    def event(self) -> "Clock.Event":
        self.made += 1
        return Clock.Event(self)

    class Event:
        def __init__(self, clock: "Clock") -> None:
            self.clock, self.t = clock, None

        def record(self) -> None:
            self.t = self.clock.now

        def query(self) -> bool:
            return self.clock.now >= self.clock.done_at

        def elapsed_time(self, end: "Clock.Event") -> float:
            assert self.query() and end.query(), "read before the events completed"
            return end.t - self.t


def chooser(clock: Clock, trials: int = 2, max_trials: int = 2) -> StreamChooser:
    return StreamChooser(event=clock.event, trials=trials, capturing=lambda: False, max_trials=max_trials)


def capture_step(c: StreamChooser, clock: Clock, ms_side: float, ms_current: float, asks: int = 3) -> bool:
    """One capture step: its hooks and its optimizer step ask (``asks`` times), it takes the
    given time on the stream it was given, then its optimizer step is done."""
    side = c.side(True)
    for _ in range(asks - 1):
        assert c.side(True) == side  # one stream for the whole step
    clock.now += ms_side if side else ms_current
    c.capture_step_done()
    clock.now += 100.0  # normal steps between captures
    return side


@pytest.mark.parametrize("ms_side, ms_current, want", [(9.0, 10.0, True), (11.0, 10.0, False)])
def test_the_faster_stream_is_chosen_after_the_trials(ms_side, ms_current, want):
    clock = Clock()
    c = chooser(clock)
    sides = [capture_step(c, clock, ms_side, ms_current) for _ in range(5)]
    # the first capture step (plans, pools) untimed on the current stream, then alternating
    assert sides == [False, False, True, False, True]
    assert c.choice is want
    assert c.times == {True: [ms_side, ms_side], False: [ms_current, ms_current]}
    assert all(capture_step(c, clock, ms_side, ms_current) == want for _ in range(3))
    assert clock.made == 8  # two events per timed step, none after the choice


def test_nothing_is_waited_for_the_choice_comes_when_the_events_are_done():
    clock = Clock()
    c = chooser(clock)
    clock.done_at = float("inf")  # the device is behind: no event has completed
    sides = [capture_step(c, clock, 5.0, 10.0) for _ in range(7)]
    assert c.choice is None and c.times == {True: [], False: []}
    assert sides == [False, False, True, False, True, False, False]  # trials taken, then the current stream
    clock.done_at = 0.0
    c.poll()  # (a later step's poll)
    assert c.choice is True and c.times[True] == [5.0, 5.0]


def test_a_skipped_capture_step_is_not_counted():
    clock = Clock()
    c = chooser(clock)
    capture_step(c, clock, 5.0, 10.0)  # untimed
    assert c.side(True) is False
    clock.now += 1000.0  # a long step, then the loss scaler skips it
    c.abandon()  # (the optimizer's step returns there: the next capture step is timed afresh)
    for _ in range(4):
        capture_step(c, clock, 5.0, 10.0)
    assert c.times[False] == [10.0, 10.0] and c.choice is True


def test_a_capture_step_no_hooked_forward_asked_about_starts_no_trial():
    """The factor update asks ``current()``: where no hooked forward opened a trial (every
    forward declined), it gives the current stream and opens none, and the step's end
    records nothing; a trial's stream, and then the choice, are what it gives otherwise."""
    clock = Clock()
    c = chooser(clock)
    capture_step(c, clock, 5.0, 10.0)  # untimed
    for _ in range(3):
        assert c.current() is False
        clock.now += 50.0
        c.capture_step_done()
    assert clock.made == 0 and c.times == {True: [], False: []}
    capture_step(c, clock, 5.0, 10.0)  # the first trial: the current stream
    assert c.side(True) is True and c.current() is True  # the second: the side stream, open
    clock.now += 5.0
    c.capture_step_done()
    for _ in range(2):
        capture_step(c, clock, 5.0, 10.0)
    assert c.choice is True and c.current() is True


def test_off_the_gpu_or_in_a_graph_capture_nothing_is_timed():
    clock = Clock()
    c = chooser(clock)
    for _ in range(6):
        assert c.side(False) is False
        c.capture_step_done()
    assert clock.made == 0 and c.choice is None
    capturing = StreamChooser(event=clock.event, trials=1, capturing=lambda: True)
    capturing.capture_step_done()
    assert capturing.side(True) is False and clock.made == 0


def test_trials_must_be_positive():
    with pytest.raises(ValueError, match="trials must be >= 1, got 0"):
        StreamChooser(trials=0)
    with pytest.raises(ValueError, match=r"max_trials must be >= trials \(4\), got 3"):
        StreamChooser(trials=4, max_trials=3)


@pytest.mark.parametrize("side, current, final, want", [
    ([9, 9, 9, 11], [10, 10, 10, 10], False, True),  # three pairs of four
    ([11, 11, 9, 11], [10, 10, 10, 10], False, False),
    ([10, 10, 10, 10], [10, 10, 10, 10], False, False),  # ties count for the current stream
    ([9, 9, 11, 11], [10, 10, 10, 10], False, None),  # two of four: time another pair
    ([8, 8, 11, 11], [10, 10, 10, 10], True, True),  # at the most trials: the median difference, -0.5
    ([9, 9, 12, 12], [10, 10, 10, 10], True, False),  # +0.5
    ([9, 9, 11, 11], [10, 10, 10, 10], True, False),  # 0: the current stream
])
def test_the_pairs_decide(side, current, final, want):
    assert decide(side, current, final) is want


def test_the_rounds_of_the_h200_run_at_0458b79_time_more_pairs():
    """ResNet-50's trials there (ms): the medians chose the side stream (30.47 < 31.02 ms),
    which 30 paired rounds then found 1.019x the current stream's capture step; two pairs of
    four are no choice."""
    side, current = [29.66, 29.74, 31.19, 34.93], [30.2, 35.98, 31.1, 30.93]
    assert decide(side, current, final=False) is None


def test_undecided_pairs_time_more_until_they_agree_or_the_most_are_timed():
    clock = Clock()
    c = chooser(clock, trials=2, max_trials=5)
    pairs = [(9.0, 10.0), (11.0, 10.0), (9.0, 10.0), (9.0, 10.0)]  # (side, current) per pair
    capture_step(c, clock, 0.0, 0.0)  # untimed
    for k, (ms_side, ms_current) in enumerate(pairs):
        assert c.choice is None
        assert capture_step(c, clock, ms_side, ms_current) is False
        assert capture_step(c, clock, ms_side, ms_current) is True
        assert c.choice is (None if k < 3 else True)  # 1 of 1... 2 of 3 pairs: more; 3 of 4: the side stream
    assert c.times == {True: [9.0, 11.0, 9.0, 9.0], False: [10.0] * 4}
    assert capture_step(c, clock, 9.0, 10.0) is True and clock.made == 16

    clock = Clock()
    c = chooser(clock, trials=2, max_trials=3)
    capture_step(c, clock, 0.0, 0.0)
    for ms_side in (9.0, 11.0, 10.5):  # side faster, slower, slower: the most pairs, median +0.5
        capture_step(c, clock, ms_side, 10.0)
        capture_step(c, clock, ms_side, 10.0)
    assert c.choice is False and len(c.times[True]) == 3
