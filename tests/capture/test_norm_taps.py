"""The C++ tap of a training batch norm, or of a layer norm on an input of 3 or more dims,
reads no tensor: the input's sums from the means the norm saved, the gradient's from its
bias gradient (``csrc/capture_tap.h``).

Against the Python hooks (which read the activation and the gradient) on the CPU, with the
extension's real ``TapPlan``: the same sums and factors for every such norm, shape and
layout, over micro-batches, two forwards before one backward, a retained graph and a
backward that computes no bias gradient; and the ordinary tap where the shortcut does not
apply (GroupNorm, RMSNorm, no bias, a 2-D layer norm, a frozen bias).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture import taps

from .test_gradient_taps import ext, on_cpu, tap_setting  # noqa: F401  (fixtures)


class Norms(nn.Module):
    """Batch norms (1d on (B, C) and (B, C, L), 2d, 3d), layer norms on 3-D and 4-D inputs,
    and the norms without the shortcut: GroupNorm, RMSNorm, a layer norm without a bias and
    one on a 2-D input (its statistics' dim 1 is the normalised dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.bn3 = nn.BatchNorm3d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.ln3 = nn.LayerNorm(6)
        self.rms = nn.RMSNorm(6)
        self.ln_no_bias = nn.LayerNorm(6, bias=False)
        self.ln4 = nn.LayerNorm(6)
        self.bn1_seq = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 6)
        self.bn1 = nn.BatchNorm1d(6)
        self.ln2 = nn.LayerNorm(6)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        # a tanh after every norm: a norm's input gradient sums to 0 over what it normalises,
        # so a norm feeding a norm directly would see gradient sums of rounding noise
        t = torch.tanh
        y = torch.relu(self.bn2(self.conv(x)))  # (B, 4, 6, 6)
        y = t(self.bn3(y.unsqueeze(2).expand(-1, -1, 2, -1, -1).contiguous() * 1.5)).mean(2)  # a 3-D batch norm
        y = t(self.gn(y)).mean(3)  # (B, 4, 6)
        y = t(self.ln_no_bias(t(self.rms(t(self.ln3(y))))))
        y = t(self.ln4(y.unsqueeze(1).expand(-1, 2, -1, -1) * 1.5)).mean(1)  # a layer norm on (B, 2, 4, 6)
        y = t(self.bn1_seq(y)).mean(2)  # (B, 4)
        return self.head(self.ln2(torch.relu_(self.bn1(self.fc(y)))))  # an in-place ReLU after the norm


SHORTCUT = ("bn2", "bn3", "ln3", "ln4", "bn1_seq", "bn1")
ORDINARY = ("gn", "rms", "ln_no_bias", "ln2")


def batches(n, channels_last=False):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        x = torch.randn(4, 3, 6, 6, generator=gen)
        out.append((x.contiguous(memory_format=torch.channels_last) if channels_last else x,
                    torch.randint(0, 5, (4,), generator=gen)))
    return out


def train(model, taps_on, steps=3, micro_batches=1, channels_last=False):
    taps.set_enabled(taps_on)
    opt = AdaFisher(model, lr=1e-2, TCov=1, backend="foreach")
    data = iter(batches(steps * micro_batches, channels_last))
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro_batches):
            x, y = next(data)
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def norm_taps(opt, name, counter="norm_taps"):
    return sum(getattr(plan, counter) for plan in opt.binding.captures[name].tap_plans.values() if plan is not None)


def deferred(opt, name):
    """The norm's taps whose statistics were left to the end of their backward (csrc/deferred_norms.h)."""
    return norm_taps(opt, name, "deferred_norm_taps")


def assert_same_factors(got, want):
    """The factors, to 1e-6 of each vector's largest entry: the sums differ by rounding, and
    a sum that nearly cancels (a gradient sum over a batch) differs more than its size."""
    assert sorted(got.factors()) == sorted(want.factors())
    for name, f in want.factors().items():
        g = got.factors()[name]
        for a, b in ((g.H, f.H), (g.S, f.S)):
            err = float((a - b).abs().max() / b.abs().max())
            assert err <= 1e-6, f"{name}: {err:.2e}"


