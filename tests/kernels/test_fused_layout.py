"""The fused step on dense non-contiguous layouts (channels_last, channels_last_3d, permuted
inner dims) equals the oracle: F is read through the memory order (``backends/layout.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_cafin.backends.base import FactorView, StepBatch, StepHyper

from .test_fused_step import LAUNCH_DTYPES  # (the step kernel's five dtype instantiations)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused step needs a CUDA device"),
]

DEV = "cuda"
RTOL = 1e-6


@pytest.fixture(scope="module")
def fused(fused_ok):
    from lightning_cafin.backends.fused import FusedBackend

    return FusedBackend()


def layouts():
    """(param, view) pairs: conv weights in channels_last orders, with their layer's bias column."""
    out = []
    for shape, fmt in (((16, 8, 3, 3), torch.channels_last), ((6, 3, 5, 5), torch.channels_last),
                       ((5, 4, 3, 2, 2), torch.channels_last_3d), ((64, 32, 1, 1), torch.channels_last)):
        p = torch.empty(shape, device=DEV).uniform_(-1, 1).contiguous(memory_format=fmt)
        ncols = p.numel() // shape[0]
        S = torch.empty(shape[0], device=DEV).uniform_(0.01, 0.1)
        H = torch.empty(ncols + 1, device=DEV).uniform_(0.01, 0.1)
        out.append((p, FactorView(S, H, 0, ncols)))
    p = torch.empty(7, 9, 5, device=DEV).uniform_(-1, 1).permute(0, 2, 1)  # dense, dim 0 outermost
    out.append((p, FactorView(torch.rand(7, device=DEV) + 0.01, torch.rand(45, device=DEV) + 0.01, 0, 45)))
    out.append((torch.randn(4, 3, 2, 2, device=DEV).contiguous(memory_format=torch.channels_last), None))
    return out


def problem():
    items = layouts()
    params = [p for p, _ in items]
    return StepBatch(params, [torch.randn_like(p) for p in params], [torch.zeros_like(p) for p in params],
                     [torch.zeros((), device=DEV) for _ in params], [v for _, v in items], 0)


def copy_of(b: StepBatch) -> StepBatch:
    clone = lambda ts: [t.clone() for t in ts]  # noqa: E731 (clone keeps the layout)
    return StepBatch(clone(b.params), b.grads, clone(b.exp_avgs), clone(b.steps), b.views, b.factors_version)


def close(actual, expected, what):
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("decoupled, wd", [(False, 0.0), (False, 1e-2), (True, 1e-2)])
def test_250_steps_over_factor_updates_match_the_oracle(fused, decoupled, wd):
    from lightning_cafin.backends.reference import ReferenceBackend

    batch = problem()
    ref = copy_of(batch)
    assert all(fused.unsupported_reason(p, g) is None for p, g in zip(batch.params, batch.grads))
    h = StepHyper(1e-3, 0.9, 1e-3, wd, decoupled)
    oracle = ReferenceBackend()
    prepared = fused.prepare(batch)
    for step in range(250):
        if step and step % 10 == 0:  # a capture step rewrites the factors in place
            for v in batch.views:
                if v is not None:
                    v.S.mul_(torch.empty_like(v.S).uniform_(0.8, 1.25))
                    v.H.mul_(torch.empty_like(v.H).uniform_(0.8, 1.25))
            batch.factors_version += 1
            ref.factors_version = batch.factors_version
            # the plan is kept (as the dispatcher keeps it while factors change in place):
            # the step refreshes what it derived from them
        grads = [torch.randn_like(p) for p in batch.params]
        batch.grads[:] = grads
        ref.grads[:] = grads
        fused.step(batch, h, prepared=prepared)
        oracle.step(ref, h)
        for i, (p, q) in enumerate(zip(batch.params, ref.params)):
            close(p, q, f"step {step} param {i} {tuple(p.shape)} strides {p.stride()}")
    for p, m in zip(batch.params, batch.exp_avgs):
        assert p.stride() == m.stride()


