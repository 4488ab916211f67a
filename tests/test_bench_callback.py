"""The callback's cost in the benchmark: two interleaved Lightning fits end to end on the CPU
(quick sizes), and the figures and goals computed from their blocks."""

import json
import math
import threading

import pytest

from lightning_cafin import bench
from lightning_cafin.bench.callback_overhead import Baton, Block, CallbackConfig, callback_goals, summarise


def test_quick_callback_run_writes_a_well_formed_ratio(tmp_path, capsys):
    assert bench.main(["--quick", "--only", "callback", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["results"] == [] and record["matrix"]["workloads"] == {}
    r = record["callback"]
    cfg = CallbackConfig.quick()
    assert r["config"] == {k: getattr(cfg, k) for k in r["config"]}
    # quick: blocks of 2 from step 2 to 14, logging at 5 and 11, captures at 6 and 12: two quiet blocks
    assert r["blocks"] == {"timed": cfg.blocks, "quiet": 2}
    for key in ("quiet_ratio", "bare_ms", "callback_ms"):
        sp = r[key]
        assert sp["n"] == 2 and 0 < sp["p10"] <= sp["median"] <= sp["p90"] and math.isfinite(sp["p90"]), (key, sp)
    assert 0.2 < r["quiet_ratio"]["median"] < 5 and 0.2 < r["overall_ratio"] < 5
    assert r["extra_ms"]["logging"]["n"] == 2 and r["extra_ms"]["capture"]["n"] == 2
    assert r["extra_ms"]["shadow"] is None  # the default shadow step (1) is in the warm-up
    # counted steps 14..19: one logs (17), where the dashboard reads its figures; the others read nothing
    assert r["syncs"]["quiet"] == {"steps": 5, "total": 0, "max": 0}
    assert r["syncs"]["logging"]["steps"] == 1 and r["syncs"]["logging"]["total"] > 0
    goals = {g["figure"]: g for g in r["goals"]}
    assert goals["Lightning step with CAFINCallback vs without"]["value"] == r["quiet_ratio"]["median"]
    assert goals["dashboard host syncs per non-logging step"]["met"] is True
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-4].split()[:2] == ["workload", "figure"] and all(line.startswith("callback") for line in out[-3:])


def blocks(ms, tags):
    return [Block(2 * i, m, t) for i, (m, t) in enumerate(zip(ms, tags))]


def test_summary_pairs_quiet_blocks_and_prices_tagged_steps():
    tags = [[], ["logging"], ["capture"], [], ["shadow", "logging"]]
    bare = blocks([10.0, 10.0, 12.0, 10.0, 10.0], tags)
    cb = blocks([10.1, 13.0, 12.5, 10.3, 20.0], [[], ["logging"], ["capture"], ["logging"], ["shadow", "logging"]])
    r = summarise({"bare": bare, "callback": cb}, [("quiet", 0), ("logging", 7), ("quiet", 0)], block=2)
    # block 3 logged in the callback's fit only: not quiet
    assert r["blocks"] == {"timed": 5, "quiet": 1}
    assert r["quiet_ratio"]["median"] == pytest.approx(1.01)
    assert r["overall_ratio"] == pytest.approx(65.9 / 52.0)
    assert r["extra_ms"]["capture"]["median"] == pytest.approx(1.0)  # 0.5 ms/step over a block of 2
    assert r["extra_ms"]["logging"]["n"] == 3 and r["extra_ms"]["shadow"]["median"] == pytest.approx(20.0)
    assert r["syncs"] == {"logging": {"steps": 1, "total": 7, "max": 7}, "quiet": {"steps": 2, "total": 0, "max": 0}}
    verdict = {g["figure"]: g["met"] for g in callback_goals(r)}
    assert verdict == {"Lightning step with CAFINCallback vs without": True,
                       "same, all steps (logging, captures)": None, "dashboard host syncs per non-logging step": True}
    r["quiet_ratio"]["median"], r["syncs"]["quiet"]["max"] = 1.02, 1
    assert [g["met"] for g in callback_goals(r)] == [False, None, False]


def test_summary_refuses_unpaired_or_all_tagged_blocks():
    with pytest.raises(RuntimeError, match="different blocks"):
        summarise({"bare": blocks([1.0], [[]]), "callback": blocks([1.0, 1.0], [[], []])}, [], block=2)
    with pytest.raises(RuntimeError, match="no block without"):
        summarise({"bare": blocks([1.0], [["capture"]]), "callback": blocks([1.0], [["capture"]])}, [], block=2)


def test_baton_alternates_and_skips_a_finished_thread():
    baton, seen = Baton(("a", "b")), []

    def run(name, turns):
        baton.take(name)
        for _ in range(turns):
            seen.append(name)
            baton.hand_over(name)
        seen.append(name)
        baton.pass_on(name, finished=True)

    threads = [threading.Thread(target=run, args=("b", 1)), threading.Thread(target=run, args=("a", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert seen == ["a", "b", "a", "b", "a", "a"]  # b finished: a runs on alone


def test_config_refuses_blocks_that_cannot_be_timed():
    with pytest.raises(ValueError, match="count_steps must be at least 1"):
        CallbackConfig(count_steps=0)
    with pytest.raises(ValueError, match="warmup must be a multiple of block=10"):
        CallbackConfig(warmup=15)
    assert CallbackConfig().timed_end == 700 and CallbackConfig.quick().timed_end == 14
