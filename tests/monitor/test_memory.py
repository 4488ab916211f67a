"""Bytes a span allocates, measured without resetting anyone's statistics."""

import pytest
import torch

from lightning_cafin.monitor.memory import AllocatedMemory


def test_cpu_counts_new_tensors_not_in_place_results():
    x = torch.ones(1000)
    with AllocatedMemory(torch.device("cpu")) as m:
        x.mul_(2)
        x.view(10, 100)
        y = x * 3  # 4000 bytes
        del y
        z = torch.empty(250)  # 1000 bytes
    assert m.bytes == 5000
    del z


def test_cpu_span_is_popped_when_the_work_raises():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    with pytest.raises(ValueError):
        with AllocatedMemory(torch.device("cpu")):
            raise ValueError
    assert _get_current_dispatch_mode() is None
    m = AllocatedMemory(torch.device("cpu"))
    assert m.stop() == 0  # stop without start is harmless


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_counts_allocations_and_keeps_the_global_peak():
    dev = torch.device("cuda")
    # The count is of the blocks the allocator hands out: a request it serves from a cached
    # free block less than 1 MiB larger takes the whole block (after other tests in this
    # process a 4.25 MiB one served the 4 MiB request).  With the cache emptied, the request
    # splits the big block freed below and is counted at its own size.
    torch.cuda.empty_cache()
    big = torch.empty(64 << 20, device=dev)
    del big
    peak = torch.cuda.max_memory_allocated(dev)
    with AllocatedMemory(dev) as m:
        t = torch.empty(1 << 20, device=dev)  # 4 MiB
        del t
    assert m.bytes == 4 << 20
    assert torch.cuda.max_memory_allocated(dev) == peak  # nobody's peak figure was reset
