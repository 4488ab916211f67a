"""The capture's implementation switch and the Python side of the one-launch factor
update, on the CPU: a stand-in extension restates the kernel's contract in torch, so the
batching, the NaN decisions, the first-capture attachment and the report run here."""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch
from torch import nn

from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture.factors import CaptureReport, update_factors
from lightning_cafin.capture.layer_capture import LayerCapture, PendingStats
from lightning_cafin.capture.layers import rule_for


@pytest.fixture
def impl():
    previous = ck.get_impl()
    yield ck.set_impl
    ck.set_impl(previous)


def test_set_impl_validates_and_returns_the_previous_choice(impl):
    impl("auto")
    assert ck.set_impl("torch") == "auto"
    assert ck.get_impl() == "torch"
    with pytest.raises(ValueError, match="one of"):
        ck.set_impl("fast")


def test_cpu_tensors_never_reach_the_extension(impl, monkeypatch):
    def boom():
        raise AssertionError("the extension must not be loaded for CPU tensors")

    monkeypatch.setattr(ck, "_extension", boom)
    for name in ("auto", "kernels"):
        impl(name)
        assert ck.ext_for(torch.randn(3)) is None
        assert ck.ext_for(torch.randn(3, dtype=torch.float64)) is None
    impl("torch")
    assert ck.ext_for(torch.randn(3)) is None


def test_report_names_keep_capture_order_and_compare_as_lists():
    rep = CaptureReport(["a"], ["z"], ["b"])
    assert rep.updated == ["a"] and rep.non_finite == ["b"] and rep.not_fired == ["z"]
    rep = CaptureReport()
    rep.record("x", False)
    rep.record("y", True)
    rep.record("w", False)
    assert list(rep.updated) == ["x", "w"] and len(rep.non_finite) == 1 and rep.non_finite[0] == "y"
    assert repr(rep.updated) == "['x', 'w']"


def test_reports_read_a_kept_launchs_host_flags_once_and_only_when_looked_at():
    """A kept launch hands its report the extension's ``HostFlags`` (its kernel wrote them into
    pinned host memory): read when the report is first looked at, once, in capture order;
    a report with no flag set has every layer updated."""

    class Flags:  # HostFlags' contract: values() waits for the launch the first time
        def __init__(self, values: list[int]) -> None:
            self.v, self.reads = values, 0

        def values(self) -> list[int]:
            self.reads += 1
            return list(self.v)

    names = ["a", "b", "c", "d"]
    flags = Flags([0, 1, 0, 1])
    rep = CaptureReport.on_device(names, flags)
    assert flags.reads == 0 and not rep.settled
    assert list(rep.non_finite) == ["b", "d"] and list(rep.updated) == ["a", "c"]
    assert flags.reads == 1
    clean = Flags([0, 0, 0, 0])
    rep = CaptureReport.on_device(names, clean)
    assert list(rep.updated) == names and len(rep.non_finite) == 0 and clean.reads == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device flags are copied from a CUDA device")
def test_reports_on_device_read_their_own_flags_while_buffers_are_reused():
    """Each capture's flags come back through a pinned buffer that is reused once read:
    reports made before another was read, read in any order, and read again, each give
    the flags they were made from (a shared buffer would give the last copy's)."""
    names = ["a", "b", "c", "d"]
    expected = {}
    reports = []
    for step in range(12):
        flags = (torch.rand(4, device="cuda") < 0.5).to(torch.int32)
        expected[step] = [n for n, f in zip(names, flags.tolist()) if f]
        reports.append(CaptureReport.on_device(names, flags))
        flags.fill_(7)  # queued after the report's copy: it must not reach the report
        if step % 3 == 2:  # read the last three, newest first: buffers go back out of order
            for k in (step, step - 2, step - 1):
                assert list(reports[k].non_finite) == expected[k]
                assert list(reports[k].updated) == [n for n in names if n not in expected[k]]
    for k, rep in enumerate(reports):  # read again: the host copy, not the reused buffer
        assert list(rep.non_finite) == expected[k]


