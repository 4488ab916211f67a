"""The benchmark runs end to end in --quick mode and records what it measured, with provenance."""

import json

from lightning_cafin import bench


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
    out = capsys.readouterr().out
    assert "step_ms" in out and "faster than reference" in out
