"""Helpers for tests that spawn gloo process groups on the CPU (not collected: no ``test_`` prefix)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


class CountCollectives(TorchDispatchMode):
    """Records every collective (``c10d`` and functional-collective op) run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
