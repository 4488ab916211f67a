"""``foreach`` against the ``reference`` oracle: one step on random inputs, then whole training runs."""

import pytest
import torch
import torch.nn.functional as F

from lightning_cafin import AdaFisher, AdaFisherW
from lightning_cafin.backends import FactorView, ForeachBackend, ReferenceBackend, StepBatch, StepHyper

from ..nets import EveryLayer


def random_batch(dtype, factored=True):
    shapes = [(5, 3), (5,), (4, 2, 3, 3), (7,), (3, 1), (6,)]
    params = [torch.randn(s, dtype=dtype) for s in shapes]
    grads = [torch.randn(s, dtype=dtype) for s in shapes]
    exp_avgs = [torch.randn(s, dtype=dtype) for s in shapes]
    steps = [torch.tensor(float(k)) for k in (0, 3, 1, 0, 7, 2)]
    S1, H1 = torch.rand(5, dtype=dtype) + 0.01, torch.rand(4, dtype=dtype) + 0.01
    S2, H2 = torch.rand(4, dtype=dtype) + 0.01, torch.rand(19, dtype=dtype) + 0.01
    S3, H3 = torch.rand(7, dtype=dtype) + 0.01, torch.rand(2, dtype=dtype) + 0.01
    views = [FactorView(S1, H1, 0, 3), FactorView(S1, H1, 3, 1), FactorView(S2, H2, 0, 18), FactorView(S3, H3, 1, 1), None, None]
    if not factored:
        views = [None] * len(views)
    return StepBatch(params, grads, exp_avgs, steps, views, factors_version=1)


def clone_batch(b):
    return StepBatch(
        [p.clone() for p in b.params], [g.clone() for g in b.grads], [m.clone() for m in b.exp_avgs],
        [k.clone() for k in b.steps], b.views, b.factors_version,
    )


def max_rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-15), (torch.float32, 1e-6)])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.05])
@pytest.mark.parametrize("scaled", [False, True])
def test_one_step_matches_reference(dtype, tol, decoupled, wd, scaled):
    batch = random_batch(dtype)
    other = clone_batch(batch)
    hyper = StepHyper(lr=0.01, beta=0.9, Lambda=1e-3, weight_decay=wd, decoupled=decoupled)
    grad_scale = torch.tensor(1024.0) if scaled else None
    if scaled:
        for b in (batch, other):
            b.grads[:] = [g * 1024 for g in b.grads]
    ReferenceBackend().step(batch, hyper, grad_scale)
    ForeachBackend().step(other, hyper, grad_scale)
    for name in ("params", "exp_avgs", "steps"):
        for a, b in zip(getattr(other, name), getattr(batch, name)):
            assert max_rel(a, b) <= tol, name


def test_found_inf_changes_nothing():
    batch = random_batch(torch.float32)
    before = clone_batch(batch)
    ForeachBackend().step(batch, StepHyper(0.1, 0.9, 1e-3, 0.1, False), torch.tensor(2.0), torch.tensor(1.0))
    for name in ("params", "exp_avgs", "steps"):
        for a, b in zip(getattr(batch, name), getattr(before, name)):
            assert torch.equal(a, b)


def test_fisher_cache_follows_factor_updates():
    batch = random_batch(torch.float64)
    other = clone_batch(batch)
    hyper = StepHyper(0.01, 0.9, 1e-3, 0.0, False)
    ref, fe = ReferenceBackend(), ForeachBackend()
    cache = fe.prepare(other)  # F is cached across steps, as the dispatcher keeps it
    for _ in range(3):
        ref.step(batch, hyper)
        fe.step(other, hyper, prepared=cache)
        batch.views[0].S.mul_(1.7)  # factors rewritten in place, as on a capture step
        batch.factors_version += 1
        other.factors_version = batch.factors_version
    hyper2 = StepHyper(0.01, 0.9, 5e-3, 0.0, False)  # and a changed Lambda
    ref.step(batch, hyper2)
    fe.step(other, hyper2, prepared=cache)
    for a, b in zip(other.params, batch.params):
        assert max_rel(a, b) <= 1e-15


def train(opt_cls, backend, bias, dtype, steps=250, TCov=10, seed=0):
    torch.manual_seed(seed)
    model = EveryLayer(bias=bias).to(dtype)
    torch.manual_seed(seed + 1)
    opt = opt_cls(model, lr=2e-4, weight_decay=1e-3, TCov=TCov, backend=backend)
    gen = torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        img = torch.randn(4, 3, 9, 9, generator=gen, dtype=dtype)
        tokens = torch.randint(0, 11, (4, 7), generator=gen)
        target = torch.randint(0, 5, (4,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(img, tokens), target).backward()
        opt.step()
    return model, opt


@pytest.mark.slow
@pytest.mark.parametrize("opt_cls", [AdaFisher, AdaFisherW])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_training_run_matches_reference(opt_cls, bias, dtype, tol):
    ref_model, ref_opt = train(opt_cls, "reference", bias, dtype)
    fe_model, fe_opt = train(opt_cls, "foreach", bias, dtype)
    assert ref_opt.health["capture_steps"] == 25
    for (name, a), b in zip(fe_model.state_dict().items(), ref_model.state_dict().values()):
        if not a.is_floating_point():
            continue
        assert torch.isfinite(a).all(), name
        assert max_rel(a, b) <= tol, (name, max_rel(a, b))
    for name, cap in ref_opt.binding.captures.items():
        assert max_rel(fe_opt.binding.captures[name].S, cap.S) <= tol
        assert max_rel(fe_opt.binding.captures[name].H, cap.H) <= tol
    # every trainable parameter moved, the frozen layer did not
    fresh = EveryLayer(bias=bias).to(dtype)
    torch.manual_seed(0)
    fresh = EveryLayer(bias=bias).to(dtype)
    for (name, p), p0 in zip(fe_model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, p0) == name.startswith("frozen."), name
