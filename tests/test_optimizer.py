"""The optimizer end to end: pairing by identity, the first capture step against the oracle,
in-place networks, hooks, checkpoints, accumulation, closures and the loss-scaler contract."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_cafin import AdaFisher, AdaFisherW, spec
from lightning_cafin.capture import hook_count

from .nets import EveryLayer, every_layer_batch

D = torch.float64


def loss_of(model, batch):
    img, tokens, target = batch
    return F.cross_entropy(model(img, tokens), target)


def record_io(model):
    """Independent hooks that keep every supported module's input and output gradient."""
    seen = {}

    def fwd(name):
        def hook(module, args, output):
            seen[name] = {"x": args[0].detach().clone()}
            output.register_hook(lambda g: seen[name].__setitem__("s", g.detach().clone()))

        return hook

    handles = [
        m.register_forward_hook(fwd(n))
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm))
    ]
    return seen, handles


@pytest.mark.parametrize("opt_cls", [AdaFisher, AdaFisherW])
def test_first_capture_step_equals_the_oracle(opt_cls):
    """Hooks + factor update + pairing + step, checked against spec.py computed independently."""
    model = EveryLayer().double()
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr, beta, gamma, lam, wd = 1e-3, 0.9, 0.8, 1e-3, 0.01
    opt = opt_cls(model, lr=lr, beta=beta, gamma=gamma, Lambda=lam, weight_decay=wd, backend="reference")
    seen, handles = record_io(model)
    loss_of(model, every_layer_batch(dtype=D)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    for h in handles:
        h.remove()

    expected_F = {}
    for name, module in model.named_modules():
        if name not in seen:
            continue
        H_raw, S_raw = spec.raw_stats(module, seen[name]["x"], seen[name]["s"])
        S, H = spec.average(None, S_raw, gamma), spec.average(None, H_raw, gamma)
        torch.testing.assert_close(opt.binding.captures[name].S, S, rtol=1e-14, atol=0)
        torch.testing.assert_close(opt.binding.captures[name].H, H, rtol=1e-14, atol=0)
        full = spec.fisher(S, H, lam)
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            k = module.weight[0].numel()
            expected_F[f"{name}.weight"] = full[:, :k].reshape(module.weight.shape)
            if module.bias is not None:
                expected_F[f"{name}.bias"] = full[:, k]
        else:
            expected_F[f"{name}.weight"], expected_F[f"{name}.bias"] = full[:, 0], full[:, 1]

    for name, p in model.named_parameters():
        if name not in grads:
            assert torch.equal(p, p0[name]), f"{name} has no gradient and must not move"
            continue
        Fd = expected_F.get(name, torch.ones_like(p))
        g, bc = grads[name], 1 - beta
        if opt_cls is AdaFisher:
            m = (1 - beta) * (g + wd * p0[name])
            want = p0[name] - (lr / bc) * m / Fd
        else:
            m = (1 - beta) * g
            want = p0[name] - lr * (m / bc / Fd + wd * p0[name])
        torch.testing.assert_close(p.detach(), want, rtol=1e-13, atol=1e-15, msg=name)
    assert {"embed.weight", "scale"} == {n for n in grads if n not in expected_F}


def test_tied_weights_and_groups_update_each_parameter_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.mix = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied: one tensor, two modules
            self.free = nn.Parameter(torch.randn(4))

        def forward(self, t):
            return self.head(self.mix(self.embed(t)) * self.free)

    model = Tied()
    opt = AdaFisher(
        [{"params": [model.embed.weight, model.free]}, {"params": model.mix.parameters(), "lr": 1e-2}], TCov=1
    )
    opt.bind(model)
    extra = nn.Linear(3, 3)  # a param group added after binding
    model.extra = extra
    opt.add_param_group({"params": extra.parameters(), "weight_decay": 0.1})
    for _ in range(3):
        opt.zero_grad()
        (model(torch.randint(0, 10, (5, 3))).sum() + extra(torch.randn(2, 3)).sum()).backward()
        opt.step()
    for group in opt.param_groups:
        for p in group["params"]:
            assert opt.state[p]["step"].item() == 3
    owner = {opt.param_name(p): opt.binding.layer_of(p) for g in opt.param_groups for p in g["params"] if opt.binding.preconditioned(p)}
    assert owner == {"embed.weight": "head", "mix.weight": "mix", "mix.bias": "mix", "extra.weight": "extra", "extra.bias": "extra"}
    assert opt.binding.captures["head"].S.shape == (10,) and opt.binding.captures["head"].H.shape == (4,)
    assert "free" in opt.summary() and "1 tensors" in opt.summary()


class Block(nn.Module):
    def __init__(self, c, inplace):
        super().__init__()
        self.inplace = inplace
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=inplace)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            out += x
        else:
            out = out + x
        return self.relu(out)


def resnet(inplace):
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=inplace),
        Block(8, inplace), Block(8, inplace), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    ).double()


