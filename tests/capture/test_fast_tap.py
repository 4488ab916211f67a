"""A captured layer's forward that repeats the last one's tap takes it again through
``LayerCapture.fast_tap``, after the same checks as the general path, inline: it must give
the general path's statistics bit for bit, and any forward that differs (shapes, a
``no_capture()`` block, an evaluation forward, a frozen weight, taps off) must take the
general path, which decides as before.

Runs on the CPU with the stand-in extension of ``test_kept_launch`` (the real taps and
sinks, the factor update restated in torch).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_cafin import AdaFisher, no_capture
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture import taps
from lightning_cafin.capture.hooks import LayerCapture

from .test_gradient_taps import ext, tap_setting  # noqa: F401  (fixtures)
from .test_kept_launch import Tapped, _assert_same, kernels_on_cpu  # noqa: F401  (kernels_on_cpu: a fixture)

STEPS = 8


def _train(model: Tapped, general_only: bool, monkeypatch) -> tuple[AdaFisher, list[set[str]], list[tuple]]:
    """``STEPS`` capture steps (TCov 1) with a different kind of forward at some of them;
    ``general_only`` forgets every layer's fast tap before each forward.  Returns the
    optimizer, per step the layers whose training forward was tapped without asking the
    general path for a plan (``LayerCapture.tap_plan``), and per step the health counters."""
    torch.manual_seed(1)
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    caps = opt.binding.captures
    asked: set[str] = set()
    plan_for = LayerCapture.tap_plan

    def counted_tap_plan(self, *args):
        asked.add(self.name)
        return plan_for(self, *args)

    monkeypatch.setattr(LayerCapture, "tap_plan", counted_tap_plan)
    fast, health = [], []

    def forward(x: torch.Tensor) -> torch.Tensor:
        if general_only:
            for cap in caps.values():
                cap.fast_tap = None
        return model(x)

    for step in range(STEPS):
        opt.zero_grad()
        batch = 6 if step == 2 else 4  # new shapes at step 2, and back at step 3
        x, y = torch.randn(batch, 3, 5, 5), torch.randint(0, 5, (batch,))
        if step == 4:  # a validation forward in between: declined, no statistics
            model.eval()
            with torch.no_grad():
                forward(x)
            model.train()
        if step == 5:
            model.conv.weight.requires_grad_(False)  # its input is then read in the forward
        asked.clear()
        out_before = {name: cap.taps_out for name, cap in caps.items()}
        with taps.using(step != 6):  # step 6: Python hooks
            loss = nn.functional.cross_entropy(forward(x), y)
        fast.append({n for n, cap in caps.items() if cap.taps_out > out_before[n] and n not in asked})
        if step == 3:  # an auxiliary loss from a forward inside no_capture(): no statistics
            with no_capture():
                loss = loss + 0.01 * forward(x).mean()
            assert all(cap.excluded_forwards == 1 for cap in caps.values())  # reached, counted, not tapped
        loss.backward()
        opt.step()
        model.conv.weight.requires_grad_(True)
        h = opt.health
        health.append((h["capture_steps"], tuple(h["modules_not_fired"])))
    return opt, fast, health


def test_the_fast_tap_gives_the_general_paths_factors_and_is_taken_when_nothing_changed(
    kernels_on_cpu, monkeypatch  # noqa: F811
):
    torch.manual_seed(0)
    model = Tapped()
    ref, ref_fast, ref_health = _train(copy.deepcopy(model), True, monkeypatch)
    got, fast, health = _train(model, False, monkeypatch)
    _assert_same(got, ref)
    assert health == ref_health
    assert ref_fast == [set()] * STEPS  # forgotten before every forward: never taken
    layers = set(got.binding.captures)
    assert fast[0] == set()  # the first forward takes the general path and records the taps
    assert fast[1] == layers  # then every layer repeats its tap
    assert fast[2] == set() and fast[3] == set()  # new shapes, then the old ones again
    assert fast[4] == layers  # the validation forward before it changed nothing
    assert fast[5] == layers - {"conv"}  # a frozen weight: its input is read in the forward
    assert fast[6] == set()  # Python hooks
    assert fast[7] == layers - {"conv"}  # (its read of the frozen weight's input left no fast tap)
    assert all(cap.refused == 0 for cap in got.binding.captures.values())


def test_a_layer_computing_on_an_autocast_copy_repeats_its_read_in_the_forward(kernels_on_cpu, monkeypatch):  # noqa: F811
    """Under autocast the first Linear gets float32 and computes on a bfloat16 copy (its input
    read in the forward, ``TapPlan.tap_read``), the second gets bfloat16 (the plain tap): both
    repeat their tap, and the factors equal the general path's."""
    lowp = (torch.float32, torch.bfloat16)
    monkeypatch.setattr(ck, "ext_for", lambda *t: kernels_on_cpu.fake if all(v.dtype in lowp for v in t) else None)

    def train(general_only: bool) -> tuple[AdaFisher, list[set[str]]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
        caps = opt.binding.captures
        fast = []
        for _ in range(4):
            opt.zero_grad()
            if general_only:
                for cap in caps.values():
                    cap.fast_tap = None
            before = {n: cap.fast_tap for n, cap in caps.items()}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(5, 6)).float().square().mean()
            fast.append({n for n, cap in caps.items() if before[n] is not None and cap.fast_tap is before[n]})
            loss.backward()
            opt.step()
        return opt, fast

    ref, ref_fast = train(general_only=True)
    got, fast = train(general_only=False)
    for name, cap in got.binding.captures.items():
        want = ref.binding.captures[name]
        assert torch.equal(cap.H, want.H) and torch.equal(cap.S, want.S), name
    assert ref_fast == [set()] * 4
    assert fast == [set(), {"0", "2"}, {"0", "2"}, {"0", "2"}]
