"""FSDP2 on one GPU (NCCL, world size 1): the fused kernel steps DTensor shards exactly as
it steps the unsharded model, and a bf16 ``MixedPrecisionPolicy`` trains on the fused step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lightning_cafin import AdaFisher
from tests.distributed_runs import free_port, local_master
from tests.test_fsdp import AllLayers, network

pytestmark = pytest.mark.cuda
STEPS, TCOV = 7, 2


def batches(device):
    gen = torch.Generator().manual_seed(23)
    return [(torch.randn(16, 3, 6, generator=gen).to(device), torch.randn(16, 5, generator=gen).to(device))
            for _ in range(STEPS)]


def train(model: AllLayers, sharded: bool, mixed: bool) -> dict:
    device = torch.device("cuda", 0)
    if sharded:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        kw = {} if policy is None else {"mp_policy": policy}
        if mixed:
            fully_shard(model.bn)  # BatchNorm stays in float32 (its running statistics are float32), as usual
        fully_shard(model.fc, **kw)
        fully_shard(model, **kw)
    opt = AdaFisher(model, lr=1e-3, TCov=TCOV, weight_decay=1e-3, backend="fused")
    per_step = []
    for x, y in batches(device):
        opt.zero_grad()
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        per_step.append({n: (p.full_tensor() if sharded else p).detach().float().clone() for n, p in model.named_parameters()})
    fallbacks = opt.health["params_f_one"]
    return {"steps": per_step, "factors": sorted(opt.factors()), "f_one": fallbacks}


def worker(rank: int, port: int, out: str) -> None:
    local_master(port)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    plain = train(network().float().cuda(), sharded=False, mixed=False)
    sharded = train(network().float().cuda(), sharded=True, mixed=False)
    mixed = train(network().float().cuda(), sharded=True, mixed=True)
    torch.save({"plain": plain, "sharded": sharded, "mixed": mixed}, os.path.join(out, "runs.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path_factory.mktemp("fsdp_cuda")
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=1, join=True)
    return torch.load(out / "runs.pt", weights_only=True)


def test_fused_steps_on_dtensor_shards_equal_the_unsharded_model_per_step(runs):
    for step, (a, b) in enumerate(zip(runs["sharded"]["steps"], runs["plain"]["steps"])):
        for name in b:
            err = float((a[name] - b[name]).abs().max() / b[name].abs().max())
            assert err <= 1e-6, f"step {step + 1} {name}: relative difference {err:.2e}"
    assert runs["sharded"]["factors"] == runs["plain"]["factors"] and len(runs["plain"]["factors"]) == 9


def test_a_bf16_mixed_precision_policy_trains_on_the_fused_step(runs):
    mixed = runs["mixed"]
    assert len(mixed["factors"]) == 9 and mixed["f_one"] == 0
    last, first = mixed["steps"][-1], runs["plain"]["steps"][0]
    for name, p in last.items():
        assert torch.isfinite(p).all(), name
        # bf16 forward/backward: close to the fp32 run's direction, not equal to it
        ref = runs["plain"]["steps"][-1][name]
        assert float((p - ref).abs().max() / ref.abs().max()) < 0.1, name
    assert any(not torch.equal(last[n], first[n]) for n in last)
