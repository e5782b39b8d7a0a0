"""Shared fixtures: the real models from the catalog (setup.sh pulls them into the user's cache).

A test that takes one of the real-model fixtures is marked `model` here, so `pytest -m "not model"`
runs the fast tier alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgerun.models import catalog, fetch

DRAFT = "qwen2.5-coder-0.5b"
TARGET = "qwen2.5-coder-1.5b"
OTHER_VOCAB = "gemma-3-270m"


def model_path(name: str) -> Path:
    """The verified local file of a catalog model, pulled from its sources if missing."""
    return fetch.pull(catalog.load().get(name))


REAL_MODEL_FIXTURES = frozenset({"small_model", "target_model", "other_vocab_model"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def small_model() -> Path:
    return model_path(DRAFT)


@pytest.fixture(scope="session")
def target_model() -> Path:
    return model_path(TARGET)


@pytest.fixture(scope="session")
def other_vocab_model() -> Path:
    return model_path(OTHER_VOCAB)


@pytest.fixture
def edgerun_home(tmp_path, monkeypatch) -> Path:
    """An EDGERUN_HOME of the test's own (cache, settings, memo), so no test sees another's."""
    home = tmp_path / "home"
    monkeypatch.setenv("EDGERUN_HOME", str(home))
    return home
