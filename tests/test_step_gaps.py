"""``scripts/step_gaps.py``: the split of the main stream's gaps on made-up kernel timelines
(the part that decides what a figure means), its report on a CPU (which measures nothing)
and its argument errors.  Its figures mean something on a GPU only."""

from __future__ import annotations

import pytest

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script


def load():
    return load_script("step_gaps", SCRIPTS)


def kernel(start, end, stream=7, ours=False, launched=None):
    return load().Kernel(start, end, stream, ours, launched)


def test_a_gap_is_host_bound_where_its_next_kernel_was_launched_after_it_began():
    # main stream 7: [0, 100], gap 100..150 (next launched at 120: host-bound), [150, 250],
    # gap 250..400 (next launched at 10: held back), [400, 500] ours; side stream 9 inside
    # the held-back gap for 100 us (300..400) and outside it for 20 (500..520)
    kernels = [kernel(0, 100, launched=0), kernel(150, 250, launched=120), kernel(400, 500, ours=True, launched=10),
               kernel(300, 420, stream=9, launched=5), kernel(500, 520, stream=9)]
    got = load().split_gaps(kernels)
    assert got == pytest.approx({"span": 0.5, "main_busy": 0.3, "main_ours": 0.1, "side_busy": 0.14,
                                 "host_bound": 0.05, "host_gaps": 1.0, "held_back": 0.15, "side_in_held": 0.1,
                                 # the side kernel 300..420 beside the main one 400..500 for 20 us; launched after
                                 # the main kernel 0..100, it could have started at 100
                                 "side_beside": 0.02, "side_waited": 0.2,
                                 # the last side kernel ended at 520, after the main stream's last kernel
                                 "side_tail": 0.0})


def test_the_main_stream_is_the_busiest_and_back_to_back_kernels_leave_no_gap():
    # stream 3 has more kernel time than stream 7; its kernels 0.5 us apart are back to back;
    # a kernel whose launch is unknown counts its gap as held back
    kernels = [kernel(0, 50, stream=7), kernel(0, 100, stream=3), kernel(100.5, 200, stream=3, launched=100.2),
               kernel(210, 300, stream=3)]
    got = load().split_gaps(kernels)
    assert got["main_busy"] == pytest.approx(0.2895) and got["side_busy"] == pytest.approx(0.05)
    assert got["host_bound"] == 0 and got["host_gaps"] == 0 and got["held_back"] == pytest.approx(0.01)
    assert got["side_in_held"] == 0  # the other stream's kernel ended before the gap


def test_a_side_kernel_waits_from_the_later_of_its_streams_kernel_before_and_the_main_work_launched_before_it():
    # main: [0, 100] launched at 0, [100, 300] launched at 50, [300, 400] launched at 90.
    # side a (stream 9), launched at 60 (after the first two main kernels): starts at 350, 50
    # after the second main kernel's end; side b (stream 9) launched at 61 starts at 360, right
    # after a; side c (stream 8) launched at 95 (after all three) starts at 400 (no wait)
    main = [kernel(0, 100, launched=0), kernel(100, 300, launched=50), kernel(300, 400, launched=90)]
    side = [kernel(350, 360, stream=9, launched=60), kernel(360, 370, stream=9, launched=61),
            kernel(400, 410, stream=8, launched=95)]
    beside, waited = load().side_timing(main, side)
    assert beside == pytest.approx(20.0)  # a and b beside the third main kernel
    assert waited == pytest.approx(50.0)
    # the same side kernels at the times the main ones allowed: no wait, all beside
    early = [kernel(300, 310, stream=9, launched=60), kernel(310, 320, stream=9, launched=61),
             kernel(400, 410, stream=8, launched=95)]
    assert load().side_timing(main, early) == pytest.approx((20.0, 0.0))


def test_the_side_tail_is_the_main_streams_gap_the_side_work_ended_in():
    main = [kernel(0, 100), kernel(100, 300), kernel(450, 500)]
    gap = load().tail_gap
    assert gap(main, 400) == pytest.approx(150.0)  # the gap 300..450
    assert gap(main, 200) == 0  # the main stream was running
    assert gap(main, 600) == 0 and gap(main, None) == 0  # nothing of the main stream after it


def test_the_table_has_each_kind_and_each_capture_steps_excess():
    figures = load().FIGURES
    rows = {"normal": [dict.fromkeys(figures, 1.0), dict.fromkeys(figures, 3.0)],
            "capture, side stream": [dict.fromkeys(figures, 4.0)] * 3,
            "capture, current stream": [dict.fromkeys(figures, 5.0)]}
    lines = load().table(rows)
    assert lines[0].split()[0] == "step" and len(lines) == 6
    assert [line.split()[:3] for line in lines[1:4]] == [["normal", "2.000", "2.000"], ["capture,", "side", "stream"],
                                                        ["capture,", "current", "stream"]]
    assert [float(v) for v in lines[1].split()[1:]] == [2.0] * len(figures)  # the median
    for line, excess in zip(lines[4:], (2.0, 3.0)):
        label = "side" if excess == 2.0 else "current"
        assert line.split()[:4] == [label, "stream", "-", "normal"], line
        assert [float(v) for v in line.split()[4:]] == [excess] * len(figures)


def test_each_step_kind_sets_its_stream_and_only_the_high_priority_kind_the_priority(monkeypatch):
    import contextlib

    script, calls = load(), []
    monkeypatch.setattr(script, "capture_stream_set", lambda t, s: contextlib.nullcontext(calls.append(("stream", s))))
    monkeypatch.setattr(script, "side_priority", lambda high: contextlib.nullcontext(calls.append(("high", high))))
    for kind in script.KINDS.values():
        with script.stream_setting(object(), kind):
            pass
    assert calls == [("stream", True), ("high", True), ("stream", True), ("stream", False)]


def test_on_a_cpu_it_says_it_measures_nothing(capsys):
    assert load().main(["--quick", "--device", "cpu", "--workload", "resnet18"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("workload resnet18: the gaps' split needs a CUDA device") and "nothing measured on cpu" in out


@pytest.mark.parametrize("argv,message", [
    (["--workload", "vgg"], "--workload: unknown workload 'vgg'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "0"], "--warmup must be at least 1"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        load().parse(argv + ["--device", "cpu"])
