"""Packaging hook: the CUDA sources in ``csrc/`` travel inside the package.

The extension is built on first use from ``lightning_cafin/csrc`` when the package was
installed from a wheel or an sdist (the loader falls back to the repository's ``csrc/``
in a checkout or an editable install).  Everything else is in ``pyproject.toml``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC_SUFFIXES = {".cu", ".cuh", ".cpp", ".h"}


class BuildPyWithCsrc(build_py):
    """``build_py`` that also copies ``csrc/*`` to ``lightning_cafin/csrc`` in the build."""

    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / "csrc"
        dst = Path(self.build_lib) / "lightning_cafin" / "csrc"
        dst.mkdir(parents=True, exist_ok=True)
        for path in sorted(src.iterdir()):
            if path.suffix in CSRC_SUFFIXES:
                self.copy_file(str(path), str(dst / path.name))


setup(cmdclass={"build_py": BuildPyWithCsrc})
