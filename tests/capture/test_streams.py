"""``capture/streams.py``'s process settings as the environment gives them (``env_setting``:
an on/off value, or a named choice such as the capture stream's ``auto``), an on/off switch
(``EnvSwitch``, also the C++ taps' ``taps.py``) read when first needed, a bad value refused
naming the variable; and under ``"auto"`` the stream in use is the one the optimizer chose."""

from __future__ import annotations

import pytest

from lightning_cafin.capture import streams
from lightning_cafin.capture.streams import AUTO, EnvSwitch, env_setting

VAR = "LIGHTNING_CAFIN_TEST_SWITCH"


@pytest.mark.parametrize("raw, value", [("", True), ("0", False), ("Off", False), ("yes", True), (" 1 ", True)])
def test_an_on_off_switch_reads_its_variable_when_first_asked(monkeypatch, raw, value):
    switch = EnvSwitch(VAR, default=True)
    monkeypatch.setenv(VAR, raw)
    assert switch.get() is value
    monkeypatch.setenv(VAR, "0" if value else "1")  # (read once: later changes of the variable are not seen)
    assert switch.get() is value
    assert switch.set(not value) is value and switch.get() is (not value)


def test_an_on_off_switch_refuses_a_named_choice_it_does_not_take(monkeypatch):
    monkeypatch.setenv(VAR, "auto")
    with pytest.raises(ValueError, match=f"the environment variable {VAR} must be one of 1, .*, off, got 'auto'"):
        EnvSwitch(VAR).get()


@pytest.mark.parametrize("raw, value", [("", AUTO), ("AUTO", AUTO), ("1", True), ("false", False)])
def test_the_stream_settings_variable_takes_auto_and_is_auto_when_unset(monkeypatch, raw, value):
    monkeypatch.setenv(streams.ENV_VAR, raw)
    got = env_setting(streams.ENV_VAR, AUTO, (AUTO,))
    assert got == value and type(got) is type(value)


def test_other_values_are_refused_naming_the_variable_and_what_it_takes(monkeypatch):
    monkeypatch.setenv(streams.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=f"{streams.ENV_VAR} must be one of .*off, auto, got 'sometimes'"):
        env_setting(streams.ENV_VAR, AUTO, (AUTO,))
    with pytest.raises(TypeError, match="must be True, False or 'auto', got 'side'"):
        streams.set_enabled("side")  # type: ignore[arg-type]


def test_under_auto_the_stream_in_use_is_the_one_chosen_and_a_new_setting_forgets_it():
    previous = streams.set_enabled(AUTO)
    try:
        assert streams.setting() == AUTO and streams.enabled() is False
        streams.use(True)
        assert streams.enabled() is True and streams.setting() == AUTO
        streams.set_enabled(AUTO)
        assert streams.enabled() is False
        assert streams.set_enabled(False) == AUTO  # (set returns the setting it replaced)
        streams.use(True)
        assert streams.enabled() is False  # (a fixed setting is not overridden by a choice)
        assert streams.set_enabled(True) is False and streams.setting() is True
    finally:
        streams.set_enabled(previous)


def test_side_priority_sets_the_extensions_priority_inside_and_restores_it_after_an_error():
    """The side stream is a default-priority one unless ``side_priority(True)`` says otherwise
    (the bench's comparison); the extension's setting is what the C++ ordering reads."""
    from lightning_cafin.kernels.loader import extension_if_built

    ext = extension_if_built()
    if ext is None:
        pytest.skip("the extension is not built here (CI builds it)")
    assert ext.capture_side_high_priority(False) is False  # the default, untouched by earlier tests
    with pytest.raises(RuntimeError, match="inside"):
        with streams.side_priority(True):
            assert ext.capture_side_high_priority(True) is True
            raise RuntimeError("inside")
    assert ext.capture_side_high_priority(False) is False
