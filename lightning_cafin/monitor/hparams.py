"""The optimizer's settings as run hyper-parameters, so runs compare in TensorBoard's HParams view."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def capture_implementation(opt: Any, device: torch.device) -> str:
    """Which code computes the capture statistics: ``kernels`` (the CUDA extension) or ``torch``.

    An optimizer option ``capture_impl`` wins where the optimizer has one; otherwise the
    process-wide choice (``LIGHTNING_CAFIN_CAPTURE``), resolved for ``device``.
    """
    chosen = getattr(opt, "capture_impl", None)
    if chosen is None:
        from ..capture.kernels import get_impl

        chosen = get_impl()
    if chosen != "auto":
        return str(chosen)
    if device.type != "cuda":
        return "torch"
    from ..kernels.loader import can_run_fused

    return "kernels" if can_run_fused()[0] else "torch"


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        return float(value.detach().reshape(-1)[0]) if value.numel() else float("nan")
    return value


def optimizer_hparams(opt: Any, device: torch.device, suffix: str = "") -> dict[str, Any]:
    """``cafin/<name><suffix>`` -> value: class, backend, the first param group's
    ``lr``, ``beta``, ``gamma``, ``Lambda``, ``TCov``, ``weight_decay``, and the capture
    implementation.  Read once at the start of training (an ``lr`` tensor is read then)."""
    group = opt.param_groups[0]
    values = {
        "optimizer": type(opt).__name__,
        "backend": opt.backend,
        **{key: _plain(group.get(key, opt.defaults.get(key))) for key in
           ("lr", "beta", "gamma", "Lambda", "TCov", "weight_decay")},
        "capture_impl": capture_implementation(opt, device),
    }
    return {f"cafin/{key}{suffix}": value for key, value in values.items()}
