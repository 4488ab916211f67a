"""Helpers for tests that spawn gloo process groups on the CPU (not collected: no ``test_`` prefix)."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from lightning_cafin.bench.collectives import CountCollectives  # noqa: F401  (re-exported for the tests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
