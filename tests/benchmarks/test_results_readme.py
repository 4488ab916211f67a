"""The README's results section: generated from measured files, refused without provenance."""

import functools
import json

import pytest

from .scripts import BENCHMARKS, load
from .test_convergence import _fake_run, write_runs

readme = load("results_readme")
study = load("convergence")


def spread_around(median: float, n: int) -> dict:
    """A bench spread: ``median`` with p10 / p90 0.1 either side, over ``n`` samples."""
    return {"median": median, "p10": median - 0.1, "p90": median + 0.1, "n": n}


def _convergence_file(tmp_path):
    out = tmp_path / "conv"
    write_runs(out, [_fake_run(name, seed, acc) for seed in range(3)
                     for name, acc in (("adafisher-fused", 0.91 + seed / 1000), ("adafisher-reference", 0.912),
                                       ("adam", 0.9))])
    assert study.main(["--out", str(out), "--report-only"]) == 0
    return out / "convergence.json"


def test_the_committed_readme_matches_the_committed_results():
    assert readme.main(["--check"]) == 0


def test_study_output_is_accepted_and_rendered(tmp_path, monkeypatch):
    monkeypatch.setenv("CAFIN_COMMIT", "b" * 40)
    conv = _convergence_file(tmp_path)
    target = tmp_path / "README.md"
    target.write_text("# x\n\n## Layout\n\nstuff\n")
    assert readme.main(["--convergence", str(conv), "--readme", str(target)]) == 0
    text = target.read_text()
    assert text.index(readme.BEGIN) < text.index("## Layout")
    assert "| adafisher-fused | 0.9110 ± 0.0010 | 3 |" in text
    assert "adafisher-fused against adafisher-reference" in text and "**agree**" in text
    assert "AdaFisher[fused+graph]" in text  # the committed benchmark's rows
    once = target.read_text()
    assert readme.main(["--convergence", str(conv), "--readme", str(target)]) == 0
    assert target.read_text() == once, "regenerating is idempotent"
    assert readme.main(["--convergence", str(conv), "--readme", str(target), "--check"]) == 0
    target.write_text(once.replace("0.9110", "0.9999"))
    assert readme.main(["--convergence", str(conv), "--readme", str(target), "--check"]) == 1


@pytest.mark.parametrize("missing", ["command", "commit", "machine", "torch", "date"])
def test_files_missing_a_provenance_field_are_refused(tmp_path, capsys, missing):
    data = json.loads((BENCHMARKS.parent / "docs" / "results" / "bench-h200.json").read_text())
    del data["provenance"][missing]
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps(data))
    target = tmp_path / "README.md"
    target.write_text("# x\n")
    assert readme.main(["--bench", str(bad), "--readme", str(target)]) == 2
    assert f"provenance lacks {missing}" in capsys.readouterr().err
    assert target.read_text() == "# x\n", "nothing written"


def test_unknown_commit_and_no_block_are_refused(tmp_path):
    data = {"provenance": {"command": "c", "commit": "unknown", "machine": "m", "torch": "t", "date": "d"}}
    (tmp_path / "a.json").write_text(json.dumps(data))
    with pytest.raises(readme.ProvenanceError, match="commit"):
        readme.load_measured(tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps({"results": []}))
    with pytest.raises(readme.ProvenanceError, match="no 'provenance' block"):
        readme.load_measured(tmp_path / "b.json")


def _bench_file(tmp_path, matrix):
    data = json.loads((readme.DEFAULT_BENCH).read_text())
    if matrix is None:
        data.pop("matrix", None)
    else:
        data["matrix"] = matrix
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def _toy_matrix(goals):
    return {"config": {"block": 10, "blocks": 4, "sync_reps": 7},
            "workloads": {"toy": {"description": "a toy", "backend": "fused", "goals": goals}}}


def test_the_workload_matrix_is_rendered_with_its_verdicts(tmp_path):
    goals = [{"figure": "pipelined TCov=100 vs Adam", "value": 1.5, "unit": "x", "limit": 1.02, "met": False},
             {"figure": "sync capture step above normal", "value": 0.25, "unit": "ms", "limit": 1.0, "met": True},
             {"figure": "optimizer state vs Adam", "value": 0.5, "unit": "x", "limit": None, "met": None}]
    text = readme.matrix_section(_bench_file(tmp_path, _toy_matrix(goals)))
    assert "| toy | pipelined TCov=100 vs Adam | 1.500x | <= 1.02x | **no** |" in text
    assert "| toy | sync capture step above normal | +0.25 ms | <= 1 ms | yes |" in text
    assert "| toy | optimizer state vs Adam | 0.500x | - | - |" in text
    assert "blocks of 10 (4 per variant" in text and "in 7 rotated rounds" in text


