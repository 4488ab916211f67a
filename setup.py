"""Packaging hook: the CUDA sources in ``csrc/`` travel inside the package, and
``LIGHTNING_CAFIN_BUILD=1`` builds the extension into it at install time.

The extension is built on first use from ``lightning_cafin/csrc`` when the package was
installed from a wheel or an sdist (the loader falls back to the repository's ``csrc/``
in a checkout or an editable install).  With ``LIGHTNING_CAFIN_BUILD=1 pip install .``
the build happens here instead, once: the module lands in
``lightning_cafin/kernels/prebuilt`` with the torch/CUDA/Python versions it fits, and the
wheel is tagged for this platform.  That needs torch (a CUDA build) and a compiler
already in the environment pip installs into (the loader's usual toolchain search,
NVIDIA's toolkit wheels included).  Everything else is in ``pyproject.toml``.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

CSRC_SUFFIXES = {".cu", ".cuh", ".cpp", ".h"}
ROOT = Path(__file__).resolve().parent


def _build_requested() -> bool:
    return os.environ.get("LIGHTNING_CAFIN_BUILD", "").strip().lower() not in ("", "0", "false", "no")


def _environment_outside_build_isolation() -> dict:
    """The install target's own environment: pip's isolated build hides its site-packages (and torch)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    return env


class BuildPyWithCsrc(build_py):
    """``build_py`` that copies ``csrc/*`` to ``lightning_cafin/csrc`` and, on request, builds the extension."""

    def run(self) -> None:
        super().run()
        dst = Path(self.build_lib) / "lightning_cafin" / "csrc"
        dst.mkdir(parents=True, exist_ok=True)
        for path in sorted((ROOT / "csrc").iterdir()):
            if path.suffix in CSRC_SUFFIXES:
                self.copy_file(str(path), str(dst / path.name))
        if _build_requested():
            self._build_extension()

    def _build_extension(self) -> None:
        output = (Path(self.build_lib) / "lightning_cafin" / "kernels" / "prebuilt").resolve()
        env = _environment_outside_build_isolation()
        env["PYTHONPATH"] = str(Path(self.build_lib).resolve())
        with tempfile.TemporaryDirectory(prefix="lightning-cafin-build-") as cache:
            env.setdefault("LIGHTNING_CAFIN_BUILD_DIR", cache)
            print("LIGHTNING_CAFIN_BUILD=1: building the CUDA extension into the package", file=sys.stderr)
            done = subprocess.run(
                [sys.executable, "-m", "lightning_cafin.kernels.loader", "--build", "--output", str(output)],
                env=env, cwd=tempfile.gettempdir(),
            )
        if done.returncode != 0:
            raise SystemExit(
                "LIGHTNING_CAFIN_BUILD=1: the CUDA extension did not build (the reason is printed above). "
                "It needs torch (a CUDA build) installed first in the environment pip installs into, and "
                'nvcc: a CUDA toolkit or pip install "lightning-cafin[cuda-build]". Unset LIGHTNING_CAFIN_BUILD '
                "to install without it (the extension is then built on first use)."
            )


class BinaryDistribution(Distribution):
    """A wheel that carries a compiled module is specific to this platform and Python."""

    def has_ext_modules(self) -> bool:
        return _build_requested()


setup(cmdclass={"build_py": BuildPyWithCsrc}, distclass=BinaryDistribution)
