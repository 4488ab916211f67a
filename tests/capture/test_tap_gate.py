"""The gate of the forwards' C++ repeat (``tap_gate.py``): open only at the settings epoch it
was opened at, so that every change of a setting the Python hook reads, and every change
of the owner's schedule, sends the next forward back to the Python hook."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lightning_cafin import AdaFisher, no_capture
from lightning_cafin.capture import kernels as ck
from lightning_cafin.capture import streams, taps
from lightning_cafin.capture.tap_gate import TapGate

from .test_gradient_taps import ext, tap_setting  # noqa: F401  (fixtures)
from .test_kept_launch import kernels_on_cpu  # noqa: F401  (a fixture)


def _opened() -> TapGate:
    gate = TapGate()
    gate.open(side=True)
    assert gate.is_open and gate.side
    return gate


def test_a_new_gate_is_closed_and_close_closes_it():
    gate = TapGate()
    assert not gate.is_open
    gate.open(side=False)
    assert gate.is_open and not gate.side
    gate.close()
    assert not gate.is_open


@pytest.mark.parametrize("change", ["no_capture", "taps", "side_stream", "impl", "compiled_autograd"])
def test_every_change_of_a_setting_the_python_hook_reads_leaves_an_open_gate_behind(change):
    gate = _opened()
    if change == "no_capture":
        with no_capture():
            assert not gate.is_open
            inside = _opened()
        assert not inside.is_open  # leaving the block counts too
    elif change == "taps":
        with taps.using(taps.enabled()):  # (even setting the same value)
            pass
    elif change == "side_stream":
        previous = streams.set_enabled(not streams.enabled())
        streams.set_enabled(previous)
    elif change == "impl":
        ck.set_impl(ck.set_impl("torch"))
    else:
        import torch._dynamo.config as config

        with config.patch(compiled_autograd=not config.compiled_autograd):  # (its own patching: restored after)
            taps.note_compiled_autograd_config()
        reopened = _opened()
        taps.note_compiled_autograd_config()  # (the setting back as it was: a change again)
        assert not reopened.is_open
    assert not gate.is_open


def test_reading_an_unchanged_compiled_autograd_config_keeps_the_gate_open():
    taps.note_compiled_autograd_config()
    gate = _opened()
    taps.note_compiled_autograd_config()  # what every optimizer step does
    assert gate.is_open


def test_a_no_capture_block_open_on_another_thread_keeps_the_owners_gate_closed(kernels_on_cpu):  # noqa: F811
    """The general path opens its owner's gate after a tap, but only while no block is open
    on any thread (the C++ repeat cannot tell threads apart)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = AdaFisher(model, lr=1e-3, TCov=1, backend="foreach")
    gate = opt.binding.tap_gate
    model(torch.randn(2, 3)).sum().backward()
    assert gate.is_open  # the forward's taps opened it
    opt.step()
    assert not gate.is_open
    entered, leave = threading.Event(), threading.Event()

    def other_thread() -> None:
        with no_capture():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert entered.wait(10)
        taps_before = {n: cap.taps_out for n, cap in opt.binding.captures.items()}
        model(torch.randn(2, 3)).sum().backward()
        assert not gate.is_open
        # this thread's forwards were still tapped (by the Python hook)
        assert all(cap.taps_out == taps_before[n] + 1 for n, cap in opt.binding.captures.items())
    finally:
        leave.set()
        thread.join()


def test_every_change_of_the_schedule_closes_the_owners_gate():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = AdaFisher(model, lr=1e-3, TCov=3, backend="foreach")
    gate = opt.binding.tap_gate
    gate.open(side=False)
    opt.capture_next_step()  # forcing a capture
    assert not gate.is_open
    gate.open(side=False)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()  # a step taken
    assert not gate.is_open
    gate.open(side=False)
    opt.load_state_dict(opt.state_dict())  # a count loaded
    assert not gate.is_open
