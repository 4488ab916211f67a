"""The convergence study end to end in its smoke mode, its summary and its agreement verdict."""

import csv
import json

import pytest

from lightning_cafin.data import DEBIAN_FASHION_MNIST

from .scripts import load

study = load("convergence")
needs_fashion = pytest.mark.skipif(
    not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)",
)


@needs_fashion
def test_smoke_run_writes_every_file_with_provenance(tmp_path, capsys):
    assert study.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "convergence.json").read_text())
    assert set(result["summary"]) == {"adafisher-foreach", "adam"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convergence.csv", "convergence.json", "convergence.png",
                                                           "runs.jsonl"], "few files: the GPU machine returns 8"
    for key in ("command", "commit", "machine", "torch", "date"):
        assert result["provenance"][key]
    assert result["provenance"]["command"].startswith("python benchmarks/convergence.py --smoke")
    for run in result["runs"]:
        (epoch,) = run["epochs"]
        assert 0.0 <= epoch["test_accuracy"] <= 1.0 and epoch["train_loss"] > 0
        assert 0.0 < epoch["step_share"] < 1.0
    rows = list(csv.DictReader(open(tmp_path / "convergence.csv")))
    assert len(rows) == 2 and {r["optimizer"] for r in rows} == {"adafisher-foreach", "adam"}
    assert (tmp_path / "convergence.png").stat().st_size > 1000
    assert "final test accuracy" in capsys.readouterr().out


@needs_fashion
def test_same_seed_same_start_and_backends_agree(tmp_path):
    """Two AdaFisher backends over two seeds: the agreement verdict is computed and holds."""
    args = ["--smoke", "--out", str(tmp_path), "--optimizers", "adafisher-reference", "adafisher-foreach",
            "--seeds", "0", "1", "--epochs", "2", "--train-size", "256"]
    assert study.main(args) == 0
    result = json.loads((tmp_path / "convergence.json").read_text())
    verdict = result["agreement"]["adafisher-foreach"]
    assert verdict["seeds"] == [0, 1] and verdict["agree"]
    runs = {(r["optimizer"], r["seed"]): r for r in result["runs"]}
    # foreach is bitwise the reference: identical curves, not merely close ones
    for seed in (0, 1):
        a, b = runs[("adafisher-foreach", seed)], runs[("adafisher-reference", seed)]
        assert [e["train_loss"] for e in a["epochs"]] == [e["train_loss"] for e in b["epochs"]]
    assert runs[("adafisher-foreach", 0)]["epochs"] != runs[("adafisher-foreach", 1)]["epochs"]


@needs_fashion
def test_resume_skips_finished_runs_and_report_only_summarises(tmp_path, capsys):
    args = ["--smoke", "--out", str(tmp_path), "--optimizers", "adam", "--train-size", "128"]
    assert study.main(args) == 0
    before = (tmp_path / "runs.jsonl").read_text()
    assert len(before.splitlines()) == 1
    assert study.main(args + ["--resume"]) == 0
    assert "already done" in capsys.readouterr().out
    assert (tmp_path / "runs.jsonl").read_text() == before
    (tmp_path / "convergence.json").unlink()
    assert study.main(["--out", str(tmp_path), "--report-only"]) == 0
    assert (tmp_path / "convergence.json").is_file()


def write_runs(out, runs):
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))


def _fake_run(name, seed, accuracy):
    cfg = {"epochs": 1, "batch_size": 8, "width": 8, "train_size": 8, "test_size": 8, "target_accuracy": 0.9,
           "augment": True, "data_root": None}
    epoch = {"epoch": 1, "train_loss": 1.0, "test_loss": 1.0, "test_accuracy": accuracy, "train_s": 1.0, "eval_s": 0.1,
             "step_ms_total": 1.0, "train_step_ms_total": 4.0, "step_share": 0.25}
    prov = {"command": "x", "commit": "a" * 40, "machine": "m", "torch": "t", "date": "d"}
    return {"optimizer": name, "seed": seed, "config": cfg, "epochs": [epoch], "final_test_accuracy": accuracy,
            "time_to_target_s": None, "step_share": 0.25, "diverged": False, "provenance": prov}


def test_disagreement_beyond_seed_noise_fails_the_study(tmp_path, capsys):
    runs = [_fake_run(name, seed, acc)
            for seed, (fused, ref) in enumerate([(0.80, 0.91), (0.81, 0.92), (0.80, 0.915)])
            for name, acc in (("adafisher-fused", fused), ("adafisher-reference", ref))]
    write_runs(tmp_path, runs)
    assert study.main(["--out", str(tmp_path), "--report-only"]) == 1
    assert "DO NOT AGREE" in capsys.readouterr().out
    verdict = json.loads((tmp_path / "convergence.json").read_text())["agreement"]["adafisher-fused"]
    assert not verdict["agree"] and verdict["mean_difference"] == pytest.approx((0.80 + 0.81 + 0.80 - 0.91 - 0.92 - 0.915) / 3, abs=1e-12)


def test_agreement_within_noise_passes(tmp_path):
    runs = [_fake_run("adafisher-fused", s, a) for s, a in enumerate([0.90, 0.92, 0.91])]
    runs += [_fake_run("adafisher-reference", s, a) for s, a in enumerate([0.91, 0.90, 0.92])]
    assert study.agreement(runs)["adafisher-fused"]["agree"]
