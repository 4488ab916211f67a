"""The sources: found by glob in ``csrc/``, and every file keys the build cache."""

from __future__ import annotations

import shutil

from lightning_cafin.kernels import sources


def test_sources_are_present():
    names = sources.source_files() + sources.header_files()
    assert {"bindings.cpp", "adafisher_step.cu", "adafisher_step.h", "vector_io.cuh"} <= set(names)
    for name in names:
        assert (sources.sources_dir() / name).is_file(), name
    assert sources.missing_required() == []


def test_csrc_is_found_by_glob_and_every_file_keys_the_cache(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(sources.sources_dir(), csrc)
    before = sources.source_hash(csrc)
    assert before == sources.source_hash()  # a copy hashes like the original
    (csrc / "new_kernel.cu").write_text("// a new translation unit\n")
    (csrc / "new_helpers.cuh").write_text("// a new header\n")
    assert "new_kernel.cu" in sources.source_files(csrc)
    assert "new_helpers.cuh" in sources.header_files(csrc) and "new_helpers.cuh" not in sources.source_files(csrc)
    after_add = sources.source_hash(csrc)
    assert after_add != before
    (csrc / "new_helpers.cuh").write_text("// edited\n")
    assert sources.source_hash(csrc) != after_add
    (csrc / "bindings.cpp").unlink()
    assert sources.missing_required(csrc) == ["bindings.cpp"]

