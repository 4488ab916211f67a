"""The setup scripts' shell logic (scripts/venv.sh), run with a stand-in venv Python.

The real path (a stock /usr/bin/python3, torch installed into .venv, the quick start run)
is what ``.ci/run`` does on a clean clone; here: rerunning skips what is done, and the
interpreter choice.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the scripts are bash")


@pytest.fixture
def project(tmp_path):
    """A copy of the files the install stamp keys on, and a .venv whose python records its calls."""
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(REPO / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\n')
    python.chmod(0o755)
    return tmp_path


# The stand-in installs nothing: the free-space preflight is tested on its own below.
_NO_SPACE_NEEDED = {"CAFIN_INSTALL_NEEDS_GB": "0", "CAFIN_INSTALL_TMP_NEEDS_GB": "0"}


def _source(project: Path, commands: str, **env: str) -> str:
    script = f"set -euo pipefail; source {REPO / 'scripts' / 'venv.sh'}; {commands}"
    return subprocess.run(["bash", "-c", script], cwd=project, capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", **_NO_SPACE_NEEDED, **env}).stdout


def _calls(project: Path) -> list[str]:
    path = project / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_rerunning_skips_the_install(project):
    out = _source(project, 'install_project ""; install_project ""')
    assert _calls(project) == ["-m pip install -q -e ."]
    assert "skipped" in out.splitlines()[-1]


def test_fewer_extras_than_installed_skip_more_extras_install_the_union(project):
    _source(project, 'install_project "dev,cuda-build"; install_project ""; install_project "cuda-build"')
    assert _calls(project) == ["-m pip install -q -e .[cuda-build,dev]"]
    _source(project, 'install_project "dev,other"')
    assert _calls(project)[-1] == "-m pip install -q -e .[cuda-build,dev,other]"


def test_a_changed_pyproject_reinstalls(project):
    _source(project, 'install_project ""')
    (project / "pyproject.toml").write_text((project / "pyproject.toml").read_text() + "\n# changed\n")
    _source(project, 'install_project ""')
    assert len(_calls(project)) == 2


def test_python_defaults_to_the_system_interpreter_and_honours_PYTHON(project):
    expected = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"
    assert _source(project, 'echo "$PYTHON"').strip() == expected
    assert _source(project, 'echo "$PYTHON"', PYTHON="/opt/py/bin/python3.12").strip() == "/opt/py/bin/python3.12"


def test_an_existing_venv_is_reused(project):
    out = _source(project, 'ensure_venv; echo "venv: $VENV"')
    assert "creating" not in out and out.strip().endswith(str(project / ".venv"))


def test_an_install_that_would_not_fit_stops_before_pip_and_says_what_to_free(project):
    script = f"set -euo pipefail; source {REPO / 'scripts' / 'venv.sh'}; install_project dev"
    env = {"PATH": "/usr/bin:/bin", "CAFIN_INSTALL_NEEDS_GB": str(10**9), "CAFIN_INSTALL_TMP_NEEDS_GB": "0"}
    run = subprocess.run(["bash", "-c", script], cwd=project, capture_output=True, text=True, env=env)
    assert run.returncode == 1
    assert _calls(project) == []
    assert "GB free" in run.stderr and "VENV=" in run.stderr and "TMPDIR=" in run.stderr


def _ab_tree(tmp_path: Path, bench_fails_on: str = "") -> Path:
    """A checkout holding the two scripts and a file the patch changes, and a stand-in
    python3 whose 'bench' prints a capture-step row naming the file's content."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("gpu_ab.sh", "gpu_env.sh"):
        shutil.copy(REPO / "scripts" / name, tree / "scripts" / name)
    (tree / "speed.txt").write_text("slow\n")
    (tmp_path / "b.patch").write_text("--- a/speed.txt\n+++ b/speed.txt\n@@ -1 +1 @@\n-slow\n+fast\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"
    python.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *loader*) exit 0 ;;\n'
        f'  *bench*) if [ "$(cat speed.txt)" = "{bench_fails_on}" ]; then echo boom; exit 1; fi\n'
        '    echo "resnet18-bf16cl  sync capture step above normal  $(cat speed.txt)" ;;\n'
        "esac\n")
    python.chmod(0o755)
    return tree


def _run_ab(tmp_path: Path, tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(tree / "scripts" / "gpu_ab.sh"), *args], cwd=tmp_path, capture_output=True,
                          text=True, env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                                          **env})


@pytest.mark.skipif(shutil.which("git") is None, reason="gpu_ab.sh applies its patch with git apply")
def test_gpu_ab_alternates_the_checkout_and_the_patched_one_and_leaves_the_checkout_as_it_was(tmp_path):
    tree = _ab_tree(tmp_path)
    done = _run_ab(tmp_path, tree, "b.patch", AB_ROUNDS="2")
    assert done.returncode == 0, done.stderr
    table = [line.split() for line in done.stdout.splitlines()]
    # the rows last, side A's rounds then side B's: A ran the checkout, B the patched one
    assert [(row[1], row[2], row[-1]) for row in table] == [("1", "A", "slow"), ("2", "A", "slow"),
                                                            ("1", "B", "fast"), ("2", "B", "fast")]
    assert (tree / "speed.txt").read_text() == "slow\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ab.txt", "bench-A.log", "bench-B.log",
                                                                     "build-A.log", "build-B.log"]