def fake_factor_update_(h, s, H, S, kinds, flags, h_div, s_div, s_scale, extra, c_old, c_new):
    """The kernel's contract (csrc/capture_launch.h), restated with torch ops in float32."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    out = []
    for i in range(len(h)):
        inv_hn, inv_sn = 1.0 / f32(h_div[i]), 1.0 / f32(s_div[i])
        if kinds[i] == 1:
            Hr = torch.stack([h[i].square().sum() * inv_hn, f32(extra[i])])
        else:
            Hr = h[i] * inv_hn
            if flags[i] & 1:
                Hr = torch.cat([Hr, f32([extra[i]])])
        sv = s[i] * (1.0 / f32(s_scale[i])) if flags[i] & 4 else s[i]
        Sr = (sv.square() if kinds[i] == 1 else sv) * inv_sn
        if torch.isnan(Hr).any() or torch.isnan(Sr).any():
            out.append(1)
            continue
        out.append(0)
        for raw, stored in ((Hr, H[i]), (Sr, S[i])):
            v = raw.masked_fill(raw == float("inf"), 1.0).masked_fill(raw == -float("inf"), 0.0)
            v = (v - v.min()) / ((v.max() - v.min()) + 1e-6)
            old = torch.ones_like(stored) if flags[i] & 2 else stored
            stored.copy_(old * f32(c_old) + v * f32(c_new))
    return torch.tensor(out, dtype=torch.int32)


@pytest.fixture
def fake_ext(impl, monkeypatch):
    fake = types.SimpleNamespace(factor_update_=fake_factor_update_)
    monkeypatch.setattr(ck, "ext_for", lambda *t: fake if all(x.dtype == torch.float32 for x in t) else None)
    return fake


MODULES = [nn.Linear(5, 3), nn.Linear(4, 2, bias=False), nn.Conv2d(4, 6, 3, groups=2), nn.Conv2d(2, 3, 1, bias=False),
           nn.BatchNorm2d(3), nn.LayerNorm(6)]


@contextlib.contextmanager
def no_kernels():
    saved = ck.ext_for
    ck.ext_for = lambda *t: None
    try:
        yield
    finally:
        ck.ext_for = saved


def captures(seed=0):
    with no_kernels():
        return _captures(seed)


def _captures(seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, m in enumerate(MODULES):
        rule = rule_for(m)
        x = torch.randn((2, 4, 5, 5) if isinstance(m, nn.Conv2d) else (2, 3, 4, 4) if isinstance(m, nn.BatchNorm2d)
                        else (3, 6) if isinstance(m, nn.LayerNorm) else (3, m.in_features), generator=gen)
        if isinstance(m, nn.Conv2d):
            x = x[:, : m.in_channels]
        with torch.no_grad():
            y = m(x)
        h, hn = rule.input_partial(m, x)
        s, sn = rule.output_partial(m, torch.randn(y.shape, generator=gen))
        cap = LayerCapture(f"m{i}", m, rule, lambda: True)
        cap.pending = PendingStats(h, hn, s, sn, calls=1)
        out.append(cap)
    return out


def clone_caps(caps):
    out = []
    for c in caps:
        t = copy.copy(c)
        t.pending = PendingStats(c.pending.h.clone(), c.pending.hn, c.pending.s.clone(), c.pending.sn, c.pending.calls)
        t.H = None if c.H is None else c.H.clone()
        t.S = None if c.S is None else c.S.clone()
        out.append(t)
    return out


def same(a, b):
    for x, y in zip(a, b):
        assert (x.H is None) == (y.H is None), x.name
        if x.H is not None:
            torch.testing.assert_close(x.H, y.H, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(x.S, y.S, rtol=1e-6, atol=1e-7)


def torch_loop(caps, gamma, grad_scale=None):
    """update_factors with no extension at all: the torch ops only."""
    with no_kernels():
        return update_factors(caps, gamma, grad_scale)


@pytest.mark.parametrize("grad_scale", [None, 512.0])
def test_batched_update_equals_the_torch_loop(fake_ext, grad_scale):
    caps = captures()
    ref = clone_caps(caps)
    rep = update_factors(caps, 0.8, grad_scale)
    rep_ref = torch_loop(ref, 0.8, grad_scale)
    assert list(rep.updated) == list(rep_ref.updated) == [c.name for c in caps]
    same(caps, ref)
    # a second capture folds into the stored tensors in place
    fresh = captures(seed=1)
    for c, r, f in zip(caps, ref, fresh):
        c.pending = f.pending
        r.pending = PendingStats(f.pending.h.clone(), f.pending.hn, f.pending.s.clone(), f.pending.sn, 1)
    stored = [(c.H, c.S) for c in caps]
    update_factors(caps, 0.8, grad_scale)
    torch_loop(ref, 0.8, grad_scale)
    assert all(c.H is h and c.S is s for c, (h, s) in zip(caps, stored))
    same(caps, ref)


def test_nan_layers_keep_factors_and_first_capture_nan_attaches_none(fake_ext):
    caps = captures()
    caps[0].pending.h[1] = float("nan")
    rep = update_factors(caps, 0.8)
    assert caps[0].H is None and caps[0].S is None
    assert list(rep.non_finite) == ["m0"] and "m0" not in rep.updated
    kept = (caps[1].H.clone(), caps[1].S.clone())
    fresh = captures(seed=3)
    for c, f in zip(caps, fresh):
        c.pending = f.pending
    caps[1].pending.s[0] = float("nan")
    rep = update_factors(caps, 0.8)
    assert list(rep.non_finite) == ["m1"]
    assert torch.equal(caps[1].H, kept[0]) and torch.equal(caps[1].S, kept[1])
    assert caps[0].H is not None  # its first clean capture creates the factors


def test_layers_the_kernel_cannot_take_use_the_torch_loop(fake_ext):
    caps = captures()
    caps[2].pending.h = caps[2].pending.h.double()  # float64 statistics: torch loop
    caps[4].pending = PendingStats()  # did not fire
    rep = update_factors(caps, 0.8)
    assert rep.not_fired == ["m4"]
    assert list(rep.updated) == ["m0", "m1", "m2", "m3", "m5"]
    assert caps[2].H.dtype == torch.float64


def test_kept_kernel_slots_follow_the_loss_scale_the_counts_and_replaced_factors(fake_ext):
    """Five captures through the batched update, each against the torch loop: a layer keeps its
    kernel slot while nothing it depends on changes, and takes a new one when the loss
    scale, the counts or any factor tensor does."""
    caps = captures()
    ref = clone_caps(caps)

    def capture(seed, grad_scale=None, sn_factor=1.0):
        for c, r, f in zip(caps, ref, captures(seed=seed)):
            p = f.pending
            c.pending = PendingStats(p.h, p.hn, p.s, p.sn * sn_factor, 1)
            r.pending = PendingStats(p.h.clone(), p.hn, p.s.clone(), p.sn * sn_factor, 1)
        update_factors(caps, 0.8, grad_scale)
        torch_loop(ref, 0.8, grad_scale)
        same(caps, ref)
        return [c.kernel_slot for c in caps]

    update_factors(caps, 0.8)  # creates the factors
    torch_loop(ref, 0.8)
    first = capture(1)
    assert all(slot is not None for slot in first)
    assert capture(2) == first  # nothing changed: the same slots (compared by identity)
    scaled = capture(3, grad_scale=512.0)
    assert all(a is not b for a, b in zip(scaled, first)) and all(s.flags & 4 for s in scaled)
    counted = capture(4, grad_scale=512.0, sn_factor=2.0)  # another count (e.g. micro-batches)
    assert all(a is not b for a, b in zip(counted, scaled))
    caps[2].H = caps[2].H.clone()  # a factor replaced anywhere: every slot is made again
    replaced = capture(5, grad_scale=512.0, sn_factor=2.0)
    assert all(a is not b for a, b in zip(replaced, counted)) and replaced[2].H is caps[2].H