def sums_both_ways(model, backwards, names=SHORTCUT):
    """The named norms' pending (calls, h, s) after ``backwards(m)`` on a copy ``m`` of ``model``
    bound to a capturing optimizer: ``{False: Python hooks, True: C++ taps}``, and the tapped
    run's optimizer."""
    sums = {}
    for taps_on in (False, True):
        with taps.using(taps_on):
            m = copy.deepcopy(model)
            opt = AdaFisher(m, TCov=1, backend="foreach")
            backwards(m)
            sums[taps_on] = {n: (p.calls, p.h.clone(), p.s.clone()) for n in names for p in [opt.binding.captures[n].pending]}
    return sums, opt


def assert_same_sums(sums, calls):
    """The taps' sums are the Python hooks', each from ``calls`` forward/backward pairs."""
    for name, (n, h, s) in sums[False].items():
        assert sums[True][name][0] == n == calls, name
        torch.testing.assert_close(sums[True][name][1], h, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(sums[True][name][2], s, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
def test_norms_take_the_saved_means_and_the_bias_gradient(on_cpu, micro_batches, channels_last):  # noqa: F811
    torch.manual_seed(0)
    model = Norms().to(memory_format=torch.channels_last) if channels_last else Norms()
    # one step: later steps train on weights that the first one moved apart by rounding
    ref = train(copy.deepcopy(model), False, steps=1, micro_batches=micro_batches, channels_last=channels_last)
    got = train(model, True, steps=1, micro_batches=micro_batches, channels_last=channels_last)
    for name in SHORTCUT:
        # every micro-batch's left to the end of its backward (a later one's bias gradient is
        # added into .grad; its own memory is what the end reads)
        assert norm_taps(got, name) == micro_batches == deferred(got, name), name
    for name in ORDINARY:  # the ordinary tap
        assert norm_taps(got, name) == 0 and got.binding.captures[name].sink is not None, name
    assert_same_factors(got, ref)  # (a norm's two-entry H, min-max normalised, hardly depends on h's scale: below)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_norms_sums_equal_the_python_hooks(on_cpu, micro_batches, channels_last):  # noqa: F811
    torch.manual_seed(0)
    model = Norms().to(memory_format=torch.channels_last) if channels_last else Norms()
    data = batches(micro_batches, channels_last)

    def backwards(m):
        for x, y in data:
            nn.functional.cross_entropy(m(x), y).backward()

    sums, _ = sums_both_ways(model, backwards)
    assert_same_sums(sums, micro_batches)


def test_two_forwards_before_one_backward_add_two_pairs(on_cpu):  # noqa: F811
    """A siamese step: each call of the norm has its own backward node, so its own tap."""
    torch.manual_seed(0)
    (a, y), (b, _) = batches(2)

    def backwards(m):
        (nn.functional.cross_entropy(m(a), y) + nn.functional.cross_entropy(m(b), y)).backward()

    sums, opt = sums_both_ways(Norms(), backwards, names=("bn2",))
    assert_same_sums(sums, 2)
    assert deferred(opt, "bn2") == 0  # (one bias gradient for both calls: each is read in its hook)


def test_a_retained_graph_adds_nothing_and_the_sums_are_not_the_bias_gradient(on_cpu):  # noqa: F811
    torch.manual_seed(0)
    model = Norms()
    taps.set_enabled(True)
    opt = AdaFisher(model, TCov=1, backend="foreach")
    (x, y), = batches(1)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    pending = opt.binding.captures["bn2"].pending
    assert pending.calls == 1 and norm_taps(opt, "bn2") == 1
    s = pending.s.clone()
    # two backwards of one graph: the bias gradient is twice the first's, the statistics the first's
    torch.testing.assert_close(2 * s, model.bn2.bias.grad, rtol=1e-5, atol=1e-7)
    assert pending.s.data_ptr() != model.bn2.bias.grad.data_ptr()
    model.bn2.bias.grad.mul_(0.5)  # what gradient clipping does, in place
    assert torch.equal(pending.s, s)


@pytest.mark.parametrize("backward", ["grad of the input, then the loss's backward", "backward for the weights alone"])
def test_a_backward_computing_no_bias_gradient_sums_the_output_gradient(on_cpu, backward):  # noqa: F811
    """``autograd.grad`` for the input, or ``backward(inputs=...)`` without the biases,
    computes no bias gradient: the tap sums the norm's output gradient instead, in that
    backward, as the Python hooks do (and a later backward through the graph adds nothing)."""
    torch.manual_seed(0)
    (x, y), = batches(1)
    x.requires_grad_(True)

    def backwards(m):
        loss = nn.functional.cross_entropy(m(x), y)
        if backward.startswith("grad"):
            torch.autograd.grad(loss, x, retain_graph=True)
            loss.backward()
        else:
            loss.backward(inputs=[getattr(m, n).weight for n in SHORTCUT])

    sums, opt = sums_both_ways(Norms(), backwards)
    assert [norm_taps(opt, n) for n in SHORTCUT] == [1] * len(SHORTCUT)  # (the tapped run's)
    assert_same_sums(sums, 1)


def test_a_frozen_bias_takes_the_ordinary_tap(on_cpu):  # noqa: F811
    torch.manual_seed(0)
    model = Norms()
    model.bn2.bias.requires_grad_(False)
    ref = train(copy.deepcopy(model), False, steps=1)
    got = train(model, True, steps=1)
    assert norm_taps(got, "bn2") == 0 and norm_taps(got, "bn3") == norm_taps(got, "ln3") == 1
    assert_same_factors(got, ref)


def test_a_backward_building_a_graph_records_nothing_of_the_sums(on_cpu):  # noqa: F811
    """``create_graph=True`` (a gradient penalty's backward): the statistics are plain tensors."""
    torch.manual_seed(0)
    model = Norms()
    taps.set_enabled(True)
    opt = AdaFisher(model, TCov=1, backend="foreach")
    (x, y), = batches(1)
    grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()), create_graph=True)
    for name in SHORTCUT:
        pending = opt.binding.captures[name].pending
        assert pending.calls == 1 and not pending.h.requires_grad and not pending.s.requires_grad, name
    assert all(g.requires_grad for g in grads)  # (the gradients themselves do carry the graph)


