"""Whether the CUDA sources compile to the same machine code as at another commit: the
SASS of every kernel in ``csrc/*.cu``, the working tree's beside ``--base``'s.

    python scripts/same_sass.py                    # against HEAD
    python scripts/same_sass.py --base main~3 --arch 90

Why: a kernel refactor (a loop shared, a helper extracted, a comment) is meant to change
nothing the device runs, and the GPU tests that would show it cost device time a machine
without a GPU does not have.  Where the SASS of every kernel is the same instruction for
instruction, the refactor provably changes no result and no timing, on that architecture,
with this compiler.  Where it differs, the kernels that differ are named: those need the
GPU tests (and, if they should be faster, the bench).

Each side is compiled whole (its ``csrc/`` as of that commit, headers included, so a
header's change shows in every file that includes it) with the extension's own flags
(``lightning_cafin.kernels.sources``), torch's include paths and ``nvcc`` from
``CUDA_HOME`` (default ``/usr/local/cuda``); the SASS is read with ``cuobjdump`` (from the
toolkit, else the copy triton ships).  Addresses, the source file's name and the hashes
nvcc gives anonymous namespaces are not compared.  Exit status: 0 the same, 1 some kernel
differs, 2 the comparison could not be made.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_cafin.kernels import sources  # noqa: E402

#: what differs between two compiles of the same code: instruction addresses (``/*0a30*/``, and
#: the spacing their width sets), the source's path, and an anonymous namespace's mangled name
#: (its length, its per-file hash)
_NOISE = (re.compile(r"/\*[0-9a-f]{4,}\*/"), re.compile(r"^\s*identifier = .*$", re.M),
          re.compile(r"\d*_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}"))
_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)


def tool(name: str, cuda_home: Path) -> Optional[str]:
    """``name`` from the toolkit, PATH, or (cuobjdump) the copy triton ships."""
    for candidate in (cuda_home / "bin" / name, shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.is_file() else None


def checkout(repo: Path, base: str, into: Path) -> list[str]:
    """``base``'s ``csrc/`` written under ``into``; its ``.cu`` files' names."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", f"{base}:csrc"], capture_output=True,
                            text=True)
    if listed.returncode != 0:
        raise SystemExit(f"--base: no csrc/ at '{base}' ({listed.stderr.strip()})")
    into.mkdir(parents=True, exist_ok=True)
    for name in listed.stdout.split():
        blob = subprocess.run(["git", "-C", str(repo), "show", f"{base}:csrc/{name}"], capture_output=True, check=True)
        (into / name).write_bytes(blob.stdout)
    return sorted(n for n in listed.stdout.split() if n.endswith(".cu"))


def sass(cu: Path, nvcc: str, cuobjdump: str, arch: str, out: Path) -> dict[str, str]:
    """Every kernel's SASS in ``cu`` compiled for ``sm_<arch>``, by mangled name, noise removed."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{cu.parent}"] + [arg for p in include_paths(device_type="cuda") for arg in ("-isystem", p)]
    py_include = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    obj = out / (cu.stem + ".o")
    cmd = [nvcc, "-c", str(cu), "-o", str(obj), f"-gencode=arch=compute_{arch},code=sm_{arch}", "-std=c++20",
           "--expt-relaxed-constexpr", "-DTORCH_EXTENSION_NAME=" + sources.EXTENSION_NAME, "-isystem", py_include,
           "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
           "-D__CUDA_NO_HALF2_OPERATORS__", "--compiler-options", "-fPIC", *sources.EXTRA_CUDA_CFLAGS, *includes]
    built = subprocess.run(cmd, capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"nvcc failed on {cu}:\n{built.stderr[-3000:]}")
    return kernels(subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout)


def kernels(dumped: str) -> dict[str, str]:
    """``cuobjdump -sass`` output as each kernel's SASS by mangled name, noise removed."""
    for pattern in _NOISE:
        dumped = pattern.sub("", dumped)
    # (the columns' widths follow the longest address in the file: compare words, not spacing)
    dumped = "\n".join(" ".join(line.split()) for line in dumped.splitlines())
    starts = [(m.start(), m.group(1)) for m in _FUNCTION.finditer(dumped)]
    return {name: dumped[at: starts[i + 1][0] if i + 1 < len(starts) else len(dumped)]
            for i, (at, name) in enumerate(starts)}


def compare(repo: Path, base: str, arch: str, cuda_home: Path) -> tuple[list[str], list[str]]:
    """(lines of the report, the kernels that differ or exist on one side only)."""
    nvcc, cuobjdump = tool("nvcc", cuda_home), tool("cuobjdump", cuda_home)
    if nvcc is None or cuobjdump is None:
        missing = " and ".join(n for n, t in (("nvcc", nvcc), ("cuobjdump", cuobjdump)) if t is None)
        raise SystemExit(f"no {missing} (looked in {cuda_home}/bin, PATH and triton's copy): set CUDA_HOME to a toolkit")
    lines, differ = [], []
    with tempfile.TemporaryDirectory() as tmp:
        old_dir, obj_dir = Path(tmp) / "base" / "csrc", Path(tmp) / "obj"
        obj_dir.mkdir()
        old_files = checkout(repo, base, old_dir)
        new_files = sorted(p.name for p in (repo / "csrc").glob("*.cu"))
        for name in sorted(set(old_files) | set(new_files)):
            if name not in old_files or name not in new_files:
                lines.append(f"{name}: only {'in the working tree' if name in new_files else 'at ' + base}")
                differ.append(name)
                continue
            (obj_dir / "old").mkdir(exist_ok=True)
            (obj_dir / "new").mkdir(exist_ok=True)
            old = sass(old_dir / name, nvcc, cuobjdump, arch, obj_dir / "old")
            new = sass(repo / "csrc" / name, nvcc, cuobjdump, arch, obj_dir / "new")
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            lines.append(f"{name}: {len(new)} kernels, " + ("the same SASS" if not changed else
                                                             f"{len(changed)} differ"))
            for k in changed:
                if k in old and k in new:
                    delta = sum(1 for d in difflib.unified_diff(old[k].splitlines(), new[k].splitlines(), n=0, lineterm="")
                                if d[:1] in "+-" and not d.startswith(("+++", "---")))
                    lines.append(f"  differs ({delta} lines): {k}")
                else:
                    lines.append(f"  only {'in the working tree' if k in new else 'at ' + base}: {k}")
            differ += changed
    return lines, differ


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the commit to compare against (default HEAD)")
    ap.add_argument("--arch", default="90", help="the SM architecture, e.g. 90 for Hopper (default)")
    ap.add_argument("--repo", type=Path, default=ROOT, help="the repository (default: this one)")
    args = ap.parse_args(argv)
    if not args.arch.isdigit():
        raise SystemExit(f"--arch: expected digits such as 90, got '{args.arch}'")
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    try:
        lines, differ = compare(args.repo.resolve(), args.base, args.arch, cuda_home)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(f"sm_{args.arch}, csrc/ at {args.base} vs the working tree: " +
          ("the same SASS in every kernel" if not differ else f"{len(differ)} kernels or files differ"))
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
