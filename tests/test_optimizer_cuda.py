"""The optimizer on a GPU: foreach against the oracle there, and checkpoints across devices."""

import io

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
    for cap in oopt._captures.values():
        assert cap.S.device.type == dst and cap.H.device.type == dst
    run(other, oopt, 5, 2, dst)
    for a, b in zip(other.parameters(), model.parameters()):
        assert a.device.type == dst
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-4, atol=1e-5)
