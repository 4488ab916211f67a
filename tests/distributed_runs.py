"""Helpers for tests that spawn process groups or serve on a local port (not collected: no ``test_`` prefix)."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from lightning_cafin.bench.collectives import CountCollectives  # noqa: F401  (re-exported for the tests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_master(port: int, **env: str) -> None:
    """Point torch.distributed's rendezvous at ``127.0.0.1:port`` (plus any other variables in ``env``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)


def init_gloo(rank: int, world: int, port: int) -> None:
    local_master(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
