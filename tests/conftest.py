"""Shared pytest setup: deterministic seeds per test, and float64 helpers."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield
