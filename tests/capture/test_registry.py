"""Rule sets and the public registry through the optimizer: ``layers="paper"`` unchanged,
a user-defined layer, weights stored ``in x out``, channels-first LayerNorms, and the
parameters hooks cannot see (reported once, never warned about per capture)."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_cafin
from lightning_cafin import AdaFisher, LayerRule, spec
from lightning_cafin.capture import LinearRule, ParamSlot, register_layer, rule_for, unregister_layer

from ..nets import EveryLayer, every_layer_batch

D = torch.float64
LAMBDA = 1e-3


def train(model, opt, batches, loss_fn):
    for batch in batches:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()


def every_layer_loss(model, batch):
    img, tokens, target = batch
    return F.cross_entropy(model(img, tokens), target)


def test_paper_layers_are_bit_equal_to_all_on_the_paper_types():
    torch.manual_seed(0)
    base = EveryLayer().double()
    batches = [every_layer_batch(dtype=D) for _ in range(3)]
    results = []
    for layers in ("all", "paper"):
        model = copy.deepcopy(base)
        opt = AdaFisher(model, TCov=2, backend="foreach", layers=layers)
        train(model, opt, batches, every_layer_loss)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


class Extra(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)

    def forward(self, x):  # (B, L, 4)
        return self.gn(self.conv(self.lin(x).transpose(1, 2))).mean((1, 2))


def test_paper_layers_leave_the_new_types_on_f_one():
    model = Extra().double()
    paper = AdaFisher(model, layers="paper")
    assert "2 parameter tensors" in paper.summary() and "4 tensors" in paper.summary()
    full = AdaFisher(model, layers="all")
    assert "6 parameter tensors" in full.summary() and "in 3 layers" in full.summary()
    with pytest.raises(ValueError, match="layers must be one of"):
        AdaFisher(model, layers="some")


# ------------------------------------------------------------------ a user layer


class Diagonal(nn.Module):
    """``y = x * weight``: a layer the package knows nothing about."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight


class DiagonalRule(LayerRule):
    """``H``: one column, the mean of ``x**2``; ``S``: per feature, the mean of ``s**2``."""

    kind = "diagonal"

    def slots(self, module):
        return [ParamSlot("weight", 0, 1)]  # weight (d,) viewed as (d, 1): F[i] = S[i] * H[0]

    def input_partial(self, module, x):
        return (x.double() ** 2).sum().reshape(1), float(x.numel())

    def output_partial(self, module, s):
        s = s.reshape(-1, s.shape[-1]).double()
        return (s**2).sum(0), float(s.shape[0])

    def finalize(self, module, h, hn, s, sn):
        return h / hn, s / sn


class WithDiagonal(nn.Module):
    def __init__(self):
        super().__init__()
        self.diag = Diagonal(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.diag(x))


@pytest.fixture
def registered():
    done = []

    def register(cls, rule):
        register_layer(cls, rule)
        done.append(cls)

    yield register
    for cls in done:
        unregister_layer(cls)


def test_user_registered_layer_gets_factors(registered):
    assert rule_for(Diagonal(2)) is None
    registered(Diagonal, DiagonalRule())
    model = WithDiagonal().double()
    opt = AdaFisher(model, backend="reference", gamma=0.8)
    x = torch.randn(7, 5, dtype=D)
    seen = {}

    def keep(module, args, out):
        out.register_hook(lambda g: seen.setdefault("s", g.clone()))

    model.diag.register_forward_hook(keep)
    model(x).square().sum().backward()
    opt.step()
    S_raw = (seen["s"] ** 2).mean(0)
    H_raw = (x**2).mean().reshape(1)
    factors = opt.factors()
    cap_S = factors["diag"].S
    cap_H = factors["diag"].H
    torch.testing.assert_close(cap_S, spec.average(None, S_raw, 0.8), rtol=1e-13, atol=0)
    torch.testing.assert_close(cap_H, spec.average(None, H_raw, 0.8), rtol=1e-13, atol=0)
    assert "in 2 layers" in opt.summary()


def test_register_layer_checks_its_arguments():
    with pytest.raises(TypeError, match="module_type must be an nn.Module subclass"):
        lightning_cafin.register_layer(int, DiagonalRule())
    with pytest.raises(TypeError, match="must be a lightning_cafin.capture.LayerRule"):
        lightning_cafin.register_layer(Diagonal, object())


def test_registration_overrides_a_builtin_and_paper_ignores_it(registered):
    registered(nn.GroupNorm, DiagonalRule())
    assert isinstance(rule_for(nn.GroupNorm(1, 2)), DiagonalRule)
    assert rule_for(nn.GroupNorm(1, 2), "paper") is None


# ------------------------------------------------ weights stored in x out (Conv1D)


