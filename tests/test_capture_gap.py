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


@pytest.mark.parametrize("flags,where", [
    ([], "the current stream"),
    (["--side"], "the side stream"),
    (["--auto"], "the current stream ('auto' timed no trials)"),  # (a CPU times no trials: nothing to choose)
])
def test_a_smoke_run_gives_one_line_with_the_gap_the_ratio_and_the_host_per_layer(capsys, flags, where):
    argv = ["--quick", "--device", "cpu", "--workload", "gpt", "--steps", "2", "--host-steps", "1"]
    assert load().main(argv + flags) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("gpt: ") and f"statistics on {where}, 2 interleaved pairs" in line
    number = r"-?\d+\.\d+"
    assert re.search(rf"capture above normal {number} \[{number}, {number}\] ms", line)
    assert re.search(rf"capture / normal {number}x \[{number}x, {number}x\]", line)
    # the share of capture steps that took the kept factor update (the extension's launch:
    # a CPU's update is the torch loop, which keeps none)
    kept = re.search(r"; the kept factor update taken by (\d+)% of them; host above normal", line)
    assert kept is not None and kept.group(1) == "0"
    # the quick GPT's 2 blocks: 4 linear layers and 2 layer norms each, the final norm and the head
    host = re.search(rf"\(14 layers, 1 pairs\), forward / backward / step: ({number}) / ({number}) / ({number}) us$", line)
    assert host is not None


@pytest.mark.parametrize("argv,message", [
    (["--workload", "vgg"], "--workload: unknown workload 'vgg'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--host-steps", "-1"], "--host-steps must be at least 0, got -1"),
    (["--side", "--auto"], "--side and --auto each set the statistics' stream: pass one of them"),
])
def test_bad_arguments_name_their_flag(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        load().parse(["--device", "cpu"] + argv)


def test_no_host_steps_leaves_the_host_phases_out_and_says_so(capsys):
    argv = ["--quick", "--device", "cpu", "--workload", "gpt", "--steps", "2", "--host-steps", "0"]
    assert load().main(argv) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.endswith("% of them; host phases not measured (--host-steps 0)")
    assert "per captured layer" not in line


def test_pool_streams_needs_a_cuda_device_and_is_a_count_from_zero():
    with pytest.raises(SystemExit, match=re.escape("--pool-streams takes CUDA streams: pass --device cuda (got --device cpu)")):
        load().parse(["--device", "cpu", "--pool-streams", "3"])
    with pytest.raises(SystemExit, match=re.escape("--pool-streams must be at least 0, got -1")):
        load().parse(["--device", "cpu", "--pool-streams", "-1"])
    assert load().parse(["--device", "cpu"]).pool_streams == 0


def test_taking_pool_streams_advances_torchs_pool(monkeypatch):
    made = []
    monkeypatch.setattr(load().torch.cuda, "Stream", lambda *a, **k: made.append(1))
    load().take_pool_streams(3)
    assert len(made) == 3