def test_a_matrix_with_intervals_gets_their_column_and_verdicts(tmp_path):
    """A run that measured intervals: each value's interval beside it, "within noise" where
    it spans the goal, the verdict by the interval (a median over the goal whose interval
    is not wholly above it is not a miss), and the note on how to read them."""
    goals = [{"figure": "sync normal step vs Adam", "value": 1.034, "unit": "x", "limit": 1.03, "met": False,
              "interval": [0.99, 1.07], "verdict": "undecided"},
             {"figure": "pipelined TCov=10 vs Adam", "value": 1.13, "unit": "x", "limit": 1.05, "met": False,
              "interval": [1.06, 1.2], "verdict": "not met"},
             {"figure": "sync capture step above normal", "value": 0.9, "unit": "ms", "limit": 1.0, "met": True,
              "interval": [0.5, 1.2], "verdict": "undecided"},
             {"figure": "capture-step peak memory vs normal", "value": 1.0, "unit": "x", "limit": 1.05, "met": True,
              "interval": None, "verdict": "met"}]
    matrix = _toy_matrix(goals)
    text = readme.matrix_section(_bench_file(tmp_path, matrix))
    assert "| workload | figure | value | interval | goal | met |" in text
    assert "| toy | sync normal step vs Adam | 1.034x | 0.990x to 1.070x | <= 1.03x | within noise |" in text
    assert "| toy | pipelined TCov=10 vs Adam | 1.130x | 1.060x to 1.200x | <= 1.05x | **no** |" in text
    assert "| toy | sync capture step above normal | +0.90 ms | +0.50 ms to +1.20 ms | <= 1 ms | within noise |" in text
    assert "| toy | capture-step peak memory vs normal | 1.000x | - | <= 1.05x | yes |" in text
    assert readme.INTERVAL_NOTE in text
    assert "adds to a train step" not in text  # no launch counts in this run

    matrix["workloads"]["toy"].update(launches={"added": 82.0, "budget": 90, "normal": 300.0, "capture": 382.0},
                                      host_us_per_added_launch=63.4)
    text = readme.matrix_section(_bench_file(tmp_path, matrix))
    assert "`toy` +82 (budget 90, 63 us of host each)." in text
    assert "This machine's host took" not in text  # no host speed in this run

    matrix["host_speed"] = {"op_us": spread_around(31.26, 9), "alloc_us": spread_around(4.5, 9), "calls": 200}
    matrix["workloads"]["toy"]["sync"] = {"capture_above_normal_ms": spread_around(2.5, 30)}
    text = readme.matrix_section(_bench_file(tmp_path, matrix))
    assert "This machine's host took 31.3 us to issue one torch op" in text
    assert "and 4.5 us for a small allocation and its free" in text
    assert "a step-synchronous capture step's time above a normal step's was `toy` 80 ops." in text  # 2.5 ms / 31.26 us


def test_the_matrix_says_whether_its_timed_capture_steps_took_the_kept_launch(tmp_path):
    """A run that recorded it gives each workload's share; a run that did not (before the
    bench kept the launch across its Python-hooks steps) says its capture steps took the
    general path; a matrix without step-synchronous figures says neither."""
    goals = [{"figure": "sync capture step above normal", "value": 0.9, "unit": "ms", "limit": 1.0, "met": True}]
    matrix = _toy_matrix(goals)
    text = readme.matrix_section(_bench_file(tmp_path, matrix))
    assert readme.KEPT_UNRECORDED not in text and "took the factor update kept" not in text
    matrix["workloads"]["toy"]["sync"] = {"capture_above_normal_ms": spread_around(2.5, 30)}
    assert readme.KEPT_UNRECORDED in readme.matrix_section(_bench_file(tmp_path, matrix))
    matrix["workloads"]["toy"]["sync"]["capture_kept_launch_share"] = 29 / 30
    text = readme.matrix_section(_bench_file(tmp_path, matrix))
    assert readme.KEPT_UNRECORDED not in text
    assert "as a training run's repeated capture steps do: `toy` 97%." in text