class TransposedLinear(nn.Module):
    """``x @ W + b`` with ``W`` of shape ``(in, out)``, as transformers' Conv1D."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.3)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return x @ self.weight + self.bias


def _transposed_classes():
    out = [TransposedLinear]
    try:
        from transformers.pytorch_utils import Conv1D

        out.append(lambda n_in, n_out: Conv1D(n_out, n_in))
    except ImportError:
        pass
    return out


class TwoTransposed(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.a = make(4, 6)
        self.b = make(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("make", _transposed_classes(), ids=["local", "transformers.Conv1D"][: len(_transposed_classes())])
def test_transposed_weight_reads_S_along_columns(make, registered):
    if make is TransposedLinear:
        registered(TransposedLinear, LinearRule(transposed=True))
    torch.manual_seed(0)
    base = TwoTransposed(make).double()
    x = torch.randn(8, 5, 4, dtype=D)
    params = {}
    for backend in ("reference", "foreach"):
        model = copy.deepcopy(base)
        opt = AdaFisher(model, backend=backend, Lambda=LAMBDA, TCov=1)
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        params[backend] = [p.detach().clone() for p in model.parameters()]
        # F[i, j] = S[j] * H[i] + Lambda for the (in, out) weight; the bias reads H[in]
        w, b = model.a.weight, model.a.bias
        view = opt.fisher_view(w)
        cap = opt.factors()["a"]
        want = cap.H[: w.shape[0], None] * cap.S[None, :] + LAMBDA
        torch.testing.assert_close(view.fisher(LAMBDA, w.shape), want, rtol=0, atol=0)
        torch.testing.assert_close(opt.fisher_view(b).fisher(LAMBDA, b.shape), cap.S * cap.H[w.shape[0]] + LAMBDA,
                                   rtol=0, atol=0)
    for a, b in zip(params["reference"], params["foreach"]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused step needs a CUDA device")
def test_transposed_weight_fused_equals_foreach(registered):
    registered(TransposedLinear, LinearRule(transposed=True))
    torch.manual_seed(0)
    base = TwoTransposed(TransposedLinear).cuda()
    x = torch.randn(8, 5, 4, device="cuda")
    params = {}
    for backend in ("foreach", "fused"):
        model = copy.deepcopy(base)
        opt = AdaFisher(model, backend=backend, TCov=1)
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        params[backend] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(params["foreach"], params["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------ channels-first LayerNorm


class ConvNeXtish(nn.Module):
    def __init__(self, norm_cls):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = norm_cls(6)

    def forward(self, x):
        return self.norm(self.conv(x)).mean((2, 3))


def test_channels_first_layernorm_with_width_equal_to_channels_through_the_optimizer():
    from .test_rules import ChannelsFirstLayerNorm

    model = ConvNeXtish(ChannelsFirstLayerNorm).double()
    opt = AdaFisher(model, backend="reference", gamma=0.8)
    x = torch.randn(2, 3, 4, 6, dtype=D)  # W == C == 6: the old rule silently took width statistics
    seen = {}

    def keep(module, args, out):
        seen["x"] = args[0].detach().clone()
        out.register_hook(lambda g: seen.setdefault("s", g.clone()))

    model.norm.register_forward_hook(keep)
    model(x).square().sum().backward()
    opt.step()
    H_raw, S_raw = spec.layernorm_stats(model.norm, seen["x"], seen["s"], channels_first=True)
    cap = opt.factors()["norm"]
    torch.testing.assert_close(cap.S, spec.average(None, S_raw, 0.8), rtol=1e-13, atol=0)
    torch.testing.assert_close(cap.H, spec.average(None, H_raw, 0.8), rtol=1e-13, atol=0)


# ------------------------------------------------ parameters hooks cannot see


class WithMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])


class FunctionalQKV(nn.Module):
    """Swin's pattern: a Linear's weight used through F.linear, never through its forward."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(F.linear(x, self.qkv.weight, self.qkv.bias))


@pytest.mark.parametrize("net,name", [(WithMHA, "attn.out_proj"), (FunctionalQKV, "qkv")])
def test_unseen_parameters_are_reported_once_in_the_summary(net, name):
    model = net().double()
    opt = AdaFisher(model, TCov=1)
    x = torch.randn(3, 4, 8, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert not [w for w in caught if "forward/backward reached" in str(w.message)]
    summary = opt.summary()
    assert f"{name} (" in summary and "hooks cannot see" in summary
    assert opt.health["modules_not_fired"] == []
    assert opt.fisher_view(model.head.weight) is not None


def test_custom_layer_example_registers_two_layers_and_learns():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "custom_layer.py"
    spec_ = importlib.util.spec_from_file_location("custom_layer_example", path)
    example = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(example)
    try:
        result = example.main(["--steps", "60"])
    finally:
        unregister_layer(example.InOutLinear)
        unregister_layer(example.LayerScale)
    assert set(result["preconditioned"]) == {"inp.weight", "inp.bias", "scale.gamma", "out.weight", "out.bias"}
    assert result["last_loss"] < 0.5 * result["first_loss"]
