"""What a capture step adds to a train step on the GPU, counted in device operations.

A capture step is host-bound on the bench's workloads: each kernel it launches costs the
host about as much as one of the model's own ops, so the device operations it adds, not
their device time, are what its cost above a normal step follows.  The design's budget
(``lightning_cafin.bench.launches.BUDGET``): per captured layer one launch per statistic,
per step a constant.  A torch op per layer slipping into the capture path (a dtype copy,
a gather, a fill) shows here as a count above that budget, with the operations that make
it up.
"""

from __future__ import annotations

import pytest
import torch

from lightning_cafin.bench import MATRIX_WORKLOADS, workloads
from lightning_cafin.bench.launches import capture_launches
from lightning_cafin.bench.matrix import count_launches

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("name", MATRIX_WORKLOADS)
def test_a_capture_step_adds_at_most_the_statistics_launches_of_its_layers(name, fused_ok):
    device = torch.device("cuda")
    wl = workloads(device, quick=True)[name]
    counted = count_launches(wl, device, wl.batch(device))
    assert counted is not None
    listing = "\n".join(f"  {v:+6.1f}  {k[:120]}" for k, v in counted["added_by_operation"].items())
    print(f"{name}: {counted['added']:.1f} device operations added per capture step (budget {counted['budget']}, "
          f"layers {counted['layers']})\n{listing}")
    assert counted["added"] <= counted["budget"], (
        f"{name}: a capture step adds {counted['added']:.1f} device operations, more than the {counted['budget']} its "
        f"layers {counted['layers']} allow; per step, by operation:\n{listing}")
    # a launch of its own for every other layer, one for all the norms of a backward (deferred_norms.h)
    layers, norms = sum(counted["layers"].values()), counted["layers"].get("norm", 0)
    least = layers - norms + (1 if norms else 0)
    assert layers >= 2 and counted["added"] >= least, f"{name}: no statistics launched?\n{listing}"


def test_capture_launches_counts_per_step_with_the_budget_of_the_layers(fused_ok):
    """Two linear layers and a layer norm: a budget of 2 + 2 + 1 launches and the constant;
    the counts are per step and the added ones their difference."""
    from lightning_cafin import AdaFisher

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2)).cuda()
    opt = AdaFisher(model, lr=1e-3, TCov=10**9)
    x = torch.randn(4, 8, device="cuda")

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    def capture():
        opt.capture_next_step()
        step()

    for _ in range(4):
        capture()
    got = capture_launches(opt, step, capture)
    assert got is not None and got["layers"] == {"linear": 2, "norm": 1} and got["budget"] == 2 * 2 + 1 + 8
    assert got["capture"] - got["normal"] == got["added"] and got["added"] >= 3
