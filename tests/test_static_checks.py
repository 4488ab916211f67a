"""The package, its tests, benchmarks and examples stay lint-clean (ruff), and the package type-checks
(mypy) at the strictness in pyproject.toml.

Each check runs when its tool is installed (``pip install -e .[dev]``) and is skipped,
saying so, when it is not.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install '.[dev]')")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


#: what ruff checks: the package and the code that exercises it (a lint error in a test
#: hides a test that no longer tests anything, such as a loop variable a closure misses)
LINTED = ("lightning_cafin", "tests", "benchmarks", "examples", "scripts")


def test_ruff_finds_nothing_in_the_package_tests_benchmarks_examples_and_scripts():
    out = run_tool("ruff", "check", *LINTED)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy_finds_nothing_in_the_package():
    out = run_tool("mypy")  # files and strictness: [tool.mypy] in pyproject.toml
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_package_ships_its_type_hints():
    assert os.path.isfile(os.path.join(ROOT, "lightning_cafin", "py.typed"))
