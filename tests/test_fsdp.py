"""AdaFisher on FSDP2-sharded parameters (gloo on the CPU) equals one process.

A network holding every built-in layer type (Conv1d/2d/3d, BatchNorm, GroupNorm,
LayerNorm, RMSNorm, Linear, a transposed ``in x out`` Linear), with row counts that do
not divide by the world size (one shard is empty on 4 ranks), trained in float64 for 7
steps at TCov = 2 (4 capture steps) by ``fully_shard`` on 2 and on 4 ranks, must equal
the same training in one process whose batch is split into the same micro-batches
(BatchNorm normalises each rank's batch alone).  The 4-rank run saves a distributed
checkpoint after 4 steps; a 2-rank run resumes from it and must land on the same place.
Collectives are counted inside ``optimizer.step()``: none on normal steps, one all-reduce
on capture steps once the statistics layout is known.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_cafin
from lightning_cafin import AdaFisher
from lightning_cafin.capture import LinearRule
from tests.distributed_runs import CountCollectives, finish_gloo, free_port, init_gloo, spawn_ranks

pytestmark = pytest.mark.slow
D = torch.float64
STEPS, TCOV, BATCH, SAVE_AT = 7, 2, 8, 4
REL = 1e-12


class InOutLinear(nn.Module):
    """A Linear whose weight is stored ``in x out`` (as transformers' Conv1D)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class AllLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(3, 3, 3, padding=1)  # 3 rows: empty on the 4th rank
        self.bn = nn.BatchNorm1d(3)
        self.c2 = nn.Conv2d(3, 7, 3, padding=1)
        self.gn = nn.GroupNorm(1, 7)
        self.c3 = nn.Conv3d(7, 7, 1)
        self.ln = nn.LayerNorm(7)
        self.rms = nn.RMSNorm(7)
        self.fc = nn.Linear(7, 9)
        self.t = InOutLinear(9, 5)  # 9 rows, transposed factors

    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))  # N x 3 x 6
        x = torch.relu(self.gn(self.c2(x.view(-1, 3, 2, 3))))  # N x 7 x 2 x 3
        x = self.c3(x.unsqueeze(2)).squeeze(2).mean(dim=(2, 3))  # N x 7
        return self.t(torch.tanh(self.fc(self.rms(self.ln(x)))))


def network() -> AllLayers:
    lightning_cafin.register_layer(InOutLinear, LinearRule(transposed=True))
    torch.manual_seed(5)
    return AllLayers().to(D)


def batches():
    gen = torch.Generator().manual_seed(17)
    return [(torch.randn(BATCH, 3, 6, generator=gen, dtype=D), torch.randn(BATCH, 5, generator=gen, dtype=D))
            for _ in range(STEPS)]


def optimizer(model):
    return AdaFisher(model, lr=3e-3, TCov=TCOV, weight_decay=1e-3, backend="foreach")


