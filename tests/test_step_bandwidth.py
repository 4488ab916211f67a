"""``scripts/step_bandwidth.py``: the bytes it counts for each optimizer's step, its report's
shape on a CPU smoke run, and its argument errors.  (Its figures mean something on a GPU
only; there the fused step runs.)"""

from __future__ import annotations

import pytest
import torch

from lightning_cafin.bench.workloads import workloads

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script

CPU = torch.device("cpu")


def load():
    return load_script("step_bandwidth", SCRIPTS)


def test_the_bytes_are_parameters_and_state_read_and_written_and_gradients_read():
    wl = workloads(CPU, quick=True)["resnet18"]
    params = sum(p.numel() for p in wl.model(CPU).parameters())
    ada, ada_bytes = load().trained_once(wl, CPU, lambda m: wl.ada_cls(m, lr=1e-3, TCov=10**9))
    assert ada.memory_usage()["momentum"] == 4 * params
    assert ada_bytes == 4 * params * (2 + 1) + 2 * ada.memory_usage()["momentum"]
    _, adam_bytes = load().trained_once(wl, CPU, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3))
    assert adam_bytes == 4 * params * (2 + 1 + 2 * 2)  # two moments, each read and written


def test_a_smoke_run_prints_each_step_beside_adam_and_the_copy(capsys):
    assert load().main(["--quick", "--device", "cpu", "--workload", "gpt", "--reps", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "workload gpt:" in out and "host us per step" in out
    for row in ("AdaFisherW ", "AdamW(fused=True) ", "copy of as many bytes ", "step vs AdamW: "):
        assert row in out, row


@pytest.mark.parametrize("argv,message", [
    (["--workload", "vgg"], "--workload: unknown workload 'vgg'"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--rounds", "-1"], "--rounds must be at least 1"),
    (["--device", "tpu"], "--device: expected cuda or cpu"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        load().parse(argv + ["--device", "cpu"] if "--device" not in argv else argv)
