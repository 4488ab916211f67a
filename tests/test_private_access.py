"""Tools use the package's public surface: no test, script, benchmark or the bench reaches
into a private attribute of a package object (``opt._captures`` and the like).

The private names are collected from the package itself (``self._x`` attributes, ``_x``
methods and class attributes, module-level ``_x`` functions and globals); every
attribute access ``obj._x`` in the tool files whose name is one of them is a finding.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_cafin"
TOOLS = [ROOT / "tests", ROOT / "scripts", ROOT / "benchmarks", ROOT / "examples", PACKAGE / "bench"]

OTHER_LIBRARIES = {"torch", "np", "numpy", "F", "nn", "dist", "os", "sys", "pl", "lightning"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def package_private_names() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                if isinstance(node.ctx, ast.Store) and private(node.attr):
                    names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name) and private(t.id))
        for node in ast.walk(tree):  # __slots__ entries
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
                if isinstance(node.value, (ast.Tuple, ast.List)):
                    names.update(e.value for e in node.value.elts
                                 if isinstance(e, ast.Constant) and isinstance(e.value, str) and private(e.value))
    return names


def tool_files() -> list[Path]:
    files: list[Path] = []
    for root in TOOLS:
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files.extend(p for p in root.rglob("*.py") if p.resolve() != Path(__file__).resolve())
    return files


def findings() -> list[str]:
    names = package_private_names()
    out = []
    for path in tool_files():
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and private(node.attr) and node.attr in names):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"} | OTHER_LIBRARIES:
                continue
            out.append(f"{rel}:{node.lineno}: .{node.attr}")
    return out


def test_the_private_names_are_found():
    names = package_private_names()
    assert {"_captures", "_slots", "_dispatch", "_deferred", "_EXT"} <= names


def test_tools_use_only_the_public_surface():
    assert findings() == []


def test_the_check_catches_an_access(tmp_path, monkeypatch):
    bad = tmp_path / "tool.py"
    bad.write_text("def f(opt):\n    return opt.binding._captures, opt.captures, opt.__class__\n")
    monkeypatch.setattr("tests.test_private_access.TOOLS", [bad])
    monkeypatch.setattr("tests.test_private_access.ROOT", tmp_path)
    assert findings() == ["tool.py:2: ._captures"]
