"""Kernels vs torch capture on a small ResNet over several captures: max relative factor
difference per capture, to tell a wiring bug (large at capture 0) from trajectory drift."""
import copy, sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_cafin import AdaFisher  # noqa: E402
from lightning_cafin.capture import kernels as ck  # noqa: E402
from lightning_cafin.models import ResNet18  # noqa: E402

for det in (False, True):
    torch.backends.cudnn.deterministic = det
    torch.manual_seed(0)
    base = ResNet18(10, 3, 8).cuda()
    x, y = torch.randn(6, 3, 16, 16, device="cuda"), torch.randint(0, 10, (6,), device="cuda")
    hist = {}
    for impl in ("torch", "kernels"):
        ck.set_impl(impl)
        model = copy.deepcopy(base)
        opt = AdaFisher(model, lr=1e-3, TCov=2, backend="foreach")
        hist[impl] = []
        for step in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if step % 2 == 0:
                hist[impl].append({n: torch.cat([c.H, c.S]).double() for n, c in opt._captures.items()})
    for k, (a, b) in enumerate(zip(hist["torch"], hist["kernels"])):
        worst = max(((a[n] - b[n]).abs().max() / a[n].abs().max()).item() for n in a)
        print(f"cudnn.deterministic={det} capture {k}: max relative factor difference {worst:.2e}")