def worker(rank, world, port, out, resume, hsdp=False):
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world, port)
    # on the CPU even where a GPU is visible; HSDP: replicate over 2 groups, shard within each
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    model = network()
    fully_shard(model.fc, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(model)
    start = 0
    if resume:
        msd, osd = get_state_dict(model, opt)  # a fresh optimizer: torch initialises its state with one step
        load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        start = SAVE_AT
    record = {"collectives": [], "capture": []}
    for step, (x, y) in enumerate(batches()[start:], start):
        opt.zero_grad()
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        record["capture"].append(opt.capture_due)
        with CountCollectives() as counted:
            opt.step()
        record["collectives"].append(counted.ops)
        if not resume and not hsdp and step + 1 == SAVE_AT:
            msd, osd = get_state_dict(model, opt)
            save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"))
    record["params"] = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    record["momentum"] = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    record["factors"] = {n: (f.S.clone(), f.H.clone()) for n, f in opt.factors().items()}
    record["memory"] = opt.memory_usage()
    record["reduced_bytes"] = opt.statistics_reduction.last.bytes
    finish_gloo(record, _result(out, world, rank, resume, hsdp))


def _result(out, world, rank, resume, hsdp) -> str:
    kind = "resumed" if resume else "hsdp" if hsdp else "run"
    return os.path.join(out, f"{kind}{world}-{rank}.pt")


def spawn(world, out, resume=False, hsdp=False):
    results = [_result(out, world, r, resume, hsdp) for r in range(world)]
    spawn_ranks(worker, world, (world, free_port(), str(out), resume, hsdp), results)
    return [torch.load(r, weights_only=True) for r in results]


def one_process(parts_at):
    """Single-process training, step ``i``'s batch split into ``parts_at(i)`` micro-batches."""
    model = network()
    opt = optimizer(model)
    for i, (x, y) in enumerate(batches()):
        opt.zero_grad()
        parts = parts_at(i)
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            (F.mse_loss(model(xs), ys) / parts).backward()
        opt.step()
    return {
        "params": {n: p.detach() for n, p in model.named_parameters()},
        "momentum": {n: opt.state[p]["exp_avg"] for n, p in model.named_parameters()},
        "factors": {n: (f.S, f.H) for n, f in opt.factors().items()},
        "memory": opt.memory_usage(),
    }


def assert_equal(run, ref):
    for key in ("params", "momentum"):
        assert set(run[key]) == set(ref[key])
        for name, want in ref[key].items():
            err = (run[key][name] - want).abs().max() / want.abs().max()
            assert err <= REL, f"{key} {name}: relative difference {err:.2e}"
    assert set(run["factors"]) == set(ref["factors"]) and len(ref["factors"]) == 9
    for name, (S, H) in ref["factors"].items():
        for got, want in zip(run["factors"][name], (S, H)):
            assert ((got - want).abs().max() / want.abs().max()) <= REL, name


def assert_collectives(run):
    """No collective on a normal step; on capture steps one all-reduce once the layout is kept
    (the first capture agrees the layout first: two)."""
    seen_capture = False
    for due, ops in zip(run["capture"], run["collectives"]):
        if not due:
            assert ops == [], ops
            continue
        assert all(op.startswith("c10d.allreduce_") for op in ops), ops
        assert len(ops) == (1 if seen_capture else 2), ops
        seen_capture = True
    assert seen_capture


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp4")
    return out, spawn(4, out)


def test_two_ranks_equal_one_process(tmp_path):
    ranks = spawn(2, tmp_path)
    ref = one_process(lambda i: 2)
    for run in ranks:
        assert_equal(run, ref)
        assert_collectives(run)
    # each rank holds half the momentum (uneven rows: about half) and every factor
    total = ref["memory"]["momentum"]
    assert sum(r["memory"]["momentum"] for r in ranks) == total
    assert all(r["memory"]["momentum"] < 0.6 * total for r in ranks)
    assert all(r["memory"]["factors"] == ref["memory"]["factors"] for r in ranks)


def test_four_ranks_with_an_empty_shard_equal_one_process(four_ranks):
    _, ranks = four_ranks
    ref = one_process(lambda i: 4)
    for run in ranks:
        assert_equal(run, ref)
        assert_collectives(run)
        assert run["reduced_bytes"] > 0


def test_a_checkpoint_saved_on_four_ranks_resumes_exactly_on_two(four_ranks):
    out, _ = four_ranks
    resumed = spawn(2, out, resume=True)
    ref = one_process(lambda i: 4 if i < SAVE_AT else 2)
    for run in resumed:
        assert_equal(run, ref)
        assert all(ops == [] for due, ops in zip(run["capture"], run["collectives"]) if not due)


def test_hsdp_on_a_two_by_two_mesh_equals_one_process(tmp_path):
    """FSDP2 on a 2-D mesh (replicate x shard, placements (Replicate(), Shard(0)))."""
    ranks = spawn(4, tmp_path, hsdp=True)
    ref = one_process(lambda i: 4)
    for run in ranks:
        assert_equal(run, ref)
        assert_collectives(run)
