"""Teaching AdaFisher a layer it does not know: ``lightning_cafin.register_layer``.

Two user layers, registered in a few lines each:

* ``InOutLinear`` computes ``x @ W + b`` with ``W`` stored ``in x out`` (as GPT-2's
  ``Conv1D``): the built-in linear rule with ``transposed=True`` fits it as is;
* ``LayerScale`` computes ``x * gamma`` (one scale per feature): a rule written from
  scratch, following the protocol of ``lightning_cafin.LayerRule``.

    python examples/custom_layer.py --steps 50
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_cafin import AdaFisher, LayerRule, register_layer
from lightning_cafin.capture import LinearRule, ParamSlot


class InOutLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + self.bias


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class LayerScaleRule(LayerRule):
    """``S``: per feature, the mean squared output gradient; ``H``: one column, the mean
    squared input.  ``gamma`` (``dim`` elements) is viewed as ``(len(S), 1)``, so its
    element ``i`` gets ``F = S[i] * H[0] + Lambda``.

    The partial sums are sums over rows plus their count: AdaFisher adds them over
    micro-batches (and ranks) before ``finalize`` divides."""

    kind = "layerscale"

    def slots(self, module):
        return [ParamSlot("gamma", col_offset=0, ncols=1)]

    def input_partial(self, module, x):
        return x.float().square().sum().reshape(1), float(x.numel())

    def output_partial(self, module, s):
        s = s.reshape(-1, s.shape[-1]).float()
        return s.square().sum(0), float(s.shape[0])

    def finalize(self, module, h, hn, s, sn):
        return h / hn, s / sn


register_layer(InOutLinear, LinearRule(transposed=True))
register_layer(LayerScale, LayerScaleRule())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = InOutLinear(16, 32)
        self.scale = LayerScale(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.scale(self.inp(x))))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="register_layer example")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    teacher = nn.Linear(16, 4)
    model = Net()
    opt = AdaFisher(model, lr=1e-3, TCov=10)
    print(opt.summary())
    losses = []
    for _ in range(args.steps):
        x = torch.randn(64, 16)
        y = teacher(x).argmax(1)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return {"summary": opt.summary(), "first_loss": losses[0], "last_loss": losses[-1],
            "preconditioned": [n for n, p in model.named_parameters() if opt.fisher_view(p) is not None]}


if __name__ == "__main__":
    main()
