"""Shared fixtures: the real models from the catalog (setup.sh pulls them into the user's cache).

A test that takes one of the real-model fixtures is marked `model` here, so `pytest -m "not model"`
runs the fast tier alone."""

from __future__ import annotations

import os

# numpy's OpenBLAS starts a thread per core at import, and they spin a while: 0.1 s of CPU in every
# process that imports numpy, and the suite starts some 150 of them (its pytest-xdist workers, each
# edgerun command, server and quantizer it runs). The tests' arrays are small, so one thread does
# their algebra as fast. Set before the first numpy import; the workers and every process a test
# starts inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import signal  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from edgerun.models import catalog, fetch  # noqa: E402
from edgerun.settings import THREADS_ENV, physical_cores  # noqa: E402

# Hypothesis fails an example that takes over 200 ms by default: a reading of the clock that a
# busy machine (or two pytest-xdist workers on two cores) can fail. The examples are bounded by
# their counts instead.
settings.register_profile("edgerun", deadline=None)
settings.load_profile("edgerun")

# A suite started in the background of a non-interactive shell (`scripts/test.sh > log &`, nohup)
# inherits SIGINT ignored, so Python installs no KeyboardInterrupt handler, and every process a test
# starts inherits the same. The tests of Ctrl-C deliver it as a terminal does: put Python's handler
# back (the processes the tests start then get SIGINT's default action, and so Python's handler too).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# pytest-xdist's workers share the machine's cores: by default each worker's llama.cpp (and every
# edgerun process its tests start) computes on its share. ggml's threads meet at a spinning barrier
# after every operation, so two workers of two threads each on two cores wait whole time slices for
# each other (the chat app's convert test: 9 s alone, 15 s beside one busy process; on one thread
# 10 s beside it). A test that names its threads keeps them; EDGERUN_THREADS set by hand is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault(THREADS_ENV, str(max(1, physical_cores() // _WORKERS)))

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
    # Under pytest-xdist (--dist loadfile) each file goes whole to the next free worker, in this
    # order (pyproject turns off xdist's own, most tests first): the fast tier's files that build
    # something (a `slow` test, seconds each) first, then the rest by size, so that no file of
    # seconds starts last while the other worker has finished.
    fast = [item for item in items if not item.get_closest_marker("model")]
    size = Counter(item.path for item in fast)
    builds = {item.path for item in fast if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in builds, -size[item.path]))


@pytest.fixture(scope="session")
def small_model() -> Path:
    return model_path(DRAFT)


@pytest.fixture(scope="session")
def target_model() -> Path:
    return model_path(TARGET)


@pytest.fixture(scope="session")
def other_vocab_model() -> Path:
    return model_path(OTHER_VOCAB)


TINY_CTX = 4096  # the tiny model's declared context: the CLI's default --ctx fits


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random-weight qwen2 GGUF written once per session the way `edgerun convert` writes
    its F16 (the tiny HF checkpoint, then prepare_f16): 2 layers, hidden size 64, a byte-level BPE
    vocabulary of about 300 tokens holding every byte (so any text round-trips) and ChatML's
    control tokens; about 240 KB. Its output head is its
    own, four times the usual scale: a head tied to random embeddings echoes its input token (a
    greedy reply is one token repeated), and logits of unit scale over 320 tokens are so flat that
    a draft is never confident enough to propose (speculative.DEFAULT_P_MIN). This one gives
    varied replies with some repeats (n-gram drafts find matches) and confident self-drafts."""
    from edgerun.convert.source import prepare_f16
    from testkit.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_model")
    return prepare_f16(str(write_tiny_checkpoint(root / "hf", "qwen2", n_ctx=TINY_CTX, tie=False,
                                             head_scale=4.0)), root / "work")


@pytest.fixture(scope="session", autouse=True)
def own_kv_cache(tmp_path_factory):
    """Saved KV states of every test (and of the edgerun processes tests start) go to a
    directory of the session's, not the user's cache; a test that counts them sets its own."""
    folder = tmp_path_factory.mktemp("kv")
    before = os.environ.get("EDGERUN_KV_DIR")
    os.environ["EDGERUN_KV_DIR"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("EDGERUN_KV_DIR", None)
    else:
        os.environ["EDGERUN_KV_DIR"] = before


@pytest.fixture
def edgerun_home(tmp_path, monkeypatch) -> Path:
    """An EDGERUN_HOME of the test's own (cache, settings, memo), so no test sees another's."""
    home = tmp_path / "home"
    monkeypatch.setenv("EDGERUN_HOME", str(home))
    return home