@pytest.mark.parametrize("means_shape", [(5,), (3, 7, 1), (2, 4, 5, 1), (2, 3, 4, 2)])
def test_norm_stats_on_the_cpu_sums_the_means_and_copies_the_bias_gradient(ext, means_shape):  # noqa: F811
    """The op the norm tap makes one launch of, on the CPU (its reference): h = the means summed
    over every dim but the channel dim (0 of a batch norm's 1-D means, 1 of a layer norm's
    per-row means) times the scale, s = the bias gradient as a float32 copy."""
    torch.manual_seed(0)
    means = torch.randn(means_shape, dtype=torch.float64)
    bias_grad = torch.randn(6, dtype=torch.bfloat16)
    h, s = ext.norm_stats(means, bias_grad, 0.25)
    dims = [d for d in range(means.dim()) if d != (0 if means.dim() == 1 else 1)]
    want = means.float() * 0.25 if not dims else means.sum(dims, dtype=torch.float32) * 0.25
    assert h.dtype == s.dtype == torch.float32
    torch.testing.assert_close(h, want, rtol=1e-6, atol=0)
    assert torch.equal(s, bias_grad.float())
    bias_grad.zero_()
    assert s.abs().sum() > 0  # a copy: the bias gradient accumulating later does not change it


def test_norm_stats_names_a_bad_argument(ext):  # noqa: F811
    with pytest.raises(RuntimeError, match="bias_grad be 1-D"):
        ext.norm_stats(torch.randn(4), torch.randn(2, 2), 1.0)
    with pytest.raises(RuntimeError, match="floating-point"):
        ext.norm_stats(torch.arange(4), torch.randn(4), 1.0)
    with pytest.raises(RuntimeError, match="means must be 1-D .* or have 3 or more dims"):
        ext.norm_stats(torch.randn(4, 3), torch.randn(3), 1.0)  # as the CUDA op refuses it