def test_the_matrix_says_which_stream_its_default_rows_were_timed_on(tmp_path):
    """A run timed before 'auto' became the default (its side-stream blocks against the
    current stream) says its default rows are the current stream's; a run since, that they
    are 'auto' after its trials; a run without the side-stream blocks says neither."""
    goals = [{"figure": "sync capture step above normal", "value": 0.9, "unit": "ms", "limit": 1.0, "met": True}]
    matrix = _toy_matrix(goals)
    text = readme.matrix_section(_bench_file(tmp_path, matrix))
    assert readme.DEFAULT_WAS_CURRENT not in text and readme.DEFAULT_IS_AUTO not in text
    matrix["workloads"]["toy"]["pipelined"] = {"tcov1_side_stream": {"ms": {}, "vs_current_stream_ratio": 0.97}}
    assert readme.DEFAULT_WAS_CURRENT in readme.matrix_section(_bench_file(tmp_path, matrix))
    matrix["workloads"]["toy"]["pipelined"] = {"tcov1_side_stream": {"ms": {}, "vs_default_ratio": 0.97}}
    text = readme.matrix_section(_bench_file(tmp_path, matrix))
    assert readme.DEFAULT_IS_AUTO in text and readme.DEFAULT_WAS_CURRENT not in text


def test_a_second_matrix_run_goes_beside_this_one(tmp_path):
    """``second``: the other run's value and verdict per figure in two more columns (a dash
    for a figure it did not have), its source and kept-launch line under the table; an
    absent file adds nothing."""
    now = [{"figure": "sync capture step above normal", "value": 0.9, "unit": "ms", "limit": 1.0, "met": True},
           {"figure": "a new figure", "value": 0.97, "unit": "x", "limit": None, "met": None}]
    then = [{"figure": "sync capture step above normal", "value": 1.4, "unit": "ms", "limit": 1.0, "met": False}]
    current = _bench_file(tmp_path, _toy_matrix(now))
    (tmp_path / "then").mkdir()
    second_matrix = _toy_matrix(then)
    second_matrix["workloads"]["toy"]["sync"] = {"capture_above_normal_ms": spread_around(1.4, 30)}
    second = _bench_file(tmp_path / "then", second_matrix)
    prov = json.loads(second.read_text())["provenance"]
    text = readme.matrix_section(current, second)
    label = f"{prov['machine'].removeprefix('NVIDIA ')} at `{prov['commit'][:7]}`"
    assert f"| workload | figure | value | goal | met | second run: {label} | met there |" in text
    assert "| toy | sync capture step above normal | +0.90 ms | <= 1 ms | yes | +1.40 ms | **no** |" in text
    assert "| toy | a new figure | 0.970x | - | - | - | - |" in text
    assert f"The second run's columns: `{second}`, measured on {prov['machine']}" in text
    assert readme.KEPT_UNRECORDED in text  # the second run's steps took the general path
    assert "Its statistics floor" not in text  # (the second run knew no bandwidth)
    second_matrix["workloads"]["toy"]["statistics_floor"] = {"inputs": 6 * 10**8, "gradients": 4 * 10**8, "layers": 3,
                                                             "bandwidth_tbs": 3.35, "floor_ms": 0.2985}
    text = readme.matrix_section(current, _bench_file(tmp_path / "then", second_matrix))
    assert "Its statistics floor, at that device's peak bandwidth (3.35 TB/s;" in text
    assert "`toy` 0.30 ms (1.00 GB; the goal allows 1.00 ms)." in text
    alone = readme.matrix_section(current, tmp_path / "absent.json")
    assert alone == readme.matrix_section(current) and "| second run: " not in alone and "second run's" not in alone


