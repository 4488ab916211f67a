"""Importing the scripts under ``benchmarks/`` and ``scripts/`` (folders of scripts, not packages)."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = BENCHMARKS.parent / "scripts"


def load(name: str, folder: Path = BENCHMARKS):
    """The script ``folder/name.py`` as a module, imported once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
