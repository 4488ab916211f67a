"""The benchmark runs end to end in --quick mode and records what it measured, with provenance."""

import json
import math
import random
import re
import time

import pytest
import torch

from lightning_cafin import bench
from lightning_cafin.bench.goals import goals_table, verdict
from lightning_cafin.bench.matrix import MatrixConfig, goals
from lightning_cafin.bench.timing import median_interval, quantile, ratio_of_sums_interval, run_peak, spread
from lightning_cafin.bench.workloads import workloads

from .capture.test_kept_launch import ext, kernels_on_cpu, tap_setting  # noqa: F401  (fixtures)

MATRIX = ("resnet18", "resnet18-bf16cl", "resnet50", "gpt")


RATIO_KEY = re.compile(r"(^|_)ratio($|_)")


def ratio_values(tree, path=""):
    """Every number under a key that names a ratio, with where it was."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            here = f"{path}.{k}"
            if k.endswith("_ci90"):  # an interval: two ratios, or None where too few blocks were timed
                for i, bound in enumerate(v or ()):
                    yield f"{here}[{i}]", bound
            elif RATIO_KEY.search(k):  # (a word of the key: "added_by_operation" holds "ratio" too)
                if isinstance(v, dict):  # a spread of paired ratios
                    for stat in ("median", "p10", "p90"):
                        yield f"{here}.{stat}", v[stat]
                else:
                    yield here, v
            else:
                yield from ratio_values(v, here)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from ratio_values(v, f"{path}[{i}]")


def test_quick_benchmark_writes_table_and_json(tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path), "--reps", "2"]) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    assert {"command", "commit", "machine", "torch", "date"} <= set(record["provenance"])
    rows = record["results"]
    variants = {(r["workload"].split()[0], r["variant"]) for r in rows}
    for wl, fam in (("resnet18", "AdaFisher"), ("transformer", "AdaFisherW"), ("flat", "AdaFisher")):
        assert (wl, f"{fam}[reference]") in variants and (wl, f"{fam}[foreach]") in variants
    assert ("resnet18", "Adam(fused)") in variants and ("transformer", "AdamW(fused)") in variants
    for r in rows:
        assert r["step_ms"] > 0 and r["state_mb"] > 0, r
    eager = [r for r in rows if "Fisher" in r["variant"] and "graph" not in r["variant"] and "flat" not in r["workload"]]
    assert eager and all(r["capture_ms"] is not None for r in eager)
    assert set(record["ratios"]) == {r["workload"] for r in rows}
    assert (tmp_path / "bench.png").stat().st_size > 0  # matplotlib is a dev dependency

    speed = record["matrix"]["host_speed"]
    if torch.cuda.is_available():  # the host's own price of an op and of an allocation, before the workloads
        assert speed["op_us"]["median"] > 0 and speed["alloc_us"]["median"] > 0 and speed["op_us"]["n"] >= 5
    else:
        assert speed is None
    matrix = record["matrix"]["workloads"]
    assert tuple(matrix) == MATRIX
    for name, wl in matrix.items():
        assert {"description", "optimizer", "baseline", "backend", "memory", "sync", "optimizer_step", "state",
                "pipelined", "warnings", "goals"} <= set(wl), name
        assert wl["optimizer"] == ("AdaFisherW" if name == "gpt" else "AdaFisher")
        assert {"tcov100", "tcov10", "tcov1", "tcov1_side_stream", "adam_ms"} <= set(wl["pipelined"])
        for tcov in ("tcov100", "tcov10", "tcov1"):  # the default ("auto") timed after its choice, on a GPU
            assert (wl["pipelined"][tcov]["auto_stream_side"] is None) == (not torch.cuda.is_available()), tcov
        assert {"normal_ms", "capture_ms", "adam_ms", "normal_vs_adam_ratio", "capture_vs_normal_ratio",
                "capture_above_normal_ms", "capture_side_stream_ms", "side_vs_current_stream_ratio", "capture_uses_taps",
                "capture_python_hooks_ms", "python_hooks_above_normal_ms", "python_hooks_vs_capture_ratio",
                "capture_side_high_priority_ms", "high_vs_default_priority_ratio"} <= set(wl["sync"])
        assert wl["sync"]["capture_uses_taps"] is True  # the default: what users run
        host = wl["host"]
        assert host["layers"] >= 2 and set(host["capture_extra_us_per_layer"]) == {"forward", "backward", "step"}
        assert set(host["python_hooks_extra_us_per_layer"]) == {"forward", "backward", "step"}
        assert "launches" in wl and (wl["launches"] is None) == (not torch.cuda.is_available())  # counted on a GPU
        for kind in ("normal", "capture", "capture_python_hooks"):  # host milliseconds per phase, every one measured
            assert all(host[kind][p]["median"] > 0 and host[kind][p]["n"] >= 1 for p in ("forward", "backward", "step"))
        assert {"normal_peak_mb", "capture_peak_mb", "capture_side_stream_peak_mb"} <= set(wl["memory"]["adafisher"])
        assert wl["memory"]["adafisher"]["capture_peak_mb"] > 0 and wl["memory"]["adam"]["normal_peak_mb"] > 0
        assert wl["state"]["adafisher_bytes"]["total"] > 0 and wl["state"]["adam_bytes"] > 0
        floor = wl["statistics_floor"]
        assert floor["inputs"] > 0 and floor["gradients"] > 0 and floor["layers"] >= 2
        assert (floor["floor_ms"] is None) == (not torch.cuda.is_available())
        found = dict(ratio_values(wl, name))
        assert len(found) >= 20, found
        for where, value in found.items():
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (where, value)
        figures = [g["figure"] for g in wl["goals"]]
        assert len(figures) == 15 and all(g["value"] > 0 and math.isfinite(g["value"]) for g in wl["goals"])
        assert ("sync capture step above normal" in figures) == name.startswith("resnet18")
        auto = wl["sync"]["auto_stream"]  # capture_stream="auto" timed beside the fixed streams; off the GPU no choice
        assert (auto["side"] is None) == (not torch.cuda.is_available()), auto
        for stream in ("current", "side", "auto"):  # each setting timed explicitly, as often as the default
            assert wl["sync"][f"capture_{stream}_stream_ms"]["n"] == wl["sync"]["capture_ms"]["n"], stream
        assert wl["sync"]["capture_side_high_priority_ms"]["n"] == wl["sync"]["capture_ms"]["n"]
    assert "compiled" not in record  # a quick full run leaves the compiled step out (compiling is slow)
    callback = record["callback"]  # the callback's cost is part of the full run
    assert callback["quiet_ratio"]["median"] > 0 and len(callback["goals"]) == 3
    out = capsys.readouterr().out
    assert "step_ms" in out and "faster than reference" in out and "dashboard host syncs per step" in out
    assert "host ms (forward, backward, step): normal " in out and "; capture with Python hooks " in out
    last = out.strip().splitlines()
    # the goals table prints last: 4 workloads x 15 figures, then the callback's 3
    assert last[-64].split()[:2] == ["workload", "figure"]
    assert all(line.split()[0] in MATRIX for line in last[-63:-3])
    assert all(line.split()[0] == "callback" for line in last[-3:])


def test_matrix_only_and_only_select_workloads(tmp_path, capsys):
    from lightning_cafin.capture import streams

    before = streams.setting()
    assert bench.main(["--quick", "--matrix-only", "--only", "gpt", "--out", str(tmp_path)]) == 0
    assert streams.setting() == before  # the side-stream variants put the process setting back
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["results"] == [] and list(record["matrix"]["workloads"]) == ["gpt"] and "callback" not in record
    side = record["matrix"]["workloads"]["gpt"]["pipelined"]["tcov1_side_stream"]
    assert side["ms"]["median"] > 0 and side["vs_default_ratio"] > 0
    assert "step_ms" not in capsys.readouterr().out  # no optimizer-step table
    with pytest.raises(SystemExit, match="--only: unknown workload"):
        bench.main(["--quick", "--only", "resnet99", "--out", str(tmp_path)])


def synthetic(pipelined=1.0, sync=1.0, capture_ms=0.5, capture_ratio=1.01, peak=1.0, step=0.5):
    med = lambda v: {"median": v, "p10": v, "p90": v, "n": 1}
    return {"pipelined": {"tcov100": {"ratio": pipelined}, "tcov10": {"ratio": pipelined}, "tcov1": {"ratio": 2.0},
                          "tcov1_side_stream": {"vs_default_ratio": 1.04}},
            "sync": {"normal_vs_adam_ratio": med(sync), "capture_above_normal_ms": med(capture_ms),
                     "capture_vs_normal_ratio": med(capture_ratio), "side_vs_current_stream_ratio": med(1.03),
                     "python_hooks_vs_capture_ratio": med(1.1)},
            "memory": {"capture_vs_normal_ratio": peak, "capture_side_stream_vs_normal_ratio": 1.2},
            "optimizer_step": {"vs_adam_ratio": med(step)},
            "state": {"vs_adam_ratio": 1.1}}


def test_goals_are_judged_against_the_issue_limits():
    wls = workloads(torch.device("cpu"), quick=True)
    verdict = lambda name, **kw: {g["figure"]: g["met"] for g in goals(wls[name], synthetic(**kw))}
    good = verdict("resnet18")
    assert good["pipelined TCov=1 vs Adam"] is None and good["optimizer state vs Adam"] is None
    assert good["sync capture step, statistics on a side stream vs the current stream"] is None  # a figure, no goal
    assert good["pipelined TCov=1, statistics on a side stream vs the default stream setting"] is None
    assert good["sync capture step, Python hooks vs C++ gradient taps (the default)"] is None
    # a run from before the side stream's priority was compared has no row for it; a later one has it, without a goal
    priority = "sync capture step, side stream at high priority vs default priority (the default)"
    assert priority not in good
    later = synthetic()
    later["sync"]["high_vs_default_priority_ratio"] = {"median": 1.02, "p10": 1.0, "p90": 1.04, "n": 30}
    row = {g["figure"]: g for g in goals(wls["resnet18"], later)}[priority]
    assert row["met"] is None and row["value"] == 1.02
    assert good["capture-step peak memory, statistics on a side stream, vs normal"] is None  # not the default
    assert all(v for k, v in good.items() if v is not None)
    assert verdict("resnet18", pipelined=1.03)["pipelined TCov=100 vs Adam"] is False
    assert verdict("resnet18", pipelined=1.03)["pipelined TCov=10 vs Adam"] is True
    assert verdict("resnet18", sync=1.04)["sync normal step vs Adam"] is False
    assert verdict("resnet18", capture_ms=1.5)["sync capture step above normal"] is False
    assert verdict("gpt", capture_ratio=1.06)["sync capture step vs normal"] is False
    assert verdict("resnet50", capture_ms=100.0)["sync capture step vs normal"] is True  # judged as a ratio there
    assert verdict("gpt", peak=1.06)["capture-step peak memory vs normal"] is False
    assert verdict("gpt", step=0.61)["optimizer step vs Adam (eager)"] is False
    older = synthetic()  # a run from before "auto" was the default: its default was the current stream
    older["pipelined"]["tcov1_side_stream"] = {"vs_current_stream_ratio": 0.97}
    assert {g["figure"]: g["value"] for g in goals(wls["resnet18"], older)}[
        "pipelined TCov=1, statistics on a side stream vs the default stream setting"] == 0.97
    table = goals_table({"gpt": {"goals": goals(wls["gpt"], synthetic(step=0.61))}})
    assert "NOT MET" in table and "<= 0.6x" in table


def test_spread_and_quantile():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([0.0, 10.0], 0.1) == pytest.approx(1.0)
    assert spread([1.0, 2.0, 3.0, 4.0]) == {"median": 2.5, "p10": pytest.approx(1.3), "p90": pytest.approx(3.7), "n": 4,
                                            "ci90": None}  # too few values for a 90% interval of the median
    assert spread([5.0, 1.0, 4.0, 2.0, 3.0])["ci90"] == [1.0, 5.0]
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_run_peak_on_the_cpu_counts_the_tensors_a_call_holds():
    before, peak = run_peak(lambda: torch.empty(1000, dtype=torch.float32).sum(), torch.device("cpu"))
    assert before == 0 and peak >= 4000


def test_default_matrix_covers_every_tcov_capture():
    cfg = MatrixConfig()
    assert cfg.blocks * cfg.block % 100 == 0 and cfg.block % 10 == 0  # TCov=100 and 10 captures at their frequency


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_matrix_on_the_gpu(tmp_path):
    """The CUDA-only paths (allocator peaks, device synchronisation, batch sizing) in tiny sizes;
    every timed capture step takes the factor update kept from the one before, with the
    real kernels, as a training run's do."""
    assert bench.main(["--quick", "--matrix-only", "--device", "cuda", "--out", str(tmp_path)]) == 0
    matrix = json.loads((tmp_path / "bench.json").read_text())["matrix"]["workloads"]
    assert tuple(matrix) == MATRIX
    for name, wl in matrix.items():
        shares = (wl["sync"]["capture_kept_launch_share"], wl["host"]["capture_kept_launch_share"])
        assert shares == (1.0, 1.0), (name, shares)
        mem = wl["memory"]
        # above what was allocated before the model was built: at least the parameters and gradients
        params = sum(p.numel() * 4 for p in workloads(torch.device("cuda"), quick=True)[name].make_model().parameters())
        assert mem["adafisher"]["normal_peak_mb"] * 2**20 >= 2 * params, (name, mem)
        assert mem["adafisher"]["capture_peak_mb"] > 0 and mem["adam"]["normal_peak_mb"] > 0
        assert mem["adafisher"]["capture_side_stream_peak_mb"] * 2**20 >= 2 * params, (name, mem)
        assert wl["statistics_floor"]["floor_ms"] > 0 and wl["statistics_floor"]["bandwidth_tbs"] > 0
        for where, value in ratio_values(wl, name):
            assert math.isfinite(value) and value > 0, (where, value)


