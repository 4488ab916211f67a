"""What this machine's host pays to issue device work: the yardstick for a host-bound step.

A capture step on a host-bound train step costs about its added launches times what each
costs the host (``launches.py``).  That price belongs to the machine, not to the package:
the bench's GPU host took about 60 microseconds per op of a ResNet-18's backward (the matrix at
018603b), where an idle workstation commonly takes a few.  So the matrix measures it on its own, before any workload:

* ``op_us``: one torch op on a one-element CUDA tensor (``add_``, in place): the dispatcher,
  one kernel launch, no allocation;
* ``alloc_us``: a 1 KB CUDA tensor made and dropped: the caching allocator, no launch.

Each is timed on the host over blocks of calls (the device synchronised before each block,
never inside it: the queue never fills at these sizes), per call, as a :func:`spread` over
the blocks.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from .timing import spread, spread_text, sync

#: calls per timed block, and blocks
CALLS, BLOCKS = 200, 9


def per_call_us(fn: Callable[[], None], device: torch.device, calls: int, blocks: int,
                prepare: Optional[Callable[[], None]] = None) -> dict[str, Any]:
    """Host microseconds per call of ``fn`` (one block: ``calls`` calls), a :func:`spread` over
    ``blocks`` blocks, the device synchronised before each; ``prepare``, where given, runs
    before each block and before that sync, untimed (e.g. making each call's own input)."""
    if prepare is not None:
        prepare()
    fn()  # warm: the kernel loaded, the allocator's block cached
    per_call = []
    for _ in range(blocks):
        if prepare is not None:
            prepare()
        sync(device)
        t0 = time.perf_counter()
        fn()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
    sync(device)
    return spread(per_call)


def host_speed(device: torch.device, calls: int = CALLS, blocks: int = BLOCKS) -> Optional[dict[str, Any]]:
    """``{"op_us": spread, "alloc_us": spread, "calls": calls}`` on a CUDA device; None elsewhere."""
    if device.type != "cuda":
        return None
    one = torch.zeros(1, device=device)

    def ops() -> None:
        for _ in range(calls):
            one.add_(1.0)

    def allocations() -> None:
        for _ in range(calls):
            torch.empty(256, device=device)

    return {"op_us": per_call_us(ops, device, calls, blocks),
            "alloc_us": per_call_us(allocations, device, calls, blocks), "calls": calls}


def host_speed_text(speed: dict[str, Any]) -> str:
    """One line for the tables: both figures as the tables print a spread (``spread_text``), in us."""
    return (f"host: a one-element torch op {spread_text(speed['op_us'])} us, "
            f"a 1 KB allocation and its free {spread_text(speed['alloc_us'])} us (per call, blocks of {speed['calls']})")