def test_inplace_resnet_trains_like_its_out_of_place_twin():
    runs = []
    for inplace in (True, False):
        model = resnet(inplace)
        opt = AdaFisher(model, lr=1e-3, TCov=5)
        gen = torch.Generator().manual_seed(3)
        for _ in range(12):
            x = torch.randn(6, 3, 8, 8, generator=gen, dtype=D)
            y = torch.randint(0, 10, (6,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert opt.health["modules_not_fired"] == [] and opt.health["capture_steps"] == 3
        runs.append((model, opt))
    (a, oa), (b, ob) = runs
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-12, atol=1e-14)
    for name in ob.binding.captures:
        torch.testing.assert_close(oa.binding.captures[name].S, ob.binding.captures[name].S, rtol=1e-12, atol=0)


def test_hooks_are_never_duplicated():
    model = EveryLayer()
    supported = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm))]
    first = AdaFisher(model)
    first.bind(model)
    first.bind(model)
    assert all(hook_count(m) == 1 for m in supported)
    with pytest.warns(UserWarning, match="bound to another live AdaFisher"):
        second = AdaFisher(model, TCov=1)
    assert all(hook_count(m) == 1 for m in supported)
    loss_of(model, every_layer_batch()).backward()
    second.step()
    assert second.health["modules_not_fired"] == [] and all(c.S is not None for c in second.binding.captures.values())
    second.unbind()
    assert all(hook_count(m) == 0 for m in supported)


def test_hooks_capture_only_training_forwards_that_get_a_backward():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = AdaFisher(model)
    cap = opt.binding.captures["0"]
    model(torch.randn(2, 3))  # no backward: not committed
    with torch.no_grad():
        model(torch.randn(2, 3))
    model.eval()
    model(torch.randn(2, 3)).sum().backward()
    assert cap.pending.calls == 0
    model.train()
    model(torch.randn(2, 3)).sum().backward()
    assert cap.pending.calls == 1


def run_steps(model, opt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        img = torch.randn(4, 3, 9, 9, generator=gen)
        tokens = torch.randint(0, 11, (4, 7), generator=gen)
        target = torch.randint(0, 5, (4,), generator=gen)
        opt.zero_grad()
        loss_of(model, (img, tokens, target)).backward()
        opt.step()


@pytest.mark.parametrize("bind_first", [False, True])
@pytest.mark.parametrize("opt_cls", [AdaFisher, AdaFisherW])
def test_checkpoint_resume_equals_uninterrupted(opt_cls, bind_first):
    torch.manual_seed(0)
    model = EveryLayer()
    opt = opt_cls(model, TCov=5, weight_decay=1e-2)
    run_steps(model, opt, 13, seed=1)  # stop mid-TCov
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    run_steps(model, opt, 12, seed=2)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    snapshot = copy.deepcopy(ckpt["opt"])
    resumed = EveryLayer()
    resumed.load_state_dict(ckpt["model"])
    ropt = opt_cls(resumed.parameters(), TCov=5, weight_decay=1e-2)
    if bind_first:
        ropt.bind(resumed)
        ropt.load_state_dict(ckpt["opt"])
    else:
        ropt.load_state_dict(ckpt["opt"])  # factors wait for their modules
        ropt.bind(resumed)
    assert ropt.is_bound and set(ropt.binding.captures) == set(opt.binding.captures)
    run_steps(resumed, ropt, 12, seed=2)
    for a, b in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for name, cap in opt.binding.captures.items():
        assert torch.equal(ropt.binding.captures[name].S, cap.S) and torch.equal(ropt.binding.captures[name].H, cap.H)
    assert ropt.schedule.steps_taken == opt.schedule.steps_taken == 25
    # the caller's dict is untouched by loading and by the steps after it
    flat = lambda d: [t for t in _tensors(d)]
    assert all(torch.equal(a, b) for a, b in zip(flat(ckpt["opt"]), flat(snapshot)))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_checkpoint_without_factors_rewarms_with_a_warning():
    model = EveryLayer()
    opt = AdaFisher(model, TCov=50)
    run_steps(model, opt, 3, seed=1)
    sd = opt.state_dict()
    sd["param_groups"][0].pop("cafin")
    fresh = AdaFisher(model, TCov=50)
    with pytest.warns(UserWarning, match="no AdaFisher factors"):
        fresh.load_state_dict(sd)
    assert fresh.is_bound and len(fresh.binding.captures) == len(opt.binding.captures) == 8
    run_steps(model, fresh, 1, seed=2)
    assert fresh.health["capture_steps"] == 1 and all(c.S is not None for c in fresh.binding.captures.values())


def plain_net():
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(1, 2), nn.LayerNorm(6), nn.Linear(6, 3)
    )  # (B, 4*6, 6) after flatten: LayerNorm over 6, Linear on a 3-D input


def backward_on_a_batch(model):
    """One forward and backward of ``plain_net`` on a fresh random batch (gradients accumulate)."""
    F.mse_loss(model(torch.randn(4, 2, 6, 6)), torch.randn(4, 24, 3)).backward()


