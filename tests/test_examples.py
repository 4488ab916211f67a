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