def test_a_planned_channels_last_step_allocates_nothing(fused):
    batch = problem()
    h = StepHyper(1e-3, 0.9, 1e-3, 0.1, True)
    gs, fi = torch.full((), 2.0, device=DEV), torch.zeros((), device=DEV)
    prepared = fused.prepare(batch)
    fused.step(batch, h, gs, fi, prepared=prepared)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        fused.step(batch, h, gs, fi, prepared=prepared)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_a_channels_last_network_is_stepped_by_the_kernel_and_equals_the_oracle(fused):
    import copy

    from lightning_cafin import AdaFisher

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, groups=2), nn.Flatten(),
                          nn.LazyLinear(5)).to(DEV)
    model(torch.randn(2, 3, 8, 8, device=DEV))
    model = model.to(memory_format=torch.channels_last)
    twin = copy.deepcopy(model)
    opt = AdaFisher(model, lr=2e-4, TCov=5, weight_decay=1e-3, backend="fused")
    ref = AdaFisher(twin, lr=2e-4, TCov=5, weight_decay=1e-3, backend="reference")
    torch.backends.cudnn.deterministic = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*is stepped by")
            for _ in range(12):
                x = torch.randn(6, 3, 8, 8, device=DEV).contiguous(memory_format=torch.channels_last)
                for o, m in ((opt, model), (ref, twin)):
                    o.zero_grad()
                    m(x).square().mean().backward()
                    o.step()
    finally:
        torch.backends.cudnn.deterministic = False
    assert opt.state[model[0].weight]["exp_avg"].stride() == model[0].weight.stride()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-5, name


@pytest.mark.parametrize("dtype, momentum_dtype", LAUNCH_DTYPES)
@pytest.mark.parametrize("decoupled", [False, True], ids=["adafisher", "adafisherw"])
def test_channels_innermost_steps_bit_for_bit_as_the_contiguous_layout(fused_ok, dtype, momentum_dtype, decoupled):
    """A channels_last / channels_last_3d weight, whose H the kernel reads through its
    channels-innermost order (``inners``), steps element for element as the same values laid
    out contiguously: the same F for every element, in every dtype instantiation.  Shapes:
    several chunks, channel counts no pack width divides (rows and packs that part mid-way)."""
    from lightning_cafin.backends.fused import FusedBackend

    fused = FusedBackend(momentum_dtype)
    shapes = (((40, 24, 5, 5), torch.channels_last), ((33, 7, 3, 3), torch.channels_last),
              ((9, 5, 3, 2, 2), torch.channels_last_3d))
    logical = [torch.empty(s, device=DEV).uniform_(-1, 1).to(dtype) for s, _ in shapes]
    views = []
    for p in logical:
        ncols = p.numel() // p.shape[0]
        views.append(FactorView(torch.empty(p.shape[0], device=DEV).uniform_(0.01, 0.1),
                                torch.empty(ncols + 1, device=DEV).uniform_(0.01, 0.1), 0, ncols))

    def batch(laid_out):
        params = [laid_out(p.clone(), fmt) for p, (_, fmt) in zip(logical, shapes)]
        moments = [torch.zeros_like(p, dtype=momentum_dtype or dtype) for p in params]  # (in the param's layout)
        return StepBatch(params, [torch.empty_like(p) for p in params], moments,
                         [torch.zeros((), device=DEV) for _ in params], views, 0)

    channels_innermost = batch(lambda p, fmt: p.contiguous(memory_format=fmt))
    contiguous = batch(lambda p, fmt: p)
    assert not any(p.is_contiguous() for p in channels_innermost.params)
    (group,) = fused.prepare(channels_innermost)
    assert group.inners == [24, 7, 5] and len(group.permuted) == 0  # read through the layout, no copy of H
    h = StepHyper(2.0**-10, 0.9, 1e-3, 1e-2, decoupled)
    for _ in range(3):
        for i, p in enumerate(logical):
            g = torch.randn(p.shape, device=DEV).to(dtype)
            channels_innermost.grads[i].copy_(g)
            contiguous.grads[i].copy_(g)
        fused.step(channels_innermost, h, prepared=[group])
        fused.step(contiguous, h)
    for a, b, ma, mb in zip(channels_innermost.params, contiguous.params, channels_innermost.exp_avgs,
                            contiguous.exp_avgs):
        assert torch.equal(a, b) and torch.equal(ma, mb), tuple(a.shape)
        assert not a.is_contiguous() and ma.stride() == a.stride()  # stepped in place, in its layout