def test_the_side_stream_capture_step_restores_the_options_and_the_stream_setting():
    from lightning_cafin.bench.matrix import NEVER, adafisher, capture_step_on
    from lightning_cafin.capture import streams

    dev = torch.device("cpu")
    wl = workloads(dev, quick=True)["resnet18"]
    t = adafisher(wl, dev, wl.batch(dev), NEVER)
    t.steps(2)
    options, before = t.opt.capture_options, streams.set_enabled(False)
    try:
        seen = []
        t.opt.register_step_pre_hook(lambda opt, args, kwargs: seen.append((opt.capture_due, streams.enabled())))
        capture_step_on(t, True)
        assert seen == [(True, True)]  # the step captured, with the side stream on
        assert t.opt.capture_options is options and streams.enabled() is False
    finally:
        streams.set_enabled(before)


def test_the_capture_step_with_python_hooks_turns_the_taps_off_for_that_step_only():
    from lightning_cafin.bench.matrix import NEVER, adafisher, capture_step_with_python_hooks
    from lightning_cafin.capture import taps

    dev = torch.device("cpu")
    wl = workloads(dev, quick=True)["resnet18"]
    t = adafisher(wl, dev, wl.batch(dev), NEVER)
    t.steps(2)
    before = taps.set_enabled(True)
    try:
        seen = []
        t.opt.register_step_pre_hook(lambda opt, args, kwargs: seen.append((opt.capture_due, taps.enabled())))
        capture_step_with_python_hooks(t)
        t.step()
        assert seen == [(True, False), (False, True)]  # the capture step had taps off; the setting came back
    finally:
        taps.set_enabled(before)


