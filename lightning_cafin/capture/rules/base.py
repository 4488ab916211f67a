"""The rule protocol: how one module type turns a forward/backward into AdaFisher statistics.

A rule answers four questions about a module (see ``README.md``, "Supported layers and
models", for a worked user rule):

* **which parameters** it preconditions and where each reads its ``F``: :meth:`LayerRule.slots`
  returns one :class:`ParamSlot` per parameter.  The parameter is viewed as a
  ``(len(S), ncols)`` matrix in row-major order and element ``(i, j)`` gets
  ``F = S[i] * H[col_offset + j] + Lambda``; with ``transposed=True`` it is viewed as
  ``(ncols, len(S))`` and element ``(j, i)`` gets the same value (a weight stored
  ``in x out``, as ``transformers``' ``Conv1D``);
* **the input statistics**: :meth:`LayerRule.input_partial` returns ``(sum vector, count)``
  for one forward call;
* **the output-gradient statistics**: :meth:`LayerRule.output_partial` likewise for the
  gradient of the loss with respect to the module's output;
* **how the sums become the spec's raw vectors**: :meth:`LayerRule.finalize`.

Partial sums must be *linear in the batch* (sums over samples plus the count that divides
them): the statistics of several micro-batches, or several ranks, are then added before
``finalize``.  ``s_scale_power`` is the power of a loss scale the ``S`` sums carry (2 for
sums of squared gradients, 1 for sums of gradients squared after combining).

:meth:`LayerRule.fused_stats` (optional) describes both partial sums of one call as one
call of the extension's ``layer_stats`` (the built-in rules' CUDA fast path: one C++ call
per layer in the backward pass instead of one per op and the Python between them);
``None`` keeps :meth:`~LayerRule.input_partial` / :meth:`~LayerRule.output_partial`.

:meth:`LayerRule.kernel_plan` (optional) says how the extension's factor-update kernel
finalises the layer; ``None`` keeps it on the torch ops (always correct).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .. import kernels as _kernels
from .. import streams as _streams


def stat_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; everything else (fp16, bf16, fp32) is summed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def channel_sums(t: Tensor, dim: int, square: bool, divisor: float = 0.0) -> Optional[Tensor]:
    """The kernels' per-channel ``sum`` (or sum of squares) over every dim but ``dim``,
    divided by ``divisor`` when it is positive; ``None`` where the kernels do not apply."""
    ext = _kernels.ext_for(t)
    if ext is None or t.dim() == 0:
        return None
    return ext.channel_stats(t, dim, square, float(divisor), _streams.side())


def sum_of_squares(x: Tensor, dims: Union[int, Sequence[int]]) -> Tensor:
    """``sum(x**2)`` over ``dims`` in the statistics dtype, in one pass over ``x``.

    A norm reduction reads ``x`` once and writes only the result: no squared copy and
    no upcast copy of the activation is ever made (squaring the norm costs one rounding).
    """
    return torch.linalg.vector_norm(x, 2, dim=dims, dtype=stat_dtype(x)).square()


@dataclass(frozen=True)
class ParamSlot:
    """Where one of a module's parameters reads its F: ``H[col_offset : col_offset + ncols]``.

    ``transposed``: the parameter is stored ``(ncols, len(S))`` (columns of ``H`` along its
    rows), e.g. a ``Conv1D`` weight ``in x out``.
    """

    role: str  # the module attribute holding the parameter ("weight", "bias", ...)
    col_offset: int
    ncols: int
    transposed: bool = False

    def factor_layout(self, S: Tensor, H: Tensor) -> tuple[Tensor, Tensor, int, int]:
        """``(rows, cols, col_offset, ncols)`` such that the parameter, viewed row-major as
        ``(len(rows), ncols)``, has ``F[i, j] = rows[i] * cols[col_offset + j] + Lambda``.

        A transposed slot swaps the two vectors (the product is symmetric), so every step
        backend takes it unchanged: rows are its ``H`` columns, the row length is ``len(S)``.
        """
        if self.transposed:
            return H[self.col_offset : self.col_offset + self.ncols], S, 0, S.numel()
        return S, H, self.col_offset, self.ncols


@dataclass(frozen=True)
class FusedStats:
    """Both partial sums of one forward/backward pair as one ``layer_stats`` call.

    ``input_op`` is ``(0, dim, square)``: ``channel_stats(x, dim, square, input_div)``, or
    ``(1, kh, kw, sh, sw, pad_top, pad_left, dh, dw, groups, Ho, Wo)``: the convolution
    window sums of ``x`` (a 3-D ``x`` read as height 1); the gradient side is
    ``channel_stats(grad, grad_dim, grad_square, grad_div)``.  ``hn`` / ``sn`` are the counts
    :meth:`LayerRule.input_partial` / :meth:`LayerRule.output_partial` return with the sums.
    A description depends only on the module and the two shapes, so the hooks cache it.

    ``mean_scale`` (a batch norm's, or a layer norm's on 3+ dims; else 0): the input's sums
    are the means the norm saved (a layer norm's summed over every dim but dim 1) times
    ``mean_scale``, and the gradient's its bias gradient, so a C++ tap takes both from
    autograd without reading either tensor (``csrc/capture_tap.h``).
    """

    input_op: tuple[int, ...]
    input_div: float
    grad_dim: int
    grad_square: bool
    grad_div: float
    hn: float
    sn: float
    mean_scale: float = 0.0

    def run(self, ext: ModuleType, x: Tensor, grad: Tensor, side: bool) -> tuple[Tensor, Tensor]:
        """``(h, s)`` from the extension's one call (``side``: on the capture side stream)."""
        return ext.layer_stats(x, grad, self.input_op, self.input_div, self.grad_dim, self.grad_square,
                               self.grad_div, side)

    def tap_plan(self, ext: ModuleType, sink: Any) -> Any:
        """The extension's ``TapPlan``: this description with the layer's ``sink``, whose
        ``tap(x, output, side)`` registers a C++ gradient tap on ``output`` (when its gradient
        arrives, this ``layer_stats`` call runs and ``(h, hn, s, sn)`` goes to ``sink``) and
        ``tap_gradient(output, h, hn, side)`` one computing the gradient's sums only."""
        return ext.TapPlan(sink, self.input_op, self.input_div, self.grad_dim, self.grad_square, self.grad_div,
                           self.hn, self.sn, self.mean_scale)


def channel_op(dim: int, square: bool) -> tuple[int, int, int]:
    """``FusedStats.input_op`` of a per-channel sum (of squares) over every dim but ``dim``."""
    return (0, dim, int(square))


@dataclass(frozen=True)
class KernelPlan:
    """How the factor-update kernel finalises one layer's statistics.

    ``kind`` 0: ``H = h / h_div`` with ``extra`` appended when ``append`` (a bias column);
    ``kind`` 1 (two-column norms): ``H = [sum(h**2) / h_div, extra]``, ``S = s**2 / sn``.
    """

    kind: int
    h_div: float
    extra: float
    append: bool

    def h_size(self, h: Tensor) -> int:
        return 2 if self.kind == 1 else h.numel() + int(self.append)


class LayerRule(ABC):
    """The statistics of one supported module type (see the module docstring)."""

    kind: str = "custom"
    #: ``S`` partial sums scale with this power of a loss scale (squared sums: 2).
    s_scale_power: int = 2

    def supports(self, module: nn.Module) -> bool:
        """Whether this module instance can be preconditioned (e.g. ``affine=True``)."""
        return True

    @abstractmethod
    def slots(self, module: nn.Module) -> list[ParamSlot]:
        """The columns each of the module's parameters uses, in ``H`` order."""

    @abstractmethod
    def input_partial(self, module: nn.Module, x: Tensor) -> tuple[Tensor, float]:
        """(sum vector, count) of the activation side for one forward call."""

    @abstractmethod
    def output_partial(self, module: nn.Module, s: Tensor) -> tuple[Tensor, float]:
        """(sum vector, count) of the output-gradient side for one backward call."""

    @abstractmethod
    def finalize(self, module: nn.Module, h: Tensor, hn: float, s: Tensor, sn: float) -> tuple[Tensor, Tensor]:
        """Combined partial sums -> (H_raw, S_raw)."""

    def kernel_plan(self, module: nn.Module, h: Tensor, hn: float) -> Optional[KernelPlan]:
        """The factor-update kernel's plan for this layer, or ``None`` (torch ops)."""
        return None

    def fused_stats(self, module: nn.Module, x_shape: torch.Size, grad_shape: torch.Size) -> Optional[FusedStats]:
        """Both partial sums of a call with these input and output-gradient shapes as one
        ``layer_stats`` call, or ``None`` (the two partial methods run).  Asked only where
        the kernels take both tensors (CUDA, a kernel dtype); the answer is cached per shapes."""
        return None

    def oracle(self, module: nn.Module, x: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        """(H_raw, S_raw) from one call's input and output gradient, the slow obvious way.

        Built-in rules delegate to ``lightning_cafin.spec``; the default runs the rule itself.
        """
        h, hn = self.input_partial(module, x)
        sv, sn = self.output_partial(module, s)
        return self.finalize(module, h, hn, sv, sn)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
