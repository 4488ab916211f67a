"""The per-parameter optimizer state, created in one place whatever backend runs.

Each parameter has ``exp_avg`` (the momentum, in the parameter's dtype and memory
format unless a float32 momentum is asked for) and ``step`` (a float32 scalar tensor,
as in ``torch.optim``).  The step count lives on the CPU, where reading it costs
nothing, unless the backend stepping the parameter increments it on the device; then
it is moved there (value kept), so switching backends never loses or resets state.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def ensure_state(param: Tensor, state: dict, *, device_step: bool, momentum_dtype: Optional[torch.dtype] = None) -> None:
    """Create ``state``'s ``exp_avg`` / ``step`` on first use, or move them where the step needs them."""
    if "step" not in state:
        device = param.device if device_step else torch.device("cpu")
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        dtype = momentum_dtype if momentum_dtype is not None else param.dtype
        state["exp_avg"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        return
    step = state["step"]
    if not isinstance(step, Tensor):  # a plain number from an older checkpoint
        step = state["step"] = torch.tensor(float(step), dtype=torch.float32)
    if device_step and (step.device != param.device or step.dtype != torch.float32):
        state["step"] = step.to(device=param.device, dtype=torch.float32).reshape(())
    exp_avg = state.get("exp_avg")
    if isinstance(exp_avg, Tensor) and exp_avg.device != param.device:
        state["exp_avg"] = exp_avg.to(param.device)
