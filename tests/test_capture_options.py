"""Capture implementation and side stream as optimizer options; the environment read lazily."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher
from lightning_cafin.capture import kernels as capture_kernels
from lightning_cafin.capture import streams as capture_streams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def restore():
    impl, stream = capture_kernels.get_impl(), capture_streams.setting()
    yield
    capture_kernels.set_impl(impl)
    capture_streams.set_enabled(stream)


def test_bad_values_are_refused_naming_the_argument():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"capture must be one of 'auto', 'torch', 'kernels', got 'fast'"):
        AdaFisher(model, capture="fast")
    with pytest.raises(TypeError, match="capture_stream must be True, False, 'auto' or None"):
        AdaFisher(model, capture_stream="off")  # type: ignore[arg-type]


@pytest.mark.parametrize("var, value", [("LIGHTNING_CAFIN_CAPTURE", "fast"), ("LIGHTNING_CAFIN_CAPTURE_STREAM", "maybe")])
def test_a_bad_environment_variable_does_not_break_the_import(var, value):
    code = (
        "import lightning_cafin\n"
        "from lightning_cafin.capture import kernels, streams\n"
        "try:\n"
        "    kernels.get_impl(); streams.enabled()\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
    )
    env = {**os.environ, var: value, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"ValueError: the environment variable {var} must be one of" in out.stdout and repr(value) in out.stdout


@pytest.mark.parametrize("value, want", [(None, "auto False"), ("1", "True True"), ("off", "False False"),
                                         (" AUTO ", "auto False")])
def test_the_stream_setting_is_auto_unless_asked_for(value, want):
    """The process setting (then the stream in use): "auto" by default, the current stream
    in use until an optimizer's capture step chooses."""
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_CAFIN_CAPTURE_STREAM"}
    if value is not None:
        env["LIGHTNING_CAFIN_CAPTURE_STREAM"] = value
    code = "from lightning_cafin.capture import streams\nprint(streams.setting(), streams.enabled())\n"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_explicit_options_apply_when_the_capture_begins(restore):
    capture_kernels.set_impl("auto")
    capture_streams.set_enabled(True)
    model = nn.Linear(3, 2)
    opt = AdaFisher(model, TCov=10, capture="torch", capture_stream=False, backend="foreach")
    assert capture_kernels.get_impl() == "auto" and capture_streams.enabled()  # nothing changes at construction
    model(torch.randn(4, 3)).sum().backward()  # a capture step's forward
    assert capture_kernels.get_impl() == "torch" and not capture_streams.enabled()
    opt.step()
    capture_kernels.set_impl("auto")
    plain = AdaFisher(nn.Linear(3, 2), TCov=10, backend="foreach")  # None: the process default stays
    plain.zero_grad()
    assert plain.capture_options.impl is None
    assert capture_kernels.get_impl() == "auto"


def test_auto_stream_off_the_gpu_keeps_the_current_stream_and_times_nothing(restore):
    """capture_stream="auto" on CPU parameters: every capture step on the current stream,
    no event made (the chooser's clock is the GPU's), training as with False."""
    capture_streams.set_enabled(True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    opt = AdaFisher(model, TCov=1, capture_stream="auto", backend="foreach")
    ref = AdaFisher(twin, TCov=1, capture_stream=False, backend="foreach")
    for _ in range(6):
        x = torch.randn(5, 4)
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            m(x).square().sum().backward()
            assert not capture_streams.enabled()
            o.step()
    assert opt.capture_options.chooses_stream and opt.stream_chooser.choice is None
    assert opt.stream_chooser.times == {True: [], False: []}
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_the_process_setting_decides_for_optimizers_without_the_option(restore):
    """capture_stream=None follows the process setting: "auto" chooses by timing, True or
    False fix the stream; an explicit option overrides it for its optimizer."""
    plain = AdaFisher(nn.Linear(3, 2), backend="foreach")
    fixed = AdaFisher(nn.Linear(3, 2), capture_stream=False, backend="foreach")
    capture_streams.set_enabled("auto")
    assert plain.capture_options.chooses_stream and not fixed.capture_options.chooses_stream
    capture_streams.set_enabled(True)
    assert not plain.capture_options.chooses_stream
    assert AdaFisher(nn.Linear(3, 2), capture_stream="auto", backend="foreach").capture_options.chooses_stream


def test_under_auto_an_optimizers_choice_is_the_stream_in_use_and_the_setting_stays(restore):
    capture_streams.set_enabled("auto")
    plain = AdaFisher(nn.Linear(3, 2), backend="foreach").capture_options
    plain.apply(True)  # the side stream chosen (or on trial) for this capture step
    assert capture_streams.enabled() and capture_streams.setting() == "auto"
    plain.apply(False)
    assert not capture_streams.enabled() and capture_streams.setting() == "auto"
    plain.apply(True)
    AdaFisher(nn.Linear(3, 2), capture_stream=False, backend="foreach").capture_options.apply(True)
    assert capture_streams.setting() is False and not capture_streams.enabled()  # an explicit value is the setting
    AdaFisher(nn.Linear(3, 2), capture_stream="auto", backend="foreach").capture_options.apply(True)
    assert capture_streams.setting() == "auto" and capture_streams.enabled()
    capture_streams.set_enabled("auto")  # set anew: the current stream until an optimizer chooses
    assert not capture_streams.enabled()


def test_a_bad_stream_setting_is_refused_naming_the_values(restore):
    with pytest.raises(TypeError, match="must be True, False or 'auto', got 'side'"):
        capture_streams.set_enabled("side")  # type: ignore[arg-type]
    capture_streams.use(True)  # under a fixed setting the choice has no effect
    capture_streams.set_enabled(False)
    capture_streams.use(True)
    assert not capture_streams.enabled()
