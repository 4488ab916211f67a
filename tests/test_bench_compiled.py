"""The compiled train step in the benchmark: the figures and goals from made-up block times,
the selection (``--only compiled``; left out of a ``--quick`` full run), and a quick run end
to end on the CPU (``aot_eager``: dynamo and AOT autograd without code generation)."""

import json
import math

import pytest

from lightning_cafin import bench
from lightning_cafin.bench.compiled import COMPILED_WORKLOADS, CompiledConfig, compiled_goals, summarise


def _compiled(breaks=17):
    return {"adam": {"seconds": 5.0, "graphs": 1, "graph_breaks": 0, "recompile_limit": 0},
            "adafisher": {"seconds": 9.0, "graphs": 21, "graph_breaks": breaks, "recompile_limit": 1, "capture_steps": 3}}


def test_summary_ratios_and_verdicts_from_made_up_blocks():
    # a capture in the third AdaFisher block: the total ratio counts it, the per-block median does not
    times = {"adam": [10.0, 10.0, 10.0, 10.0], "adafisher": [10.2, 10.1, 14.0, 10.3]}
    r = summarise(times, _compiled(), {"graphs": 0, "graph_breaks": 0, "recompile_limit": 0})
    assert r["ratio"] == pytest.approx(44.6 / 40.0)
    assert r["block_ratio"]["median"] == pytest.approx(1.025) and r["block_ratio"]["n"] == 4
    assert r["block_ratio"]["p10"] == pytest.approx(1.013) and r["block_ratio"]["p90"] == pytest.approx(1.289)
    assert r["adam_ms"]["median"] == 10.0 and r["adafisher_ms"]["median"] == pytest.approx(10.25)
    goals = {g["figure"]: g for g in r["goals"]}
    main = goals["compiled train step TCov=100 vs Adam"]
    assert main["value"] == r["ratio"] and main["limit"] == 1.05 and main["met"] is False
    assert goals["same, median per-block ratio"]["met"] is None
    assert goals["graph breaks while warming up (AdaFisher's model)"]["value"] == 17
    assert goals["frames left eager at the recompile limit (AdaFisher's model)"]["value"] == 1
    assert goals["graphs compiled while timed"]["met"] is True
    r["ratio"], r["compiled_while_timed"]["graphs"] = 1.04, 2
    assert [g["met"] for g in compiled_goals(r)] == [True, None, None, None, False]


def test_summary_refuses_unpaired_blocks():
    with pytest.raises(ValueError, match="same non-zero number of blocks"):
        summarise({"adam": [1.0, 2.0], "adafisher": [1.0]}, _compiled(), {"graphs": 0})
    with pytest.raises(ValueError, match="same non-zero number of blocks"):
        summarise({"adam": [], "adafisher": []}, _compiled(), {"graphs": 0})


def test_config_is_checked_and_the_default_spans_whole_capture_periods():
    with pytest.raises(ValueError, match=r"CompiledConfig.block must be at least 1 \(got 0\)"):
        CompiledConfig(block=0)
    cfg = CompiledConfig()
    assert cfg.TCov == 100 and (cfg.block * cfg.blocks) % cfg.TCov == 0 and cfg.backend == "inductor"
    assert cfg.warmup >= 2 * cfg.capture_every  # the first capture and at least two forced ones compile before timing


def test_selection():
    assert bench.COMPILED in bench.parse_only(None) and bench.COMPILED not in bench.parse_only(None, quick=True)
    assert bench.parse_only("compiled", quick=True) == {"compiled"}
    assert bench.parse_only("compiled:gpt") == {"compiled:gpt"} and "compiled:resnet18" in bench.parse_only(None)
    assert not {"compiled:gpt", "compiled:resnet18"} & bench.parse_only(None, quick=True)


def test_quick_compiled_run_end_to_end(tmp_path, capsys):
    assert bench.main(["--quick", "--only", "compiled", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["results"] == [] and record["matrix"]["workloads"] == {} and "callback" not in record
    r = record["compiled"]
    cfg = CompiledConfig.quick()
    assert r["config"] == {k: getattr(cfg, k) for k in r["config"]}
    assert tuple(r["workloads"]) == COMPILED_WORKLOADS
    for name, w in r["workloads"].items():
        assert w["compiler"] == "aot_eager" and w["optimizer"] == ("AdaFisherW" if name == "gpt" else "AdaFisher")
        for key in ("adam_ms", "adafisher_ms", "block_ratio"):
            sp = w[key]
            assert sp["n"] == cfg.blocks and 0 < sp["p10"] <= sp["median"] <= sp["p90"] and math.isfinite(sp["p90"])
        assert 0.2 < w["ratio"] < 5
        ada, adam = w["compile"]["adafisher"], w["compile"]["adam"]
        # Adam's model is one graph; AdaFisher's capture hooks break it once per bound module or so
        assert adam["graph_breaks"] == 0 and adam["graphs"] >= 1
        assert ada["graph_breaks"] > 0 and ada["graphs"] > adam["graphs"] and ada["capture_steps"] >= 2
        assert w["compiled_while_timed"]["graphs"] == 0
        assert len(w["goals"]) == 5
    last = capsys.readouterr().out.strip().splitlines()
    assert last[-11].split()[:2] == ["workload", "figure"]
    assert all(line.split()[0] in ("compiled:resnet18", "compiled:gpt") for line in last[-10:])
