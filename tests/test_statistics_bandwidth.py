"""``scripts/statistics_bandwidth.py``: the layers it times are the ones whose statistics read
their tensors (the floor's count), its report's shape on a CPU smoke run, and its argument
errors.  (Its figures mean something on a GPU only; there the extension's kernels run.)"""

from __future__ import annotations

import pytest
import torch

from lightning_cafin.bench.floor import statistics_bytes
from lightning_cafin.bench.workloads import workloads

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script
from .capture.test_gradient_taps import ext  # noqa: F401  (the built extension, or a skip / a failure under CI)

CPU = torch.device("cpu")


def load():
    return load_script("statistics_bandwidth", SCRIPTS)


@pytest.mark.parametrize("name", ["resnet50", "gpt"])
def test_the_pairs_are_the_floors_layers_and_bytes_and_each_call_gives_finite_sums(ext, name):  # noqa: F811
    wl = workloads(CPU, quick=True)[name]
    pairs = load().layer_pairs(wl, CPU)
    counted = statistics_bytes(wl, CPU)
    assert len(pairs) == counted.layers
    assert sum(p.nbytes for p in pairs) == counted.inputs + counted.gradients
    assert {p.what for p in pairs} == ({"conv", "rows"} if name == "resnet50" else {"rows"})
    assert all(p.apart is None for p in pairs)  # (the separate ops take CUDA tensors only)
    for p in pairs[:5]:
        h, s = p.run()
        assert torch.isfinite(h).all() and torch.isfinite(s).all() and s.numel() == p.grad.shape[1 if p.grad.dim() == 4 else -1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the extension's separate ops need a CUDA GPU")
@pytest.mark.parametrize("name", ["resnet18-bf16cl", "resnet18", "gpt"])
def test_the_ops_apart_give_the_one_calls_sums_on_the_gpu(ext, name):  # noqa: F811
    """The report's "apart" column times the same sums as the layer's one call: per layer, the
    input's op and the gradient's give its (h, s) (a convolution's window sums, its rows, a
    linear layer's tokens)."""
    device = torch.device("cuda")
    pairs = load().layer_pairs(workloads(device, quick=True)[name], device)
    assert pairs and all(p.apart is not None for p in pairs)
    for p in pairs:
        (h, s), (h_apart, s_apart) = p.run(), p.apart()
        torch.testing.assert_close(h_apart, h, rtol=1e-5, atol=0, msg=lambda m, p=p: f"{p.name} h: {m}")
        torch.testing.assert_close(s_apart, s, rtol=1e-5, atol=0, msg=lambda m, p=p: f"{p.name} s: {m}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the breakdown of a call into kernels needs a CUDA GPU")
def test_a_convolutions_breakdown_names_its_kernels_on_both_kinds_of_values(ext):  # noqa: F811
    """On a GPU, a channels_last bf16 convolution's one call names its input statistics'
    kernel (a 3 x 3 with padding 1 at stride 1, or 2 on an even map: its border or parity
    sums; else phase 2 folded into phase 1's launch, or a launch of its own where it does
    not fold), and its ops apart name the gradient's rows kernel too."""
    device = torch.device("cuda")
    pairs = load().layer_pairs(workloads(device, quick=True)["resnet18-bf16cl"], device)
    conv = next(p for p in pairs if p.what == "conv" and p.x.dtype == torch.bfloat16)
    lines = load().kernel_lines(conv, 2)
    assert lines[0].startswith(f"  {conv.name}: ") and len(lines) == 1 + 4
    assert [line.split()[0] for line in lines[1:]] == ["real", "real", "random", "random"]
    for line in lines[1:]:
        head, kernels = line.split(" us: ")
        assert any(k in kernels for k in ("border_taps_kernel", "sumsq_windows_and_rows_kernel",
                                          "window_sums_hwc_kernel")), line
        if " apart " in head:
            assert "channel_rows_kernel" in kernels, line


def test_a_smoke_run_prints_totals_per_read_and_the_slowest_layers(ext, capsys):  # noqa: F811
    assert load().main(["--quick", "--device", "cpu", "--workload", "resnet18", "--reps", "1", "--rounds", "1",
                        "--top", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("workload resnet18: ") and "21 layers whose statistics read their tensors; CPU" in lines[0]
    totals = {line.split(":")[0].strip(): line for line in lines[1:4]}
    assert set(totals) == {"conv", "rows", "all"} and "21 layers" in totals["all"]
    assert lines[4].startswith("the 3 layers where the package takes most")
    assert len(lines) == 6 + 3 and all(" layer" in line or ": (" in line for line in lines[6:])


def test_kernels_breaks_the_worst_layers_down_on_their_tensors_and_on_random_ones(ext, capsys):  # noqa: F811
    assert load().main(["--quick", "--device", "cpu", "--workload", "resnet18", "--reps", "1", "--rounds", "1",
                        "--top", "3", "--kernels", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("the 2 layers whose one call takes most"))
    assert at == 6 + 3 and "above torch's read" in lines[at]  # (a CPU has no ops apart)
    broken = lines[at + 1:]
    assert len(broken) == 2 * 3 and [line.split()[0] for line in broken[1::3]] == ["real"] * 2
    assert all(line.split()[:3] == ["random", "one", "call"] for line in broken[2::3])
    # each call's ops by name, the extension's among them, and its total the sum of them
    for line in broken[1::3] + broken[2::3]:
        total, ops = line.split(" us: ")
        assert "lightning_cafin::layer_stats" in ops
        assert float(total.split()[-1]) > 0


@pytest.mark.parametrize("argv, message", [
    (["--workload", "resnet99"], "--workload: unknown workload 'resnet99'"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--device", "tpu"], "--device: expected cuda or cpu"),
    (["--kernels", "-1"], "--kernels must be at least 0"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        load().parse(["--device", "cpu"] + argv)


def test_cuda_without_a_gpu_is_refused_with_the_smoke_run_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="pass --device cpu --quick"):
        load().parse([])
