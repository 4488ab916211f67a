"""``scripts/capture_variants.py``: its line's shape on a CPU smoke run (every variant, each
variant that changes another over it) and its argument errors.  (Its figures mean something on a GPU
only: a CPU has no side stream.)"""

from __future__ import annotations

import re

import pytest

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script


def load():
    return load_script("capture_variants", SCRIPTS)


def test_a_smoke_run_gives_one_line_with_every_variant_above_normal_and_over_the_one_it_changes(capsys):
    assert load().main(["--quick", "--device", "cpu", "--workload", "resnet18", "--steps", "2"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    number = r"-?\d+\.\d+"
    assert line.startswith("resnet18: ") and re.search(rf"; 2 rounds: normal {number} \[{number}, {number}\] ms", line)
    for name in ("current", "side", "side at high priority", "current, norms in hooks", "side, norms in hooks"):
        assert re.search(rf"; {re.escape(name)} \+{number} \[{number}, {number}\] ms \({number}x\)", line), name
    for name, base in (("side at high priority", "side"), ("current, norms in hooks", "current"),
                       ("side, norms in hooks", "side")):
        assert re.search(rf"; {re.escape(name)} / {base} {number}x \[{number}x, {number}x\]", line), name


@pytest.mark.parametrize("argv,message", [
    (["--workload", "vgg"], "--workload: unknown workload 'vgg'"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
])
def test_bad_arguments_name_their_flag(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        load().parse(["--device", "cpu"] + argv)
