"""``scripts/same_sass.py``: a refactor that changes no instruction is reported the same, one
that changes a kernel is named, on a small repository of its own (nvcc and cuobjdump needed:
CI has both, as the extension's build does)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .benchmarks.scripts import SCRIPTS
from .benchmarks.scripts import load as load_script

# in an anonymous namespace, as the package's kernels are: nvcc names it by a hash of the
# file's path, which differs between the two sides' compiles and must not count
KERNEL = """// a kernel
namespace {
__global__ void scale(float* x, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = %s;
}
}  // namespace
void launch(float* x, int n) { scale<<<1, 32>>>(x, 2.f, n); }
"""


def load():
    return load_script("same_sass", SCRIPTS)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if load().tool("nvcc", cuda_home) is None or load().tool("cuobjdump", cuda_home) is None:
        pytest.skip("no nvcc or cuobjdump here (a CUDA toolkit, or triton's copy of cuobjdump)")
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "k.cu").write_text(KERNEL % "a * x[i]")
    for cmd in (["init", "-q"], ["add", "csrc"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "k"]):
        subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True)
    return tmp_path


def test_a_change_the_compiler_erases_is_the_same_sass_and_a_real_one_names_its_kernel(repo, capsys):
    source = repo / "csrc" / "k.cu"
    source.write_text(KERNEL.replace("// a kernel", "// the same kernel, said otherwise") % "x[i] * a")
    assert load().main(["--repo", str(repo)]) == 0
    assert "k.cu: 1 kernels, the same SASS" in capsys.readouterr().out
    source.write_text(KERNEL % "a * x[i] + 1.f")
    assert load().main(["--repo", str(repo)]) == 1
    out = capsys.readouterr().out
    assert "k.cu: 1 kernels, 1 differ" in out and "differs" in out and "scale" in out


def test_a_file_on_one_side_only_differs_and_a_bad_base_is_refused(repo, capsys):
    (repo / "csrc" / "extra.cu").write_text(KERNEL.replace("scale", "shift").replace("launch", "launch2") % "x[i] + a")
    assert load().main(["--repo", str(repo)]) == 1
    assert "extra.cu: only in the working tree" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--base: no csrc/ at 'nope'"):
        load().main(["--repo", str(repo), "--base", "nope"])


def test_addresses_and_the_spacing_their_width_sets_are_not_compared():
    """cuobjdump pads its columns to the file's longest address: a kernel added to a file
    moves every other kernel's instructions sideways, which is no change of theirs."""
    narrow = ("        Function : _ZN1a5scaleEv\n        /*0000*/  LDC R1, c[0x0][0x28] ;   /* 0x00000a00ff017b82 */\n"
              "        /*0010*/  EXIT ;   /* 0x000000000000794d */\n")
    wide = ("        Function : _ZN1a5scaleEv\n        /*00000*/     LDC R1, c[0x0][0x28] ;      /* 0x00000a00ff017b82 */\n"
            "        /*00010*/     EXIT ;      /* 0x000000000000794d */\n")
    assert load().kernels(narrow) == load().kernels(wide) and list(load().kernels(wide)) == ["_ZN1a5scaleEv"]
    assert load().kernels(narrow) != load().kernels(wide.replace("EXIT", "BRA"))


def test_bad_arch_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--arch: expected digits"):
        load().main(["--arch", "sm90"])
