"""``scripts/capture_gap.py``: its line's shape on a CPU smoke run, on either stream, and its
argument errors (a count spelled with a dash among them).  (Its figures mean something on a
GPU only.)"""

from __future__ import annotations

import re

import pytest

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script


def load():
    return load_script("capture_gap", SCRIPTS)


@pytest.mark.parametrize("side", [False, True])
def test_a_smoke_run_gives_one_line_with_the_gap_the_ratio_and_the_host_per_layer(capsys, side):
    argv = ["--quick", "--device", "cpu", "--workload", "gpt", "--steps", "2", "--host-steps", "1"]
    assert load().main(argv + (["--side"] if side else [])) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    stream = "side" if side else "current"
    assert line.startswith("gpt: ") and f"statistics on the {stream} stream, 2 interleaved pairs" in line
    number = r"-?\d+\.\d+"
    assert re.search(rf"capture above normal {number} \[{number}, {number}\] ms", line)
    assert re.search(rf"capture / normal {number}x \[{number}x, {number}x\]", line)
    # the quick GPT's 2 blocks: 4 linear layers and 2 layer norms each, the final norm and the head
    host = re.search(rf"\(14 layers, 1 pairs\), forward / backward / step: ({number}) / ({number}) / ({number}) us$", line)
    assert host is not None


@pytest.mark.parametrize("argv,message", [
    (["--workload", "vgg"], "--workload: unknown workload 'vgg'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--host-steps", "0"], "--host-steps must be at least 1, got 0"),
])
def test_bad_arguments_name_their_flag(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        load().parse(["--device", "cpu"] + argv)
