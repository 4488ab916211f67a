"""Counting the collectives (and their bytes) that a block of code issues.

A ``TorchDispatchMode`` sees every ``c10d`` and functional-collective op that goes through
the dispatcher (``torch.distributed``'s Python API, FSDP2, ``DTensor``); DDP's gradient
buckets are reduced from C++ and are not seen, which is what measuring the optimizer's
own traffic inside ``optimizer.step()`` needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class CountCollectives(TorchDispatchMode):
    """Records each collective run inside the block (``ops``) and the bytes of its first
    tensor argument, the buffer it sends (``bytes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func.namespace in COLLECTIVE_NAMESPACES and str(func) != "c10d.barrier.default":
            self.ops.append(str(func))
            self.bytes += _tensor_bytes(args[0]) if args else 0
        return func(*args, **(kwargs or {}))
