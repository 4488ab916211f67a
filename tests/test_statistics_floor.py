"""``scripts/statistics_floor.py``: the bytes a capture step's statistics must read, counted
per captured layer at the dtypes autocast gives, scaled to the batch; and its argument errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.bench.workloads import Workload

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "statistics_floor.py"


def load():
    spec = importlib.util.spec_from_file_location("statistics_floor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toy(autocast):
    """LayerNorm(8) -> Linear(8, 16) -> Linear(16, 4) on a batch of 6."""
    return Workload("toy", "a toy", make_model=lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 4)),
                    make_batch=lambda dev: (torch.randn(6, 8, device=dev), torch.randint(0, 4, (6,), device=dev)),
                    loss_fn=F.cross_entropy, ada_cls=AdaFisher, lr=1e-3, weight_decay=0.0, autocast=autocast)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_each_linear_counts_its_input_and_output_gradient_and_the_norm_nothing(autocast):
    script = load()
    inputs, grads, layers = script.statistics_bytes(_toy(autocast), small=2)
    assert layers == 2  # the norm is captured but reads neither tensor
    out = 4 if autocast is None else 2  # a Linear's output (and so its gradient) in the autocast dtype
    # the first Linear reads the LayerNorm's float32 output (the float32 input the
    # statistics read in the forward, not autocast's copy), the second the first's output
    assert inputs == 6 * 8 * 4 + 6 * 16 * out
    assert grads == 6 * 16 * out + 6 * 4 * out
    assert script.statistics_bytes(_toy(autocast), small=3, batch=12) == (2 * inputs, 2 * grads, 2)


def test_a_quick_run_prints_a_floor_per_workload_and_the_allowance(capsys):
    script = load()
    assert script.main(["--quick", "--workload", "resnet18", "--bandwidth", "X=1e-6"]) == 0  # 1 MB/s: a floor in ms
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "workload | layers | inputs MB | gradients MB | floor ms X | allowance ms"
    name, layers, _, _, floor, allowance = lines[1].split(" | ")
    assert name == "resnet18" and int(layers) == 21 and float(floor) > 0 and allowance == "1.00"


@pytest.mark.parametrize("argv, message", [
    (["--workload", "resnet99"], "--workload: unknown workload 'resnet99'"),
    (["--small", "0"], "--small must be at least 1"),
    (["--bandwidth", "H100"], "--bandwidth: expected NAME=TB/s"),
    (["--bandwidth", "H100=-1"], "a positive figure"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        load().main(["--quick"] + argv)
