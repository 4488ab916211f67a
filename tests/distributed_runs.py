"""Helpers for tests that spawn process groups or serve on a local port (not collected: no ``test_`` prefix)."""

from __future__ import annotations

import faulthandler
import os
import socket
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_cafin.bench.collectives import CountCollectives  # noqa: F401  (re-exported for the tests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_master(port: int, **env: str) -> None:
    """Point torch.distributed's rendezvous at ``127.0.0.1:port`` (plus any other variables in ``env``).
    Called first in every spawned rank: it also has a rank killed by a signal print its
    Python stacks (into the test's captured stderr)."""
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)


def init_gloo(rank: int, world: int, port: int) -> None:
    local_master(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def finish_gloo(result: object, path: str) -> None:
    """Save a rank's ``result`` to ``path``, wait until every rank has saved its own, then
    leave the process group: a rank that dies in its teardown leaves every result whole."""
    torch.save(result, path)
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(worker: Callable[..., None], world: int, args: tuple, results: Sequence[Path]) -> None:
    """``torch.multiprocessing.spawn`` the ranks, each of which writes one of ``results``.

    A rank killed by a signal once every rank's result exists is reported as a warning,
    not a failure: that is a crash of the process's teardown, after the work the test
    checks.  (Seen once in CI, on 4 gloo ranks: SIGABRT, "terminate called without an
    active exception", a C++ thread of torch's destroyed at interpreter exit; the package's
    extension is not loaded in these CPU runs.)  Any other failure is raised.
    """
    try:
        mp.spawn(worker, args=args, nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        if e.signal_name is None or not all(Path(r).is_file() for r in results):
            raise
        warnings.warn(f"rank {e.error_index} of {world} died by {e.signal_name} in its teardown, after every rank "
                      "had written its result", RuntimeWarning, stacklevel=2)
