"""Capture under ``torch.compile`` (inductor on CPU; needs a C++ compiler): the compiled
model feeds every layer's statistics to that layer, at every capture, as eager does.

Two layers of the same class and shapes are the trap: hook code traced once for one of
them must not be reused for the other (that credited one LayerNorm of GPT-2 with five
LayerNorms' statistics)."""

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_cafin import AdaFisher

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="inductor on CPU needs a C++ compiler")


class Twins(nn.Module):
    """Every paper type, and pairs of identical Linears / LayerNorms."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.inp = nn.Linear(8, 16)
        self.ln1, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16)
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        x = self.inp(x)
        x = x + self.fc1(torch.relu(self.ln1(x)))
        x = x + self.fc2(torch.relu(self.ln2(x)))
        return self.out(x)


def _train(model, run, xs, ys):
    opt = AdaFisher(model, TCov=2, backend="foreach")
    factors = []
    for i in range(len(xs)):
        opt.zero_grad()
        F.cross_entropy(run(xs[i]), ys[i]).backward()
        opt.step()
        if i % 2 == 0:  # a capture step
            view = opt.factors()
            factors.append({n: (c.S.clone(), c.H.clone()) for n, c in view.items() if c.S is not None})
    return factors, [p.detach().clone() for p in model.parameters()]


def _assert_compiled_trains_as_eager(base, steps, names):
    """A copy of ``base`` trained eagerly and a compiled copy trained on the same batches hold
    the same factors for exactly the layers ``names`` at every capture, and end on the same weights."""
    xs = [torch.randn(4, 3, 6, 6) for _ in range(steps)]
    ys = [torch.randint(0, 4, (4,)) for _ in range(steps)]
    model = copy.deepcopy(base)
    eager = _train(model, model, xs, ys)
    model = copy.deepcopy(base)
    compiled = _train(model, torch.compile(model), xs, ys)
    assert len(compiled[0]) == len(eager[0]) == (steps + 1) // 2  # TCov=2: steps 0, 2, ... capture
    for got, want in zip(compiled[0], eager[0]):
        assert set(got) == set(want) == names  # every layer, at every capture
        for n in want:
            for g, w in zip(got[n], want[n]):
                assert ((g - w).abs().max() / w.abs().max()).item() < 1e-5, n
    for g, w in zip(compiled[1], eager[1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_compiled_model_captures_what_eager_captures():
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Twins()
    _assert_compiled_trains_as_eager(base, 4, {n for n, m in base.named_modules() if n and not isinstance(m, Twins)})


def test_graph_breaks_are_the_capture_hooks_only():
    torch._dynamo.reset()
    model = Twins()
    AdaFisher(model)
    explained = torch._dynamo.explain(model)(torch.randn(2, 3, 6, 6))
    bound = sum(1 for n, m in model.named_modules() if n)
    reasons = [r.reason for r in explained.break_reasons]
    assert all("_capture_forward" in r or "compiler.disable" in r for r in reasons), reasons
    # one break where each hook is reached (dynamo may count it again in the module's caller frame)
    assert 0 < explained.graph_break_count <= 2 * bound
    torch._dynamo.reset()
    assert torch._dynamo.explain(Twins())(torch.randn(2, 3, 6, 6)).graph_break_count == 0


class NormActNet(nn.Module):
    """timm's GroupNormAct with an in-place ReLU: the gradient is tapped at the norm's affine
    output, between two graph breaks, and the activation then overwrites that tensor."""

    def __init__(self):
        super().__init__()
        norm_act = pytest.importorskip("timm.layers.norm_act")
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = norm_act.GroupNormAct(8, num_groups=4)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.norm(self.conv(x)).mean((2, 3)))


def test_compiled_norm_act_taps_the_affine_output_as_eager_does():
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = NormActNet()
    with torch.no_grad():
        base.norm.bias.normal_()  # so the ReLU masks part of the affine output
    _assert_compiled_trains_as_eager(base, 2, {"conv", "norm", "out"})
