"""FSDP2 moves the unsharded gradients out of ``.grad`` during the backward (its
post-backward, and for the root's parameters a final callback queued before any norm's),
so the norms' statistics left to the end of the backward (``csrc/deferred_norms.h``) must
read each call's own bias gradient: on one gloo rank on the CPU, with the extension's real
taps, every norm's sums with the deferral equal those launched in the hooks, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture import taps
from lightning_cafin.kernels.loader import extension_if_built
from tests.distributed_runs import finish_gloo, free_port, init_gloo, spawn_ranks

from .test_gradient_taps import cpu_ext_for, ext  # noqa: F401  (fixture)
from .test_norm_taps import SHORTCUT, Norms, batches, deferred

pytestmark = pytest.mark.slow


def worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, 1, port)
    ck.ext_for = cpu_ext_for(extension_if_built(), [])
    mesh = init_device_mesh("cpu", (1,))
    (x, y), = batches(1)
    got = {}
    for defer in (True, False):
        with taps.using(True), taps.deferred_norms(defer):
            torch.manual_seed(0)
            model = Norms()
            fully_shard(model.bn2, mesh=mesh)  # a unit of its own: its post-backward runs in the backward
            fully_shard(model, mesh=mesh)  # the other norms' in the root's final callback
            opt = AdaFisher(model, TCov=1, backend="foreach")
            nn.functional.cross_entropy(model(x), y).backward()
            got[defer] = {n: (p.calls, p.h if p.h is None else p.h.clone(), p.s if p.s is None else p.s.clone(), deferred(opt, n))
                          for n in SHORTCUT for p in [opt.binding.captures[n].pending]}
            got[defer]["bn2 .grad"] = model.bn2.bias.grad is not None
    finish_gloo(got, out)


def test_norms_deferred_under_fsdp2_read_their_own_gradients(ext, tmp_path):  # noqa: F811
    out = tmp_path / "rank0.pt"
    spawn_ranks(worker, 1, (free_port(), str(out)), [out])
    got = torch.load(out, weights_only=True)
    assert got[True]["bn2 .grad"] and got[False]["bn2 .grad"]  # (on the sharded parameter by then)
    for name in SHORTCUT:
        calls, h, s, n_deferred = got[True][name]
        assert (calls, n_deferred) == (1, 1), name
        assert got[False][name][0] == 1 and got[False][name][3] == 0, name
        assert torch.equal(h, got[False][name][1]) and torch.equal(s, got[False][name][2]), name
