"""The shadow baseline replay: same update on copies, nothing live touched."""

import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.backends import make_backend
from lightning_cafin.monitor.shadow import divergence, replay, take_snapshot


def test_replay_matches_live_and_honours_found_inf():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(6, 4)).pow(2).mean().backward()
        opt.step()
    opt.zero_grad()
    model(torch.randn(6, 4)).pow(2).mean().backward()
    snap = take_snapshot(opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    after = [p.detach().clone() for p in model.parameters()]
    replay(opt, snap, make_backend("reference"))
    assert divergence(snap).rel < 1e-6
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters()))  # nothing live moved
    skipped = take_snapshot(opt)
    replay(opt, skipped, make_backend("reference"), found_inf=torch.ones(()))
    assert all(torch.equal(e.param, e.live.detach()) for e in skipped.entries)  # a skipped step changes nothing
    assert any(not torch.equal(b, a) for b, a in zip(before, after))