def test_the_statistics_floor_is_rendered_where_the_run_knew_the_bandwidth(tmp_path):
    goals = [{"figure": "sync capture step above normal", "value": 0.9, "unit": "ms", "limit": 1.0, "met": True}]
    matrix = _toy_matrix(goals)
    matrix["workloads"]["toy"]["statistics_floor"] = {"inputs": 6 * 10**8, "gradients": 4 * 10**8, "layers": 3,
                                                      "bandwidth_tbs": None, "floor_ms": None}
    assert "least device time" not in readme.matrix_section(_bench_file(tmp_path, matrix))  # a CPU run
    matrix["workloads"]["toy"]["statistics_floor"].update(bandwidth_tbs=4.8, floor_ms=0.2083)
    text = readme.matrix_section(_bench_file(tmp_path, matrix))
    assert "at this device's peak memory bandwidth (4.80 TB/s;" in text
    assert "`toy` 0.21 ms (1.00 GB; the goal allows 1.00 ms)." in text  # the goal's ms above a normal step
    # a ratio's goal allows its share of the run's normal step; a run without that step says nothing
    matrix["workloads"]["toy"]["goals"] = [{"figure": "sync capture step vs normal", "value": 1.06, "unit": "x",
                                             "limit": 1.05, "met": False}]
    matrix["workloads"]["toy"]["sync"] = {"normal_ms": {"median": 30.0}}
    assert "`toy` 0.21 ms (1.00 GB; the goal allows 1.50 ms)." in readme.matrix_section(_bench_file(tmp_path, matrix))
    del matrix["workloads"]["toy"]["sync"]
    assert "`toy` 0.21 ms (1.00 GB)." in readme.matrix_section(_bench_file(tmp_path, matrix))


def test_a_bench_file_without_a_matrix_has_no_matrix_section(tmp_path):
    assert readme.matrix_section(_bench_file(tmp_path, None)) is None


def test_a_matrix_only_run_renders_the_matrix_section_with_its_own_source(tmp_path):
    """``--matrix``: a later matrix-only run replaces the bench file's matrix (named as its
    source, with its commit), the other sections stay the bench file's; a missing file
    leaves the bench file's matrix."""
    goals = [{"figure": "sync capture step above normal", "value": 0.5, "unit": "ms", "limit": 1.0, "met": True}]
    data = json.loads(readme.DEFAULT_BENCH.read_text())
    data["provenance"]["commit"] = "c" * 40
    data["matrix"] = {"config": {"block": 10, "blocks": 4, "sync_reps": 7},
                      "workloads": {"toy": {"description": "a toy", "backend": "fused", "goals": goals}}}
    matrix_only = tmp_path / "matrix.json"
    matrix_only.write_text(json.dumps(data))
    conv, multigpu = readme.DEFAULT_CONVERGENCE, readme.DEFAULT_MULTIGPU
    text = readme.results_section(readme.DEFAULT_BENCH, conv, multigpu, matrix_only)
    matrix_part = text[text.index("### The workload matrix"):text.index("### ", text.index("### The workload matrix") + 4)]
    assert "| toy | sync capture step above normal | +0.50 ms | <= 1 ms | yes |" in matrix_part
    assert f"`{matrix_only}`" in matrix_part and "`cccccccccccc`" in matrix_part
    assert "AdaFisher[fused+graph]" in text  # the bench file's optimizer-step table
    fallback = readme.results_section(readme.DEFAULT_BENCH, conv, multigpu, tmp_path / "absent.json")
    assert "| toy |" not in fallback and "### The workload matrix" in fallback


def _bench_with(tmp_path, key, entry):
    """The committed bench file with its ``key`` entry replaced by ``entry`` (removed when None)."""
    data = json.loads(readme.DEFAULT_BENCH.read_text())
    data.pop(key, None)
    if entry is not None:
        data[key] = entry
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def _readme_written_from(tmp_path, bench):
    """The README the generator writes (exit 0 asserted) from ``bench`` into a one-line file."""
    target = tmp_path / "README.md"
    target.write_text("# x\n")
    assert readme.main(["--bench", str(bench), "--readme", str(target)]) == 0
    return target.read_text()


def _with_callback(tmp_path, callback):
    return _bench_with(tmp_path, "callback", callback)


