"""The spawn helper of the multi-process tests: a rank that dies in its teardown, once every
rank wrote its result, is a warning; a rank that dies before is a failure."""

from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp

from tests.distributed_runs import spawn_ranks

pytestmark = pytest.mark.slow


def _abort_after_writing(rank: int, out: str, write: bool) -> None:
    if write:
        with open(os.path.join(out, f"{rank}.tmp"), "w") as f:
            f.write("done")
        os.replace(os.path.join(out, f"{rank}.tmp"), os.path.join(out, f"{rank}.txt"))  # whole once it exists
    if rank == 1:
        deadline = time.monotonic() + 60
        while write and not os.path.exists(os.path.join(out, "0.txt")) and time.monotonic() < deadline:
            time.sleep(0.01)  # (as after a barrier: every rank has written)
        os.abort()


def test_a_rank_aborting_after_every_result_is_written_warns(tmp_path):
    results = [tmp_path / f"{r}.txt" for r in range(2)]
    with pytest.warns(RuntimeWarning, match="rank 1 of 2 died by SIGABRT in its teardown"):
        spawn_ranks(_abort_after_writing, 2, (str(tmp_path), True), results)
    assert all(r.read_text() == "done" for r in results)


def test_a_rank_aborting_before_its_result_is_written_fails(tmp_path):
    results = [tmp_path / f"{r}.txt" for r in range(2)]
    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        spawn_ranks(_abort_after_writing, 2, (str(tmp_path), False), results)