def test_accumulated_micro_batches_equal_one_big_batch():
    x, y = torch.randn(16, 2, 6, 6), torch.randn(16, 24, 3)
    big, small = plain_net(), plain_net()
    ob, os_ = AdaFisher(big, TCov=1), AdaFisher(small, TCov=1)
    F.mse_loss(big(x), y).backward()
    ob.step()
    for i in range(4):
        (F.mse_loss(small(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]) / 4).backward()
    os_.step()
    assert os_.binding.captures["0"].pending.calls == 0
    for name, cap in ob.binding.captures.items():
        torch.testing.assert_close(os_.binding.captures[name].S, cap.S, rtol=2e-5, atol=1e-7)
        torch.testing.assert_close(os_.binding.captures[name].H, cap.H, rtol=2e-5, atol=1e-7)
    for a, b in zip(small.parameters(), big.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_closure_runs_with_grad_and_returns_the_loss():
    a, b = plain_net(), plain_net()
    oa, ob = AdaFisher(a, TCov=1), AdaFisher(b, TCov=1)
    x, y = torch.randn(4, 2, 6, 6), torch.randn(4, 24, 3)

    def closure():
        oa.zero_grad()
        loss = F.mse_loss(a(x), y)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = oa.step(closure)
    F.mse_loss(b(x), y).backward()
    ob.step()
    assert loss.item() > 0
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_found_inf_step_changes_nothing():
    model = plain_net()
    opt = AdaFisher(model, TCov=1)
    backward_on_a_batch(model)
    opt.step()
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    backward_on_a_batch(model)
    opt.found_inf, opt.grad_scale = torch.tensor(1.0), torch.tensor(8.0)
    opt.step()
    del opt.found_inf, opt.grad_scale
    after = (model.state_dict(), opt.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(_tensors(after), _tensors(before)))
    assert opt.schedule.steps_taken == 1 and opt.health["skipped_steps"] == 1
    assert all(c.pending.calls == 0 for c in opt.binding.captures.values())


def test_grad_scaler_run_equals_unscaled_run():
    runs = []
    for scaled in (False, True):
        model = plain_net().double()
        opt = AdaFisher(model, TCov=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000, enabled=scaled)
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            x, y = torch.randn(4, 2, 6, 6, generator=gen, dtype=D), torch.randn(4, 24, 3, generator=gen, dtype=D)
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        runs.append((model, opt))
    (a, oa), (b, ob) = runs
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-10, atol=1e-12)
    for name, cap in oa.binding.captures.items():
        torch.testing.assert_close(ob.binding.captures[name].S, cap.S, rtol=1e-10, atol=0)


def test_bf16_autocast_keeps_float32_statistics():
    model = plain_net()
    opt = AdaFisher(model, TCov=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 2, 6, 6))
    F.mse_loss(out.float(), torch.randn(4, 24, 3)).backward()
    opt.step()
    for cap in opt.binding.captures.values():
        assert cap.S.dtype == cap.H.dtype == torch.float32
        assert torch.isfinite(cap.S).all() and torch.isfinite(cap.H).all()


def test_nan_statistics_never_enter_the_factors():
    model = plain_net()
    opt = AdaFisher(model, TCov=1)
    backward_on_a_batch(model)
    opt.step()
    kept = opt.binding.captures["4"].S.clone()
    opt.zero_grad()
    backward_on_a_batch(model)
    opt.binding.captures["4"].pending.s[0] = float("nan")
    with pytest.warns(UserWarning, match="non-finite statistics for '4'"):
        opt.step()
    assert torch.equal(opt.binding.captures["4"].S, kept)
    assert opt.health["non_finite_statistics"] == 1


def test_unbound_optimizer_binds_to_an_offered_model_and_captures_next_step():
    from lightning_cafin.model_offers import offer_model, withdraw_model

    model = plain_net()
    offer_model(model)
    try:
        opt = AdaFisher(model.parameters(), TCov=100)
        backward_on_a_batch(model)
        opt.step()  # binds now; its hooks missed this forward, so the next step captures
        assert opt.is_bound and all(c.S is None for c in opt.binding.captures.values())
        opt.zero_grad()
        backward_on_a_batch(model)
        opt.step()
        assert opt.health["capture_steps"] == 1 and all(c.S is not None for c in opt.binding.captures.values())
    finally:
        withdraw_model(model)
    assert not opt.is_bound and all(hook_count(m) == 0 for m in model.modules())


class _Functional(nn.Module):
    """Uses its Linear's weight through F.linear: the Linear's hook never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return F.linear(x, self.fc.weight, self.fc.bias)


def test_a_first_step_without_any_forward_unbinds_nothing_and_warns_nothing(recwarn):
    """torch.distributed.checkpoint initialises a fresh optimizer's state with one step on
    zero gradients and no forward; the layers stay bound, and a later capture step with a
    real forward still finds weights used functionally."""
    model = _Functional()
    opt = AdaFisher(model, TCov=2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.unseen_layers == {} and opt.is_bound
    assert not [w for w in recwarn if "no training forward" in str(w.message)]
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    assert "fc" in opt.unseen_layers and "functionally" in opt.unseen_layers["fc"]