def test_the_callback_cost_is_rendered_with_its_verdicts(tmp_path):
    sp = functools.partial(spread_around, n=40)
    callback = {
        "description": "a toy in a Lightning Trainer", "backend": "fused",
        "config": {"warmup": 100, "block": 10, "blocks": 60, "count_steps": 100, "log_every_n_steps": 50, "TCov": 100},
        "blocks": {"timed": 60, "quiet": 41}, "quiet_ratio": sp(1.004), "overall_ratio": 1.03,
        "bare_ms": sp(20.0), "callback_ms": sp(20.08), "extra_ms": {"logging": sp(12.5), "capture": sp(0.4), "shadow": None},
        "goals": [{"figure": "Lightning step with CAFINCallback vs without", "value": 1.004, "unit": "x", "limit": 1.01,
                   "met": True},
                  {"figure": "same, all steps (logging, captures)", "value": 1.03, "unit": "x", "limit": None, "met": None},
                  {"figure": "dashboard host syncs per non-logging step", "value": 1.0, "unit": "count", "limit": 0.0,
                   "met": False}],
    }
    path = _with_callback(tmp_path, callback)
    text = readme.callback_section(path)
    assert "| Lightning step with CAFINCallback vs without | 1.004x | <= 1.01x | yes |" in text
    assert "| same, all steps (logging, captures) | 1.030x | - | - |" in text
    assert "| dashboard host syncs per non-logging step | 1 | <= 0 | **no** |" in text
    assert "| a logging step: callback above bare | 12.50 [12.40, 12.60] |" in text
    assert "| a shadow step: callback above bare | - |" in text
    assert "the 41 of 60 blocks" in text and "blocks of 10 steps (60 per fit after 100 warm-up steps)" in text
    assert "Source: " in text
    written = _readme_written_from(tmp_path, path)
    assert "1.004x" in written and "no `callback` entry" not in written


def test_a_bench_file_without_the_callback_says_not_measured_yet(tmp_path):
    text = readme.callback_section(_with_callback(tmp_path, None))
    assert "Not measured yet" in text and "--only callback" in text


def test_the_readme_communication_table_is_the_committed_measurement():
    from benchmarks import communication

    assert communication.main(["--check"]) == 0, "run python benchmarks/communication.py"


def _with_compiled(tmp_path, compiled):
    return _bench_with(tmp_path, "compiled", compiled)


def test_the_compiled_step_is_rendered_with_its_verdicts(tmp_path):
    sp = functools.partial(spread_around, n=20)
    goals = [{"figure": "compiled train step TCov=100 vs Adam", "value": 1.031, "unit": "x", "limit": 1.05, "met": True},
             {"figure": "same, median per-block ratio", "value": 1.02, "unit": "x", "limit": None, "met": None},
             {"figure": "graphs compiled while timed", "value": 1.0, "unit": "count", "limit": 0.0, "met": False}]
    compile_ = {"adam": {"seconds": 31.2, "graphs": 1, "graph_breaks": 0, "recompile_limit": 0},
                "adafisher": {"seconds": 64.7, "graphs": 22, "graph_breaks": 21, "recompile_limit": 0, "capture_steps": 3}}
    compiled = {"config": {"warmup": 30, "capture_every": 10, "block": 20, "blocks": 20, "TCov": 100, "backend": "inductor"},
                "workloads": {"toy": {"description": "a toy", "optimizer": "AdaFisher", "baseline": "Adam(fused=True)",
                                      "backend": "fused", "compiler": "inductor", "adam_ms": sp(10.0), "adafisher_ms": sp(10.3),
                                      "ratio": 1.031, "block_ratio": sp(1.02), "compile": compile_,
                                      "compiled_while_timed": {"graphs": 1}, "goals": goals, "warnings": []}}}
    path = _with_compiled(tmp_path, compiled)
    text = readme.compiled_section(path)
    assert "| toy | compiled train step TCov=100 vs Adam | 1.031x | <= 1.05x | yes |" in text
    assert "| toy | same, median per-block ratio | 1.020x | - | - |" in text
    assert "| toy | graphs compiled while timed | 1 | <= 0 | **no** |" in text
    assert "| toy | 10.00 [9.90, 10.10] | 10.30 [10.20, 10.40] | 1.020x [0.920, 1.120] | 31 / 65 | 1 / 22 |" in text
    assert "`torch.compile(model)` (inductor)" in text and "blocks of 20 (20 per variant" in text
    assert "Source: " in text
    written = _readme_written_from(tmp_path, path)
    assert "1.031x" in written and "no `compiled` entry" not in written


def test_a_bench_file_without_the_compiled_step_says_not_measured_yet(tmp_path):
    text = readme.compiled_section(_with_compiled(tmp_path, None))
    assert "Not measured yet" in text and "--only compiled" in text


def test_the_multigpu_section_renders_the_committed_runs_or_says_not_measured(tmp_path):
    from benchmarks import results_readme

    assert "Not measured yet" in results_readme.multigpu_section(tmp_path / "none")
    text = results_readme.multigpu_section(results_readme.DEFAULT_MULTIGPU)
    assert "| gpt/fsdp2 | 1 |" in text and "multigpu-1.json" in text