def test_the_timed_capture_steps_take_the_kept_launch_as_a_users_do(kernels_on_cpu):  # noqa: F811
    """A user's capture steps repeat one another, so each takes the factor update kept from
    the one before (``factors.KeptLaunch``); the bench's timed C++-tap capture steps must too,
    though it times a capture step with the Python hooks, one with each stream setting and one
    on the high-priority side stream between them, and it records that they did (with a
    stand-in extension that counts the layers each kept launch took)."""
    from lightning_cafin.bench.matrix import (NEVER, STREAM_SETTINGS, adafisher, capture_step_on,
                                              capture_step_with_python_hooks, measure_host_phases,
                                              measure_sync_step_state)

    dev = torch.device("cpu")
    wl = workloads(dev, quick=True)["resnet18"]
    cfg = MatrixConfig.quick()
    r = measure_sync_step_state(wl, dev, wl.batch(dev), cfg)
    assert r["sync"]["capture_kept_launch_share"] == 1.0 and r["host"]["capture_kept_launch_share"] == 1.0
    layers = r["host"]["layers"]
    # the untimed capture step kept it; every timed C++-tap capture step took it: each round's
    # default one, one per stream setting and the high-priority side stream's, then the host
    # phases' ones
    assert kernels_on_cpu.calls == [layers] * ((3 + len(STREAM_SETTINGS)) * cfg.sync_reps)

    kernels_on_cpu.calls.clear()
    t = adafisher(wl, dev, wl.batch(dev), NEVER)
    t.steps(2)  # the first step captures: it makes the factors
    host = measure_host_phases(t, reps=3)  # normal, capture, capture with Python hooks; three times
    # the first timed capture step makes every slot and keeps the launch; the next two take it
    assert kernels_on_cpu.calls == [layers, layers] and host["capture_kept_launch_share"] == 2 / 3
    capture_step_on(t, True)
    capture_step_with_python_hooks(t)
    t.capture_step()
    assert kernels_on_cpu.calls == [layers] * 4  # the side stream's took it, the Python hooks' left it


