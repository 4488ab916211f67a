"""``capture/streams.py``'s process settings as the environment gives them: an on/off switch
(``EnvSwitch``, also the C++ taps' ``taps.py``) and the capture stream's setting, which also
takes ``auto``; read when first needed, a bad value refused naming the variable."""

from __future__ import annotations

import pytest

from lightning_cafin.capture import streams
from lightning_cafin.capture.streams import EnvSwitch

VAR = "LIGHTNING_CAFIN_TEST_SWITCH"


@pytest.mark.parametrize("raw, value", [("", True), ("0", False), ("Off", False), ("yes", True), (" 1 ", True)])
def test_an_on_off_switch_reads_its_variable_when_first_asked(monkeypatch, raw, value):
    switch = EnvSwitch(VAR, default=True)
    monkeypatch.setenv(VAR, raw)
    assert switch.get() is value
    monkeypatch.setenv(VAR, "0" if value else "1")  # (read once: later changes of the variable are not seen)
    assert switch.get() is value
    assert switch.set("anything") is value and switch.get() is True  # (set: any value as a bool)


def test_an_on_off_switch_refuses_a_named_choice_it_does_not_take(monkeypatch):
    monkeypatch.setenv(VAR, "auto")
    with pytest.raises(ValueError, match=f"the environment variable {VAR} must be one of 1, .*, off, got 'auto'"):
        EnvSwitch(VAR).get()


@pytest.mark.parametrize("raw, value", [("", "auto"), ("AUTO", "auto"), ("1", True), ("false", False)])
def test_the_stream_setting_takes_auto_from_the_environment_and_is_auto_without_it(monkeypatch, raw, value):
    monkeypatch.setenv(streams.ENV_VAR, raw)
    setting = streams._StreamSetting()
    assert setting.get() == value and type(setting.get()) is type(value)
    assert setting.set(True) == value and setting.get() is True
    assert setting.set("auto") is True and setting.get() == "auto"


def test_the_stream_setting_refuses_other_values_naming_the_variable_or_the_setting(monkeypatch):
    monkeypatch.setenv(streams.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=f"{streams.ENV_VAR} must be one of .*off, auto, got 'sometimes'"):
        streams._StreamSetting().get()
    monkeypatch.delenv(streams.ENV_VAR)
    with pytest.raises(TypeError, match="must be True, False or 'auto', got 'side'"):
        streams._StreamSetting().set("side")


def test_under_auto_the_stream_in_use_is_the_one_chosen_and_a_new_setting_forgets_it(monkeypatch):
    monkeypatch.delenv(streams.ENV_VAR, raising=False)
    setting = streams._StreamSetting()
    assert setting.in_use() is False
    setting.use(True)
    assert setting.in_use() is True and setting.get() == "auto"
    setting.set("auto")
    assert setting.in_use() is False
    setting.set(False)
    setting.use(True)
    assert setting.in_use() is False  # (a fixed setting is not overridden by a choice)
