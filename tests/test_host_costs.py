"""``scripts/host_costs.py``: its report's shape on a CPU smoke run (the layers' figures; the
calls alone need a GPU) and its argument errors."""

from __future__ import annotations

import pytest
import torch

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script


def load():
    return load_script("host_costs", SCRIPTS)


def test_a_smoke_run_reports_each_models_layers_and_says_the_calls_need_a_gpu(capsys):
    assert load().main(["--device", "cpu", "--steps", "1", "--rounds", "1", "--calls", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("host costs on CPU") and lines[1] == "calls alone: on a GPU with the extension only"
    assert lines[2].startswith("a capture step above a normal one, host us per captured layer")
    rows = {line[:42].strip(): line[42:].split() for line in lines[3:]}
    assert set(rows) == set(load().layer_models(torch.device("cpu")))
    # the GPT's 12 blocks: 4 linear layers and 2 layer norms each, the final norm and the head
    assert rows["GPT 12 x 64, bf16 autocast"][:2] == ["74", "layers"]
    assert rows["ResNet-18 width 8, float32"][:2] == ["41", "layers"]  # 20 convs, 20 batch norms, the head
    assert all(len(r) == 5 for r in rows.values())  # forward, backward, step


def test_its_arguments_are_the_shared_checked_ones_without_a_workload():
    with pytest.raises(SystemExit, match="--steps must be at least 1"):
        load().parse(["--device", "cpu", "--steps", "0"])
    with pytest.raises(SystemExit):  # (it picks its own models)
        load().parse(["--device", "cpu", "--workload", "gpt"])