def test_the_median_interval_is_the_order_statistics_of_the_binomial_tail():
    """n = 30 at 90%: P(Binomial(30, 1/2) <= 10) = 0.049 <= 0.05 < P(<= 11), so the 11th and
    20th smallest values; n = 10: the 2nd and 9th; under 5 values no interval exists."""
    xs = [float(v) for v in range(30, 0, -1)]  # order does not matter
    assert median_interval(xs) == (11.0, 20.0)
    assert median_interval([float(v) for v in range(1, 11)]) == (2.0, 9.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None
    assert median_interval([float(v) for v in range(1, 31)], confidence=0.5) == (13.0, 18.0)
    with pytest.raises(ValueError, match="confidence"):
        median_interval(xs, confidence=1.0)


def test_the_median_interval_covers_the_median_as_often_as_it_says():
    """Skewed samples (exponential, median ln 2) of 30: the interval holds the true median in
    about 90% of 2000 draws (exactly 90.1% for continuous samples)."""
    rng = random.Random(7)
    hits = 0
    for _ in range(2000):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(30)])
        hits += low <= math.log(2.0) <= high
    assert 0.87 <= hits / 2000 <= 0.93


def test_the_ratio_of_sums_interval_resamples_the_pairs_together():
    """Blocks timed side by side vary together: resampled as pairs, a constant ratio has a
    zero-width interval, however much the blocks themselves vary; the same data, the same
    interval; and the interval holds the ratio of the sums."""
    den = [10.0, 30.0, 12.0, 25.0, 14.0, 40.0, 11.0, 9.0, 20.0, 16.0]
    num = [1.05 * d for d in den]
    low, high = ratio_of_sums_interval(num, den)
    assert low == pytest.approx(1.05) and high == pytest.approx(1.05)
    noisy = [d * (1.0 + 0.1 * ((i % 3) - 1)) for i, d in enumerate(den)]
    got = ratio_of_sums_interval(noisy, den)
    assert got == ratio_of_sums_interval(noisy, den) and got[0] < sum(noisy) / sum(den) < got[1]
    assert ratio_of_sums_interval(num[:4], den[:4]) is None
    with pytest.raises(ValueError, match="pair up"):
        ratio_of_sums_interval(num, den[:-1])


