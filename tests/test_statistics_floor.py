"""``scripts/statistics_floor.py`` (the counting itself: ``test_bench_floor.py``): its table
and its argument errors."""

from __future__ import annotations

import pytest

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script


def load():
    return load_script("statistics_floor", SCRIPTS)


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