@pytest.mark.skipif(shutil.which("git") is None, reason="gpu_ab.sh applies its patch with git apply")
def test_gpu_ab_runs_ab_cmd_instead_of_the_bench_and_keeps_its_rows(tmp_path):
    tree = _ab_tree(tmp_path, bench_fails_on="slow")  # the bench would fail: AB_CMD runs instead
    done = _run_ab(tmp_path, tree, "b.patch", AB_ROUNDS="1", AB_CMD="echo kernel $(cat speed.txt); echo noise",
                   AB_ROWS="^kernel")
    assert done.returncode == 0, done.stderr
    assert [line.split()[1:] for line in done.stdout.splitlines()] == [["1", "A", "kernel", "slow"],
                                                                      ["1", "B", "kernel", "fast"]]
    failing = _run_ab(tmp_path, tree, "b.patch", AB_CMD="echo bad; exit 3")
    assert failing.returncode == 1 and "side A's AB_CMD failed" in failing.stderr and "bad" in failing.stderr
    assert (tree / "speed.txt").read_text() == "slow\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="gpu_ab.sh applies its patch with git apply")
def test_gpu_ab_refuses_a_missing_or_stale_patch_and_restores_the_checkout_after_a_failure(tmp_path):
    tree = _ab_tree(tmp_path, bench_fails_on="fast")
    missing = _run_ab(tmp_path, tree, "none.patch")
    assert missing.returncode == 2 and "usage: bash scripts/gpu_ab.sh PATCH" in missing.stderr
    assert _run_ab(tmp_path, tree, "b.patch", AB_ROUNDS="0").returncode == 2
    failed = _run_ab(tmp_path, tree, "b.patch")  # side B's bench fails
    assert failed.returncode == 1 and "side B's bench failed" in failed.stderr and "boom" in failed.stderr
    assert (tree / "speed.txt").read_text() == "slow\n"  # the patch taken out again
    (tree / "speed.txt").write_text("other\n")
    stale = _run_ab(tmp_path, tree, "b.patch")
    assert stale.returncode == 2 and "does not apply" in stale.stderr


def test_gpu_side_study_runs_the_tests_the_variants_per_workload_and_step_gaps_per_process(tmp_path):
    """``gpu_side_study.sh`` with a stand-in python3 that logs its arguments: the build, the
    side stream's tests, ``capture_variants.py`` per workload (per CUDA_DEVICE_MAX_CONNECTIONS
    value of SIDE_CONNECTIONS, its lines marked with it), ``step_gaps.py`` once per fresh
    process, four logs under $OUT and their lines printed last (a warning's line not)."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("gpu_side_study.sh", "gpu_env.sh"):
        shutil.copy(REPO / "scripts" / name, tree / "scripts" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"
    python.write_text(
        "#!/bin/sh\n"
        f'echo "$* (${{CUDA_DEVICE_MAX_CONNECTIONS:-unset}})" >> {tmp_path / "calls.txt"}\n'
        'case "$*" in\n'
        '  *pytest*) echo "4 passed" ;;\n'
        '  *capture_variants*) echo "warning: a warning"; echo "$3: a model; 16 rounds: normal 1 ms" ;;\n'
        '  *step_gaps*) echo "workload resnet18"; echo "  side - normal  0.5" ;;\n'
        "esac\n")
    python.chmod(0o755)

    def run(out: str, **env: str) -> tuple[list[str], list[str]]:
        (tmp_path / "calls.txt").unlink(missing_ok=True)
        done = subprocess.run(["bash", str(tree / "scripts" / "gpu_side_study.sh")], cwd=tmp_path, capture_output=True,
                              text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / out),
                                              "SIDE_WORKLOADS": "resnet50 gpt", **env})
        assert done.returncode == 0, done.stderr
        return (tmp_path / "calls.txt").read_text().splitlines(), done.stdout.splitlines()

    variants = ["scripts/capture_variants.py --workload resnet50 --steps 16", "scripts/capture_variants.py --workload gpt --steps 16"]
    lines = ["resnet50: a model; 16 rounds: normal 1 ms", "gpt: a model; 16 rounds: normal 1 ms"]
    calls, printed = run("out", SIDE_PROCESSES="2")
    assert calls[0] == "-m lightning_cafin.kernels.loader --build (unset)"
    assert calls[1].startswith("-m pytest") and "-m cuda tests/capture/test_hooks.py -k side_stream" in calls[1]
    assert calls[2:] == [f"{v} (unset)" for v in variants] + ["scripts/step_gaps.py --workload resnet18 (unset)"] * 2
    assert printed == ["side-stream tests rc=0: 4 passed", *lines, "=== process 1", "  side - normal  0.5",
                       "=== process 2", "  side - normal  0.5"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["build.log", "gaps.log", "side_tests.log",
                                                                     "variants.log"]
    # each connections value its own processes, its lines marked with it ("default": the machine's setting)
    calls, printed = run("out2", SIDE_PROCESSES="0", SIDE_CONNECTIONS="default 32")
    assert calls[2:] == [f"{v} (unset)" for v in variants] + [f"{v} (32)" for v in variants]
    assert printed[1:] == lines + [f"connections 32: {line}" for line in lines]
