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
