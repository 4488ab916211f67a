"""``scripts/profile_capture.py``: a smoke run on the tiny workloads (the CPU stands in for
the GPU: each op's host time instead of each kernel's device time) and its argument errors."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script


def load():
    return load_script("profile_capture", SCRIPTS)


@pytest.mark.slow
def test_a_quick_run_reports_the_capture_steps_changes(tmp_path):
    script = load()
    argv = ["--quick", "--workload", "resnet18", "--steps", "1", "--rounds", "1", "--reps", "2", "--top", "6",
            "--out", str(tmp_path)]
    assert script.main(argv) == 0
    text = (tmp_path / "profile-capture-resnet18.txt").read_text()
    assert "workload resnet18: CIFAR ResNet-18 (width 8) b4, fp32; 41 layers with factors" in text
    assert re.search(r"capture - normal [+-]\d+\.\d{3} ms", text)
    rows = text.split("name\n", 1)[1].strip().splitlines()
    rows = rows[: rows.index("")] if "" in rows else rows
    assert len(rows) == 6
    changes = [abs(float(r.split()[0])) for r in rows]
    assert changes == sorted(changes, reverse=True)  # largest change first
    # the capture step's statistics are ops a normal step does not run at all
    assert any(float(r.split()[3]) == 0.0 and float(r.split()[1]) > 0 for r in rows), rows
    # then a forward's host time per captured layer, each kind of step, interleaved
    per_layer = re.findall(r"^  (.+?) +(\d+\.\d) us  \(([+-]\d+\.\d) above a normal step\)$", text, re.MULTILINE)
    assert [label for label, _, _ in per_layer] == [label for label, _, _ in script.FORWARDS]
    assert per_layer[0][2] in ("+0.0", "-0.0") and all(float(us) > 0 for _, us, _ in per_layer)
    # then, per kind of step, how far the host had got at the end of each phase (no device here: host only)
    ends = re.findall(r"^  (normal|capture) +(\d+\.\d\d) / +- +(\d+\.\d\d) / +- +(\d+\.\d\d) / +-$", text, re.MULTILINE)
    assert [kind for kind, *_ in ends] == ["normal", "capture"], text
    for _, *marks in ends:
        assert 0 < float(marks[0]) <= float(marks[1]) <= float(marks[2])  # forward, backward, step, in order
    # then, per phase, the host operations a capture step changes most, and its time outside them
    ops = text.split("host operations per phase", 1)[1].split("host, a capture step's forward", 1)[0]
    sections = re.split(r"^(forward|backward|step): ", ops, flags=re.MULTILINE)[1:]
    assert sections[0::2] == ["forward", "backward", "step"], ops
    per_section = []
    for section in sections[1::2]:
        assert re.match(r"outside every recorded operation .*: normal -?\d+\.\d{3} ms, capture -?\d+\.\d{3} ms "
                        r"\([+-]\d+\.\d{3}\)", section), section
        op_rows = section.split("name\n", 1)[1].strip().splitlines()
        assert 1 <= len(op_rows) <= 6
        op_changes = [abs(float(r.split()[0])) for r in op_rows]
        assert op_changes == sorted(op_changes, reverse=True)
        per_section.append(op_rows)
    # the capture step's own work, operations a normal step does not run: its statistics in
    # the backward, the factor update in the step
    for op_rows in per_section[1:]:
        assert any(float(r.split()[4]) == 0.0 and float(r.split()[2]) > 0 for r in op_rows), op_rows
    # then the host profile of a capture step's forward (the capture hook among its functions) and step
    assert "host, a capture step's forward (with the loss)" in text and "host, a capture step's optimizer.step()" in text
    host = text.split("host, a capture step's forward", 1)[1]
    forward, step = host.split("host, a capture step's optimizer.step()")
    for section in (forward, step):
        assert len(section.strip().splitlines()) >= 3  # the heading, then function rows
    assert "lightning_cafin" in step  # the factor update is the package's own host work


def test_device_totals_count_kernels_once_and_not_the_regions_the_host_marked():
    """On a GPU the profiler also lists the host's marked regions (``Optimizer.step#...``) as
    device events spanning their kernels and the gaps between them: counted, they added the
    step kernel twice and the host's gaps to a step's device time."""
    counted_us = load().counted_us
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(device_type, us, annotation=False):
        return SimpleNamespace(device_type=device_type, self_device_time_total=us, self_cuda_time_total=us,
                               self_cpu_time_total=us, is_user_annotation=annotation)

    assert counted_us(event(cuda, 790.0), on_gpu=True) == 790.0  # a kernel
    assert counted_us(event(cuda, 1127.0, annotation=True), on_gpu=True) == 0.0  # the step's marked region
    assert counted_us(event(cpu, 55.0), on_gpu=True) == 0.0  # a host op: its kernels are listed on their own
    assert counted_us(event(cpu, 55.0), on_gpu=False) == 55.0  # on a CPU, each op's own host time


def test_kernels_are_listed_by_name_and_template_arguments_and_host_ops_as_they_are():
    kernel = "void lightning_cafin::(anonymous namespace)::window_sums_hwc_kernel<3>(float const*, int, " + "x" * 90 + ")"
    normal = {"aten::native_batch_norm": [53.0, 1.0]}
    capture = {kernel: [16.0, 0.5], "aten::native_batch_norm": [53.0, 1.1]}
    header, first, second = load().change_rows(normal, capture, 2)
    assert first.split()[-1] == "window_sums_hwc_kernel<3>" and second.split()[-1] == "aten::native_batch_norm"


@pytest.mark.parametrize("argv, message", [
    (["--workload", "vgg"], "--workload must be one of resnet18, resnet18-bf16cl, resnet50, gpt or all, got 'vgg'"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
])
def test_bad_arguments_name_the_flag_and_what_it_takes(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load().main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