def test_a_verdict_says_undecided_where_the_interval_spans_the_goal():
    assert verdict(1.01, 1.02, [0.99, 1.015]) == "met"
    assert verdict(1.04, 1.02, [1.021, 1.06]) == "not met"
    assert verdict(1.034, 1.03, [0.99, 1.07]) == "undecided"  # over the goal by its median, not by its interval
    assert verdict(1.01, 1.02, [0.99, 1.05]) == "undecided"  # under it by its median, not by its interval
    assert verdict(1.04, 1.02) == "not met" and verdict(1.0, 1.02) == "met"  # no interval: the value decides
    assert verdict(1.5, None, [1.0, 2.0]) is None and verdict(float("nan"), 1.0) is None


def test_goals_carry_the_intervals_and_the_table_prints_them():
    wls = workloads(torch.device("cpu"), quick=True)
    r = synthetic(sync=1.034, pipelined=1.1)
    r["sync"]["normal_vs_adam_ratio"]["ci90"] = [0.99, 1.07]
    r["pipelined"]["tcov10"]["ratio_ci90"] = [1.06, 1.2]
    by_figure = {g["figure"]: g for g in goals(wls["resnet18"], r)}
    normal = by_figure["sync normal step vs Adam"]
    assert normal["met"] is False and normal["verdict"] == "undecided" and normal["interval"] == [0.99, 1.07]
    tcov10 = by_figure["pipelined TCov=10 vs Adam"]
    assert tcov10["interval"] == [1.06, 1.2] and tcov10["verdict"] == "not met"
    memory = by_figure["capture-step peak memory vs normal"]  # one measurement: no interval, the value decides
    assert memory["interval"] is None and memory["verdict"] == "met"
    table = goals_table({"resnet18": {"goals": list(by_figure.values())}})
    assert "1.034x [0.990x, 1.070x]" in table and "UNDECIDED" in table and "NOT MET" in table


