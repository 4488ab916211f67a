"""The contract every step backend implements.

The optimizer owns parameters, state and factors; a backend only applies one
AdaFisher / AdaFisherW update to a batch of parameters that share hyper-parameters
(one param group).  Keeping the contract this small is what lets the oracle, the
vectorised PyTorch path and the CUDA kernel be swapped by name and tested against
each other on identical inputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class FactorView:
    """How one parameter reads its Fisher diagonal from its layer's two factor vectors.

    The parameter is viewed as a ``(len(S), ncols)`` matrix in row-major order; its
    element ``(i, j)`` has ``F = S[i] * H[col_offset + j] + Lambda``.  A Linear weight is
    ``(out, in)`` at offset 0 and its bias ``(out, 1)`` at offset ``in``; a Conv2d weight
    is ``(out, C/g*kh*kw)`` at offset 0; a BatchNorm2d / LayerNorm weight is ``(C, 1)``
    at offset 0 and its bias at offset 1.  ``S`` and ``H`` are the optimizer's own
    factor tensors (updated in place on capture steps), never copies.
    """

    S: Tensor
    H: Tensor
    col_offset: int
    ncols: int

    def fisher(self, Lambda: float, shape: torch.Size) -> Tensor:
        """Materialise ``F`` for one parameter (used by the oracle and by caches)."""
        cols = self.H[self.col_offset : self.col_offset + self.ncols]
        return (self.S[:, None] * cols[None, :] + Lambda).reshape(shape)


@dataclass(frozen=True)
class StepHyper:
    """The hyper-parameters of one param group, as the update formula uses them."""

    lr: Union[float, Tensor]  # a tensor: read on the device by the fused step, else float(lr)
    beta: float
    Lambda: float
    weight_decay: float
    decoupled: bool  # True: AdaFisherW (decoupled decay); False: AdaFisher (L2 decay)


@dataclass
class StepBatch:
    """The tensors of one param group that have a gradient this step.

    ``steps[i]`` is parameter ``i``'s own step count (a float32 scalar tensor, as in
    ``torch.optim``); the backend increments it before use.  ``views[i]`` is ``None``
    for a parameter without factors (``F = 1``).  ``factors_version`` changes whenever
    any factor tensor is rewritten, so a backend may cache what depends on them.
    """

    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    steps: list[Tensor]
    views: list[Optional[FactorView]]
    factors_version: int = 0


def group_by_device_and_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Positions of ``tensors`` grouped by (device, dtype), in first-seen order (the one grouping helper)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


class StepBackend(ABC):
    """One way of applying the update.  Backends hold no optimizer state: the optimizer
    creates it (``backends.state``), the dispatcher keeps what a backend derives from a
    batch (``prepare``) for as long as the batch stays the same."""

    name: str = "abstract"
    #: the step count must live on the parameter's device (the kernel increments it there)
    device_step: bool = False
    #: a nonzero ``found_inf`` is honoured on the device: the host need not read it first
    skips_on_device: bool = False

    def unsupported_reason(self, param: Tensor, grad: Optional[Tensor] = None) -> Optional[str]:
        """``None`` when this backend can update ``param`` (with ``grad``), else why not."""
        return None

    def prepare(self, batch: StepBatch, previous: Any = None) -> Any:
        """What the backend derives from ``batch`` apart from its gradients, kept by the
        dispatcher and handed back to :meth:`step` while the batch stays the same;
        ``previous`` is what it derived for the same tensors before (buffers to reuse)."""
        return None

    @abstractmethod
    def step(
        self,
        batch: StepBatch,
        hyper: StepHyper,
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
        prepared: Any = None,
    ) -> None:
        """Apply one update in place.

        ``grad_scale``: the gradients are multiplied by it (a loss scaler that did not
        unscale them); the update uses ``grad / grad_scale``.  ``found_inf``: when it is
        nonzero the step changes nothing at all, step counts included.  ``prepared``:
        what :meth:`prepare` returned for this batch (``None``: derive it now).
        """
