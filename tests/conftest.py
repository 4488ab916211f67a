"""Shared pytest setup: deterministic seeds per test, and the skip of tests that need the fused step."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="module")
def fused_ok():
    """Skips the test, saying why, unless the fused CUDA step can run here (a GPU and the extension)."""
    from lightning_cafin.kernels import can_run_fused

    ok, why = can_run_fused()
    if not ok:
        pytest.skip(why)
