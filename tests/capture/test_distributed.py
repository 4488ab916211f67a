"""Statistics reduced across 2 gloo processes equal one process on the same global batch."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_cafin import AdaFisher
from tests.distributed_runs import CountCollectives, free_port, init_gloo

D = torch.float64
STEPS, TCOV = 5, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 3)
        self.branch = nn.Linear(3, 3)  # used by rank 0 only in the uneven test

    def forward(self, x, use_branch=False):
        y = self.fc(self.ln(torch.relu(self.conv(x)).flatten(1, 2)))
        return self.branch(y) if use_branch else y


def net():
    torch.manual_seed(3)
    return Net().double()


def global_batches():
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 2, 6, 6, generator=gen, dtype=D), torch.randn(8, 24, 3, generator=gen, dtype=D))
            for _ in range(STEPS)]


def worker(rank, world, port, out, uneven):
    init_gloo(rank, world, port)
    model = net()
    opt = AdaFisher(model, TCov=TCOV)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    half = 8 // world
    collectives = []
    for x, y in global_batches():
        opt.zero_grad()
        xs, ys = x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]
        F.mse_loss(ddp(xs, use_branch=uneven and rank == 0), ys).backward()
        due = opt.capture_due
        with CountCollectives() as counted:
            opt.step()
        collectives.append((due, counted.ops))
    torch.save({"params": [p.detach() for p in model.parameters()], "collectives": collectives,
                "factors": {n: (c.S, c.H) for n, c in opt.binding.captures.items() if c.S is not None}},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_two(tmp_path, uneven):
    mp.spawn(worker, args=(2, free_port(), str(tmp_path), uneven), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path):
    ranks = run_two(tmp_path, uneven=False)
    model = net()
    opt = AdaFisher(model, TCov=TCOV)
    for x, y in global_batches():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for r in ranks:
        # inside step(): nothing on normal steps; on capture steps one all-reduce once the
        # statistics layout is known (the first capture agrees it: two)
        counts = [len(ops) if due else -len(ops) for due, ops in r["collectives"]]
        assert counts == [2, 0, 1, 0, 1], r["collectives"]
        for a, b in zip(r["params"], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-12)
        for name, (S, H) in r["factors"].items():
            torch.testing.assert_close(S, opt.binding.captures[name].S, rtol=1e-10, atol=0)
            torch.testing.assert_close(H, opt.binding.captures[name].H, rtol=1e-10, atol=0)


@pytest.mark.slow
def test_a_layer_that_fires_on_one_rank_only_does_not_deadlock(tmp_path):
    r0, r1 = run_two(tmp_path, uneven=True)
    assert "branch" in r0["factors"] and set(r0["factors"]) == set(r1["factors"])
    for name in r0["factors"]:
        for a, b in zip(r0["factors"][name], r1["factors"][name]):
            assert torch.equal(a, b), name
