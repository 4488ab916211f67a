"""``scripts/kernels_ab.py``: two logs of ``step_kernels.py`` reports compared workload by
workload (totals, per kernel, the launches that moved most), rounds combined by their
median, runs of different launches and workloads in one log only, and its errors."""

from __future__ import annotations

import pytest

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script


def load():
    return load_script("kernels_ab", SCRIPTS)


def report(workload: str, launches: list[tuple[str, float]]) -> str:
    """A report as step_kernels.py prints it."""
    rows = [f"  {i:4d} {us:9.1f}  {name}" for i, (name, us) in enumerate(launches)]
    total = sum(us for _, us in launches)
    return "\n".join([f"workload {workload}: a model; the package's kernels in a capture step, ...", *rows,
                      f"  total {total:.1f} us: ..."])


ROWS = "channel_rows_kernel<BFloat16, (RowsRead)0, 512, 4>"
BORDER = "border_taps_kernel<BFloat16>"


def write(tmp_path, name: str, *parts: str):
    path = tmp_path / name
    path.write_text("\n".join(parts) + "\n")
    return path


def test_the_change_per_workload_per_kernel_and_per_launch(tmp_path, capsys):
    before = write(tmp_path, "b.log", "== round 1, side B", "/x/profiler.py:224: UserWarning: ...",
                   report("resnet50", [(ROWS, 50.0), (BORDER, 20.0), (ROWS, 30.0)]))
    after = write(tmp_path, "a.log", "== round 1, side A", report("resnet50", [(ROWS, 45.0), (BORDER, 20.5), (ROWS, 30.0)]))
    assert load().main([str(before), str(after), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "workload resnet50: the package's kernels per capture step 100.0 -> 95.5 us (-4.5, -4.5%)" in out
    assert f"    {ROWS}: 80.0 -> 75.0 us (-5.0, -6.2%)" in out  # the kernel's launches summed
    assert f"    {BORDER}: 20.0 -> 20.5 us (+0.5, +2.5%)" in out
    moved = out.split("moved most")[1].splitlines()[1:]
    # the two largest changes, in launch order; the unchanged third launch is left out
    assert moved == [f"       0  {ROWS}: 50.0 -> 45.0 us (-5.0)", f"       1  {BORDER}: 20.0 -> 20.5 us (+0.5)"]


def test_rounds_are_combined_by_their_median_per_launch(tmp_path, capsys):
    rounds = [report("gpt", [(ROWS, us), (ROWS, 10.0)]) for us in (30.0, 20.0, 22.0)]
    first = write(tmp_path, "b.log", *(f"== round {i}, side B\n{r}" for i, r in enumerate(rounds, 1)))
    second = write(tmp_path, "a.log", report("gpt", [(ROWS, 21.0), (ROWS, 10.0)]))
    assert load().main([str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert "32.0 -> 31.0 us (-1.0, -3.1%) (rounds: 3 and 1)" in out  # median 22.0 for the first launch


def test_runs_of_different_launches_give_per_kernel_totals_only(tmp_path, capsys):
    first = write(tmp_path, "b.log", report("resnet18", [(ROWS, 10.0), (BORDER, 5.0)]),
                  report("gpt", [(ROWS, 1.0)]))
    second = write(tmp_path, "a.log", report("resnet18", [(BORDER, 12.0)]), report("resnet50", [(ROWS, 1.0)]))
    assert load().main([str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert f"    {ROWS}: 10.0 -> 0.0 us (-10.0, -100.0%)" in out
    assert "the runs launched different kernels (2 and 1 launches): no per-launch changes" in out
    assert "moved most" not in out
    assert "only in the first log: gpt" in out and "only in the second log: resnet50" in out


def test_a_log_without_a_report_is_refused_naming_it(tmp_path, capsys):
    good = write(tmp_path, "a.log", report("gpt", [(ROWS, 1.0)]))
    empty = write(tmp_path, "b.log", "== round 1, side B", "build failed")
    assert load().main([str(empty), str(good)]) == 2
    assert f"{empty} holds no step_kernels.py report" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["missing.log", "a.log"], "first: no such file: missing.log"),
    (["a.log", "missing.log"], "second: no such file: missing.log"),
    (["a.log", "a.log", "--top", "-1"], "--top must be 0 or more, got -1"),
])
def test_bad_arguments_are_refused_naming_them(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "a.log", report("gpt", [(ROWS, 1.0)]))
    with pytest.raises(SystemExit):
        load().parse(argv)
    assert message in capsys.readouterr().err
