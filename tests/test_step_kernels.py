"""``scripts/step_kernels.py``: its report's shape on a CPU smoke run, with and without the
side stream, and its argument errors.  (Its figures mean something on a GPU only, where the
rows are the package's kernels.)"""

from __future__ import annotations

import pytest

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script


def load():
    return load_script("step_kernels", SCRIPTS)


@pytest.mark.parametrize("side", [False, True])
def test_a_smoke_run_lists_the_capture_steps_operations_in_order_and_their_total(capsys, side):
    argv = ["--quick", "--device", "cpu", "--workload", "resnet18", "--steps", "2", "--warmup", "1"]
    assert load().main(argv + (["--side"] if side else [])) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    stream = "side" if side else "current"
    assert lines[0].startswith("workload resnet18:") and f"statistics on the {stream} stream" in lines[0]
    rows = [line.split() for line in lines[1:-1]]
    assert [int(r[0]) for r in rows] == list(range(len(rows)))  # launch order, numbered
    assert any(r[2] == "AdaFisher.update_factors" for r in rows)  # a capture step: the factors were updated
    total = float(lines[-1].split()[1])
    assert lines[-1].startswith("  total ") and total == pytest.approx(sum(float(r[1]) for r in rows), abs=0.1 * len(rows))


def test_the_side_stream_is_off_unless_asked():
    assert load().parse(["--device", "cpu"]).side is False
    assert load().parse(["--device", "cpu", "--side"]).side is True


@pytest.mark.parametrize("argv,message", [
    (["--workload", "vgg"], "--workload: unknown workload 'vgg'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "0"], "--warmup must be at least 1"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        load().parse(argv + ["--device", "cpu"])
