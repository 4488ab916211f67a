"""The optimizer on a GPU: foreach against the oracle, checkpoints across devices, a tensor lr
under a scheduler, and a loss scaler's found_inf read without waiting for the GPU."""

import io
import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_cafin import AdaFisher, AdaFisherW

from .nets import EveryLayer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def run(model, opt, n, seed, device):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        img = torch.randn(4, 3, 9, 9, generator=gen).to(device)
        tokens = torch.randint(0, 11, (4, 7), generator=gen).to(device)
        target = torch.randint(0, 5, (4,), generator=gen).to(device)
        opt.zero_grad()
        F.cross_entropy(model(img, tokens), target).backward()
        opt.step()


@pytest.mark.parametrize("opt_cls", [AdaFisher, AdaFisherW])
def test_foreach_on_cuda_matches_reference(opt_cls):
    out = []
    for backend in ("reference", "foreach"):
        torch.manual_seed(0)
        model = EveryLayer().cuda()
        opt = opt_cls(model, lr=2e-4, TCov=10, weight_decay=1e-3, backend=backend)
        run(model, opt, 60, 1, "cuda")
        out.append(model)
    for a, b in zip(out[1].parameters(), out[0].parameters()):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-6


@pytest.mark.parametrize("direction", ["cpu_to_cuda", "cuda_to_cpu"])
def test_checkpoint_loads_onto_another_device(direction):
    src, dst = ("cpu", "cuda") if direction == "cpu_to_cuda" else ("cuda", "cpu")
    torch.manual_seed(0)
    model = EveryLayer().to(src)
    opt = AdaFisher(model, TCov=4, backend="foreach")
    run(model, opt, 6, 1, src)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    run(model, opt, 5, 2, src)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    other = EveryLayer().to(dst)
    other.load_state_dict(ckpt["model"])
    oopt = AdaFisher(other, TCov=4, backend="foreach")
    oopt.load_state_dict(ckpt["opt"])
    for cap in oopt.binding.captures.values():
        assert cap.S.device.type == dst and cap.H.device.type == dst
    run(other, oopt, 5, 2, dst)
    for a, b in zip(other.parameters(), model.parameters()):
        assert a.device.type == dst
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------- the fused path, end to end


def test_tensor_lr_with_step_lr_matches_float_lr(fused_ok):
    """A tensor lr (filled in place by the scheduler) gives the float-lr run bit for bit."""
    out = []
    for lr in (2.0**-9, torch.tensor(2.0**-9, device="cuda")):
        torch.manual_seed(0)
        model = EveryLayer().cuda()
        opt = AdaFisherW(model, lr=lr, TCov=4, weight_decay=1e-2, backend="fused")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            img = torch.randn(4, 3, 9, 9, generator=gen).cuda()
            tokens = torch.randint(0, 11, (4, 7), generator=gen).cuda()
            target = torch.randint(0, 5, (4,), generator=gen).cuda()
            opt.zero_grad()
            F.cross_entropy(model(img, tokens), target).backward()
            opt.step()
            sched.step()
        assert float(opt.param_groups[0]["lr"]) == 2.0**-9 * 0.5**3
        out.append(model)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    for a, b in zip(out[0].parameters(), out[1].parameters()):
        assert torch.equal(a, b)


SKIPPED_AT = {1, 4, 5, 8}  # iterations whose gradients overflowed (TCov=3: 4 and 5 fall on a capture step)


def _scaled_run(found_inf_device: str, sync_log: list):
    torch.manual_seed(0)
    model = EveryLayer().cuda()
    opt = AdaFisher(model, lr=1e-3, TCov=3, weight_decay=1e-3, backend="fused")
    scale = 8.0
    opt.grad_scale = torch.full((), scale, device="cuda")
    opt.found_inf = torch.zeros((), device=found_inf_device)
    gen = torch.Generator().manual_seed(1)
    for it in range(12):
        img = torch.randn(4, 3, 9, 9, generator=gen).cuda()
        tokens = torch.randint(0, 11, (4, 7), generator=gen).cuda()
        target = torch.randint(0, 5, (4,), generator=gen).cuda()
        opt.found_inf.fill_(1.0 if it in SKIPPED_AT else 0.0)
        torch.cuda.synchronize()  # every earlier flag has landed: the host's count is exact
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.zero_grad()
                (F.cross_entropy(model(img, tokens), target) * scale).backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if any("synchroniz" in str(w.message) for w in caught):
            sync_log.append(it)
    return model, opt


def test_deferred_found_inf_equals_host_read_found_inf(fused_ok):
    """A CUDA found_inf is honoured by the kernel and read later, a CPU one at once:
    the same parameters, factors and counts, and only capture steps wait for the GPU."""
    synced_dev: list = []
    model_d, opt_d = _scaled_run("cuda", synced_dev)
    model_h, opt_h = _scaled_run("cpu", [])
    for a, b in zip(model_d.parameters(), model_h.parameters()):
        assert torch.equal(a, b)
    for name, cap in opt_h.binding.captures.items():
        assert torch.equal(opt_d.binding.captures[name].S, cap.S), name
        assert torch.equal(opt_d.binding.captures[name].H, cap.H), name
    assert opt_d.health["skipped_steps"] == opt_h.health["skipped_steps"] == len(SKIPPED_AT)
    assert opt_d.schedule.steps_taken == opt_h.schedule.steps_taken == 12 - len(SKIPPED_AT)
    for p in model_d.parameters():
        if p.requires_grad:  # the frozen layer has no state
            assert opt_d.state[p]["step"].item() == 12 - len(SKIPPED_AT)
    # applied steps 0, 3 (iterations 4, 5 skipped on it, 6 applies it), 6: iterations 0, 4, 5, 6, 10
    assert set(synced_dev) <= {0, 4, 5, 6, 10}, f"host waited for the GPU at iterations {synced_dev}"
