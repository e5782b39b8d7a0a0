"""Saved chat settings (edgerun/user_settings.py): TOML round trips, atomic writes, fallbacks."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from edgerun import settings, user_settings
from edgerun.user_settings import UserSettings, load, save


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    return tmp_path


def write(home, text: str):
    path = home / "config" / "settings.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_are_edgerun_settings():
    s, sampler = UserSettings(), settings.SamplerSettings()
    assert (s.temperature, s.top_p, s.top_k) == (sampler.temperature, sampler.top_p, sampler.top_k)
    assert (s.max_tokens, s.draft, s.system_prompt) == (settings.MAX_TOKENS, settings.DRAFT,
                                                        settings.DEFAULT_SYSTEM_PROMPT)


def test_every_field_has_a_check():
    assert set(user_settings._CHECKS) == {f.name for f in dataclasses.fields(UserSettings)}


def test_no_file_means_defaults_without_warnings(home):
    assert load() == (UserSettings(), [])
    assert user_settings.default_path() == home / "config" / "settings.toml"


def test_round_trip(home):
    mine = UserSettings(temperature=0.0, top_p=1.0, top_k=0, max_tokens=2048,
                        system_prompt='Say "hi"\n\tthen C:\\path, ünïcode ✓, bell \x07, del \x7f',
                        draft="qwen2.5-coder-0.5b", spec_k=4, ngram=True, show_draft_marks=False,
                        last_model="qwen2.5-coder-1.5b")
    path = save(mine)
    assert path == home / "config" / "settings.toml"
    assert load() == (mine, [])
    assert tomllib.loads(path.read_text(encoding="utf-8"))["spec_k"] == 4


def test_none_fields_are_left_out_and_come_back_as_none(home):
    path = save(UserSettings(system_prompt=None, last_model=None))
    text = path.read_text(encoding="utf-8")
    assert "system_prompt" not in text and "last_model" not in text
    assert load() == (UserSettings(), [])


@hsettings(max_examples=150, deadline=None)
@given(prompt=st.text(), temperature=st.floats(0, 5), top_p=st.floats(0, 1, exclude_min=True),
       top_k=st.integers(0, user_settings.TOP_K_MAX), draft=st.text(min_size=1).filter(str.strip))
def test_any_value_round_trips_through_the_writer(prompt, temperature, top_p, top_k, draft):
    mine = UserSettings(temperature=temperature, top_p=top_p, top_k=top_k, system_prompt=prompt, draft=draft)
    assert user_settings.from_dict(tomllib.loads(user_settings.dumps(mine))) == (mine, [])


def test_an_int_temperature_is_a_float(home):
    write(home, "temperature = 1\n")
    s, warnings = load()
    assert s.temperature == 1.0 and isinstance(s.temperature, float) and warnings == []


def test_bad_values_fall_back_with_a_warning_each(home):
    write(home, "\n".join([
        "temperature = -0.5", "top_p = 1.5", "top_k = '40'", "max_tokens = 0", "ngram = 'yes'",
        "spec_k = 'fast'", "show_draft_marks = 1", "draft = ''",
        "system_prompt = 'kept'", "last_model = 'kept-model'",
        "future_option = 3",  # unknown: ignored, no warning
    ]) + "\n")
    s, warnings = load()
    bad = {"temperature", "top_p", "top_k", "max_tokens", "ngram", "spec_k", "show_draft_marks", "draft"}
    assert s == UserSettings(system_prompt="kept", last_model="kept-model")
    assert len(warnings) == len(bad) and all("using the default" in w for w in warnings)
    assert {w.split(": ", 1)[1].split(" = ")[0] for w in warnings} == bad


@pytest.mark.parametrize("text", ["top_p = 0.0", "temperature = nan", "temperature = inf",
                                  "temperature = true", "top_k = 4.0", "spec_k = -1",
                                  "top_k = 2147483648"])  # more than the native sampler's int32
def test_edge_values_are_rejected(home, text):
    write(home, text + "\n")
    s, warnings = load()
    assert s == UserSettings() and len(warnings) == 1


def test_a_broken_file_gives_defaults_and_a_warning(home):
    write(home, "temperature = = 3\n[[[")
    s, warnings = load()
    assert s == UserSettings() and len(warnings) == 1 and "using the defaults" in warnings[0]


def test_invalid_settings_are_not_saved(home):
    with pytest.raises(ValueError, match="top_p"):
        save(UserSettings(top_p=2.0))
    assert not (home / "config" / "settings.toml").exists()


def test_save_leaves_no_temp_file(home):
    save(UserSettings(temperature=0.2))
    save(UserSettings(temperature=0.3))
    assert os.listdir(home / "config") == ["settings.toml"]
    assert math.isclose(load()[0].temperature, 0.3)


def test_a_failed_save_keeps_the_old_file(home, monkeypatch):
    path = save(UserSettings(max_tokens=100))
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(user_settings.os, "replace", crash)
    with pytest.raises(OSError):
        save(UserSettings(max_tokens=200))
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == ["settings.toml"]
