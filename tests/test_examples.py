"""Each example runs as written, on real data, and learns."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_pytorch_example_learns_and_logs(tmp_path):
    result = load("plain_pytorch").main(
        ["--max-steps", "80", "--batch-size", "64", "--eval-batches", "2", "--logdir", str(tmp_path)]
    )
    assert result["steps"] == 80
    assert result["last_loss"] < 0.8 * result["first_loss"]
    assert result["accuracy"] > 0.5
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_lightning_example_learns_and_writes_the_cafin_dashboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = load("lightning_module").main(
        ["--max-steps", "60", "--batch-size", "64", "--val-samples", "500", "--logdir", str(tmp_path)]
    )
    assert result["metrics"]["val/accuracy"] > 0.5
    events = sorted(Path(result["log_dir"]).glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[-1]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"cafin/divergence_rel", "train/loss", "val/accuracy"} <= tags
    live = EventAccumulator(str(Path(result["log_dir"]) / "cafin" / "live"))  # a series: a run of its own
    assert "cafin/step_ms" in live.Reload().Tags()["scalars"]
    assert "custom_scalars__config__" in acc.Tags()["tensors"]


def test_yaml_route_example_learns_and_writes_the_cafin_dashboard(tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_cafin.cli import main

    monkeypatch.chdir(tmp_path)
    rc = main(["fit", "--config", str(EXAMPLES / "yaml_route.yaml"), "--trainer.max_steps=60",
               "--trainer.val_check_interval=30", "--data.init_args.val_subset=500"])
    assert rc == 0
    assert "TensorBoard logs:" in capsys.readouterr().out
    events = sorted((tmp_path / "lightning_logs").glob("cafin/version_0/events.out.tfevents.*"))
    acc = EventAccumulator(str(events[-1]))
    acc.Reload()
    assert {"train/loss", "val/accuracy"} <= set(acc.Tags()["scalars"])
    live = EventAccumulator(str(events[-1].parent / "cafin" / "live"))  # a series: a run of its own
    assert "cafin/step_ms" in live.Reload().Tags()["scalars"]
    assert acc.Scalars("val/accuracy")[-1].value > 0.5