@pytest.fixture
def layer_norm_in_float32(on_cpu, monkeypatch):  # noqa: F811
    """``nn.LayerNorm`` computing in float32 on a bf16 input, as CUDA autocast runs it (a cast,
    then the norm: bf16 in, float32 out; CPU autocast keeps it in bf16).  The capture hook then
    reads the input in the forward (``TapPlan.tap_read``): autograd keeps the cast, not it.
    The extension's CPU reference takes bf16 tensors too."""
    stand_in = ck.ext_for(torch.zeros(1))
    monkeypatch.setattr(ck, "ext_for", lambda *t: stand_in if all(v.dtype in (torch.float32, torch.bfloat16) for v in t) else None)
    layer_norm = nn.functional.layer_norm
    monkeypatch.setattr(nn.functional, "layer_norm", lambda x, *args, **kwargs: layer_norm(x.float(), *args, **kwargs))


class Bf16Stream(nn.Module):
    """A token model whose residual stream is bf16 where its layer norm takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.ln(self.fc(x).bfloat16()))).mean(1)


def token_batches(n):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 3, 4, generator=gen), torch.randint(0, 5, (4,), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_layer_norm_computing_on_a_cast_of_its_input_takes_the_saved_means(layer_norm_in_float32, micro_batches):
    """Input bf16, output float32: the norm tap (the means autograd saved, read in the
    backward) instead of a read of the input in the forward; the sums are the Python hooks'
    (which read the bf16 input: the means were computed from its exact float32 values)."""
    torch.manual_seed(0)
    data = token_batches(micro_batches)

    def backwards(m):
        for x, y in data:
            nn.functional.cross_entropy(m(x), y).backward()

    sums, opt = sums_both_ways(Bf16Stream(), backwards, names=("ln",))
    assert norm_taps(opt, "ln") == micro_batches
    assert_same_sums(sums, micro_batches)


def test_under_saved_tensor_hooks_a_cast_layer_norm_is_read_in_the_forward(layer_norm_in_float32):
    """The saved means belong to the hooks (offloading, checkpointing): taking them in the
    forward would run their unpack hook there, so the input is read at once, as before."""
    torch.manual_seed(0)
    (x, y), = token_batches(1)
    unpacked_in_forward = []

    def backwards(m):
        in_forward = [True]

        def unpack(t):
            if in_forward[0]:
                unpacked_in_forward.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            loss = nn.functional.cross_entropy(m(x), y)
        in_forward[0] = False
        loss.backward()

    sums, opt = sums_both_ways(Bf16Stream(), backwards, names=("ln",))
    assert norm_taps(opt, "ln") == 0 and not unpacked_in_forward
    assert_same_sums(sums, 1)


# ---------------------------------------------------------------- deferred to the backward's end


def test_deferred_and_immediate_norm_taps_give_the_same_sums(on_cpu, ext):  # noqa: F811
    torch.manual_seed(0)
    (x, y), = batches(1)
    model = Norms()
    got = {}
    for defer in (True, False):
        with taps.using(True), taps.deferred_norms(defer):
            m = copy.deepcopy(model)
            opt = AdaFisher(m, TCov=1, backend="foreach")
            nn.functional.cross_entropy(m(x), y).backward()
        assert ext.capture_defer_norms(True) is True  # (restored after the block: the default)
        got[defer] = {n: (p.h.clone(), p.s.clone()) for n in SHORTCUT for p in [opt.binding.captures[n].pending]}
        assert [deferred(opt, n) for n in SHORTCUT] == [1 if defer else 0] * len(SHORTCUT)
    for name in SHORTCUT:
        assert torch.equal(got[True][name][0], got[False][name][0]), name
        assert torch.equal(got[True][name][1], got[False][name][1]), name


@pytest.mark.parametrize("elsewhere", ["the bias in the loss", "a post-accumulate hook", "a tensor hook on the bias",
                                       "its accumulator held"])
def test_a_bias_gradient_that_is_not_the_norms_alone_is_read_in_the_hook(on_cpu, elsewhere):  # noqa: F811
    """Where the bias's .grad at the backward's end would not be this call's bias gradient
    (another use of the bias adds to it, a hook may change it, or something else holds its
    accumulator), the tap reads the gradient in
    its hook: the sums are the Python hooks' (the norm's output gradient summed), whatever
    the hook then does to .grad."""
    torch.manual_seed(0)
    (x, y), = batches(1)
    held = []

    def backwards(m):
        bias = m.bn2.bias
        extra = 0.0
        if elsewhere == "the bias in the loss":
            extra = 0.5 * bias.square().sum()
        elif elsewhere == "a post-accumulate hook":
            def triple(p):
                p.grad.mul_(3.0)

            bias.register_post_accumulate_grad_hook(triple)
        elif elsewhere == "a tensor hook on the bias":
            bias.register_hook(lambda g: g * 3.0)
        else:  # (as a reducer holds every parameter's: DDP's reducer does)
            held.append(bias.view_as(bias).grad_fn.next_functions[0][0])
        (nn.functional.cross_entropy(m(x), y) + extra).backward()

    sums, opt = sums_both_ways(Norms(), backwards)
    assert_same_sums(sums, 1)
    assert deferred(opt, "bn2") == 0 and deferred(opt, "bn3") == 1


@pytest.mark.parametrize("meanwhile", [".grad already set", ".grad moved away by an earlier final callback"])
def test_a_deferred_norm_reads_its_own_gradient_whatever_becomes_of_grad(on_cpu, meanwhile):  # noqa: F811
    """The end of the backward reads the call's bias gradient itself, not .grad: a gradient
    added into an existing .grad, or one that a final callback queued before the norms' moves
    out of .grad (as FSDP2's post-backward does with the unsharded gradients), gives the
    Python hooks' sums, deferred."""
    torch.manual_seed(0)
    (x, y), = batches(1)
    moved = {}

    def backwards(m):
        bias = m.bn2.bias
        if meanwhile == ".grad already set":
            bias.grad = torch.randn_like(bias)
            out = m(x)
        else:
            def move_grads():
                moved["bn2"] = bias.grad
                bias.grad = None

            out = m(x)
            # (a hook on the output's gradient runs first in the backward: its callback is queued first)
            out.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(move_grads))
        nn.functional.cross_entropy(out, y).backward()
        moved["left in .grad"] = bias.grad

    sums, opt = sums_both_ways(Norms(), backwards)
    assert_same_sums(sums, 1)
    assert deferred(opt, "bn2") == 1 and deferred(opt, "bn3") == 1
    if "bn2" in moved:  # (the callback did run before the norms' end)
        assert moved["left in .grad"] is None and moved["bn2"] is not None


def test_a_backward_that_fails_adds_none_of_its_deferred_norms(on_cpu):  # noqa: F811
    """No final callback runs after an error: the deferred calls add nothing (as taps that
    never fired), leave nothing behind, and the next backward's are taken as usual."""
    torch.manual_seed(0)
    model = Norms()
    taps.set_enabled(True)
    opt = AdaFisher(model, TCov=1, backend="foreach")
    (x, y), = batches(1)
    x.requires_grad_(True)

    def fail(_):
        raise RuntimeError("a hook at the end of the backward failed")

    handle = x.register_hook(fail)  # (the input's gradient: after every layer's)
    with pytest.raises(RuntimeError, match="a hook at the end of the backward failed"):
        nn.functional.cross_entropy(model(x), y).backward()
    handle.remove()
    assert [opt.binding.captures[n].pending.calls for n in SHORTCUT] == [0] * len(SHORTCUT)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    assert [opt.binding.captures[n].pending.calls for n in SHORTCUT] == [1] * len(SHORTCUT)
    assert [deferred(opt, n) for n in SHORTCUT] == [2] * len(SHORTCUT)