def test_layer_kinds_and_no_launch_counts_without_a_gpu():
    from torch import nn

    from lightning_cafin.bench.launches import BUDGET, capture_launches, layer_kind
    from lightning_cafin.bench.matrix import count_launches, host_us_per_added_launch

    kinds = [layer_kind(m) for m in (nn.Conv2d(2, 2, 3), nn.Conv1d(2, 2, 1), nn.BatchNorm2d(2), nn.LayerNorm(4),
                                     nn.GroupNorm(1, 2), nn.Linear(2, 2), nn.Embedding(3, 2))]
    assert kinds == ["conv", "conv", "norm", "norm", "norm", "linear", "linear"] and set(BUDGET) == set(kinds)
    cpu = torch.device("cpu")
    wl = workloads(cpu, quick=True)["resnet18"]
    assert count_launches(wl, cpu, wl.batch(cpu)) is None  # counted on a GPU only
    if not torch.cuda.is_available():
        assert capture_launches(None, lambda: None, lambda: None) is None
    host = {kind: {p: {"median": m} for p, m in zip(("forward", "backward", "step"), ms)}
            for kind, ms in (("normal", (1.0, 2.0, 0.5)), ("capture", (1.5, 3.0, 1.0)))}
    assert host_us_per_added_launch({"host": host, "launches": {"added": 40.0}}) == pytest.approx(50.0)
    assert host_us_per_added_launch({"host": host, "launches": None}) is None


def test_host_speed_is_measured_on_a_gpu_only_and_printed_with_its_spread():
    from lightning_cafin.bench.host_speed import host_speed, host_speed_text

    assert host_speed(torch.device("cpu")) is None
    text = host_speed_text({"op_us": spread([20.0, 21.0, 22.0, 23.0, 24.0]), "alloc_us": spread([3.0] * 5), "calls": 200})
    assert text.startswith("host: a one-element torch op 22.00 [20.40, 23.60] us, ")
    assert "a 1 KB allocation and its free 3.00 [3.00, 3.00] us (per call, blocks of 200)" in text


def test_a_per_call_timing_prepares_each_block_untimed_before_it_runs():
    from lightning_cafin.bench.host_speed import per_call_us

    events: list[str] = []
    prepared: list[int] = []

    def prepare() -> None:
        events.append("prepare")
        time.sleep(0.02)  # (untimed: were it timed, a call would take 2 ms)
        prepared.append(len(prepared))

    def block() -> None:
        events.append(f"block after {prepared[-1]}")
        for _ in range(10):
            pass

    timed = per_call_us(block, torch.device("cpu"), calls=10, blocks=4, prepare=prepare)
    # the warm block, then four timed ones, each right after its own preparation
    assert events == [e for i in range(5) for e in ("prepare", f"block after {i}")]
    assert timed["n"] == 4 and timed["median"] < 1000.0  # microseconds per call, the sleeps left out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_speed_times_ops_and_allocations_per_call_on_a_gpu():
    from lightning_cafin.bench.host_speed import host_speed

    speed = host_speed(torch.device("cuda"), calls=50, blocks=5)
    assert speed is not None and speed["calls"] == 50
    for key in ("op_us", "alloc_us"):
        assert speed[key]["n"] == 5 and 0 < speed[key]["p10"] <= speed[key]["median"] <= speed[key]["p90"], key
