"""Saved KV states (runtime/kvstate.py, resume.py, Context.state_bytes/restore_state): real files,
real llama.cpp contexts on the tiny model (conftest's tiny_model), a real child process killed
mid-write. The reply after a restore must equal, token for token, the reply after a full prefill;
every bad state must be caught, said in one line, and leave the reply as a prefill makes it."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from edgerun.chat import ChatSession
from edgerun.decode.generate import Prefill, Step
from edgerun.errors import EngineError
from edgerun.history import History
from edgerun.resume import StateCache
from edgerun.runner import Runner
from edgerun.runtime import kvstate
from edgerun.runtime.kvstate import KvStore, StateKey, StateUnusable
from edgerun.settings import EngineSettings, SamplerSettings
from testkit.cli import run_cli

GREEDY = SamplerSettings(temperature=0.0)
ENGINE = EngineSettings(n_ctx=1024, n_batch=64, n_threads=1, gpu_layers="0")
MIN_TOKENS = 8
KEY = StateKey(model="file:1:2:ab", n_ctx=1024, n_seq=1, gpu_layers=0, kv_type="f16", llama="0.3.36/1/2")
OPENING = "Here is a file to discuss:\n" + "".join(f"line {i}: value = {i * 7 % 13}\n" for i in range(20))
FOLLOW_UP = "And what does line 3 say?"
N = 24  # tokens per reply


@pytest.fixture
def store(tmp_path) -> KvStore:
    return KvStore(tmp_path / "kv", max_bytes=1 << 30)


@pytest.fixture
def hist(tmp_path):
    with History(tmp_path / "history.sqlite3") as h:
        yield h


def _runner(model, engine=ENGINE, **spec) -> Runner:
    return Runner(model, engine, spec_k=4 if spec else None, **spec)


def _session(runner, hist, store, conv=None) -> ChatSession:
    states = StateCache(runner, store, min_tokens=MIN_TOKENS) if store is not None else None
    return ChatSession(runner, hist, model_name="tiny", conversation_id=conv, states=states)


def _reply(session, text) -> tuple[list[int], Prefill]:
    records = list(session.reply(text, GREEDY, max_tokens=N, cancel=None))
    return [r.token for r in records if isinstance(r, Step)], next(r for r in records if isinstance(r, Prefill))


def _first_turn(model, hist, store, **spec) -> int:
    """A conversation of one exchange, its state saved; returns its id."""
    with _runner(model, **spec) as r:
        session = _session(r, hist, store)
        _reply(session, OPENING)
        return session.conversation_id


def _prefilled_answer(model, hist, conv, **spec) -> list[int]:
    """The follow-up's reply with no cache: the whole conversation evaluated. The follow-up is
    then taken back out of the history, so the conversation is as it was."""
    with _runner(model, **spec) as r:
        session = _session(r, hist, None, conv)
        tokens, prefill = _reply(session, FOLLOW_UP)
        assert prefill.evaluated == prefill.prompt_tokens
    with hist._tx() as c:  # the two messages this added
        c.execute("DELETE FROM messages WHERE id IN (SELECT id FROM messages WHERE conversation_id = ?"
                  " ORDER BY id DESC LIMIT 2)", (conv,))
    return tokens


# ----- the store alone ----------------------------------------------------------------------------


def test_a_state_round_trips_and_is_named_by_its_key_and_tokens(store):
    payload = bytearray(os.urandom(5000))
    info = store.save(KEY, [1, 2, 3], payload, label="m.gguf")
    assert info.path.name == kvstate.file_name(KEY, [1, 2, 3]) and info.path.name.startswith(KEY.digest())
    read, data = store.read(info.path, KEY)
    assert data == payload and read.tokens == (1, 2, 3) and read.label == "m.gguf" and read.key == KEY
    assert [e.name for e in store.entries()] == [info.name]
    assert not [p for p in store.root.iterdir() if p.name.startswith(".")]  # no temporary left


@pytest.mark.parametrize("change, words", [
    ({"model": "sha256:" + "0" * 64}, "another model file"),
    ({"n_ctx": 2048}, "another context size (1024 x 1, now 2048 x 1)"),
    ({"llama": "0.3.37/1/2"}, "another llama.cpp build"),
    ({"gpu_layers": 29}, "with 0 GPU layers, now 29"),
    ({"kv_type": "q8_0"}, "KV type is f16"),
])
def test_a_state_for_another_key_is_refused_naming_what_differs(store, change, words):
    info = store.save(KEY, [1, 2], bytearray(100), label="m")
    with pytest.raises(StateUnusable) as err:
        store.read(info.path, StateKey(**{**KEY.__dict__, **change}))
    assert words in str(err.value) and not err.value.broken
    assert store.best_prefix(StateKey(**{**KEY.__dict__, **change}), [1, 2]) is None


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _grown(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


def _cut_in_its_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


def _not_a_state(path: Path) -> None:
    path.write_bytes(b"GGUF" + os.urandom(4000))


@pytest.mark.parametrize("damage, words", [(_truncated, "truncated"), (_flipped, "checksum mismatch"),
                                           (_grown, "bytes past its end"), (_cut_in_its_header, "truncated"),
                                           (_not_a_state, "not an edgerun KV state")],
                         ids=lambda v: getattr(v, "__name__", "").strip("_"))
def test_a_damaged_file_is_refused_as_broken(store, damage, words):
    info = store.save(KEY, list(range(50)), bytearray(os.urandom(20000)), label="m")
    damage(info.path)
    with pytest.raises(StateUnusable) as err:
        store.read(info.path, KEY)
    assert words in str(err.value) and err.value.broken and "\n" not in str(err.value)


def test_best_prefix_picks_the_longest_shared_prefix(store):
    store.save(KEY, [1, 2, 3, 4], bytearray(10), label="m")
    longer = store.save(KEY, [1, 2, 3, 9, 9, 9], bytearray(10), label="m")
    store.save(KEY, [7, 7], bytearray(10), label="m")
    info, shared = store.best_prefix(KEY, [1, 2, 3, 9, 9, 5])
    assert info.path == longer.path and shared == 5
    assert store.best_prefix(KEY, [5]) is None


def test_eviction_takes_the_least_recently_used_first_and_keeps_a_touched_one(tmp_path):
    clock = itertools.count(1_000_000.0, 10.0)
    store = KvStore(tmp_path / "kv", max_bytes=3 * 11_000, clock=lambda: next(clock))
    saved = []
    for i in range(3):
        saved.append(store.save(KEY, [i], bytearray(10_000), label="m"))
        store.touch(saved[-1].path)  # mtimes from the test's clock: no two alike
    store.touch(saved[0].path)  # used again: now the most recent
    fourth = store.save(KEY, [3], bytearray(10_000), label="m")
    left = {e.path for e in store.entries()}
    assert left == {saved[0].path, saved[2].path, fourth.path}
    assert store.total_bytes() <= store.max_bytes


def test_a_state_larger_than_the_cap_is_not_kept(tmp_path):
    store = KvStore(tmp_path / "kv", max_bytes=5000)
    store.save(KEY, [1], bytearray(10_000), label="m")
    assert store.entries() == [] and store.total_bytes() == 0


@settings(max_examples=30)
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=10), cap=st.integers(0, 100_000))
@example(sizes=[10], cap=238)  # a payload of two digits makes the header a byte longer than one of one
def test_eviction_keeps_the_directory_under_the_cap(tmp_path_factory, sizes, cap):
    store = KvStore(tmp_path_factory.mktemp("kv"), max_bytes=cap)
    uncapped = KvStore(tmp_path_factory.mktemp("kv"), max_bytes=1 << 30)
    for i, size in enumerate(sizes):
        whole = uncapped.save(KEY, [i], bytearray(size), label="m").size  # the header spells the size out
        info = store.save(KEY, [i], bytearray(size), label="m")
        assert store.total_bytes() <= cap
        assert (info is not None) == (whole <= cap)  # the newest is kept whenever it fits


def test_clear_removes_every_state_and_what_killed_writers_left(store):
    store.save(KEY, [1], bytearray(10), label="m")
    (store.root / "junk.kvstate").write_bytes(b"not a state")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    tmp = store.root / f".{kvstate.file_name(KEY, [2])}.{dead.stdout.strip()}.0123abcd.part"
    tmp.write_bytes(b"half a state")
    assert store.clear() == 2
    store.evict()
    assert list(store.root.iterdir()) == []


# ----- a killed writer ----------------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from edgerun.runtime.kvstate import KvStore, StateKey
    key = StateKey(**eval(sys.argv[2]))
    store = KvStore(Path(sys.argv[1]), max_bytes=1 << 40)
    store.save(key, list(range(100)), bytearray(256 << 20), label="big")  # killed in here
""")


def test_a_writer_killed_mid_write_leaves_the_previous_state_whole(tmp_path):
    store = KvStore(tmp_path / "kv", max_bytes=1 << 40)
    previous = store.save(KEY, [1, 2, 3], bytearray(os.urandom(4096)), label="m")
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(store.root), repr(KEY.__dict__)])
    deadline = time.monotonic() + 120
    try:
        while not [p for p in store.root.glob(".*.part") if p.stat().st_size > 0]:
            assert child.poll() is None, "the writer finished before it could be killed"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert [e.name for e in store.entries()] == [previous.name]  # the new one never appeared
    info, _ = store.read(previous.path, KEY)
    assert info.tokens == (1, 2, 3)
    store.evict()  # the next save's sweep: the dead writer's temporary goes
    assert sorted(p.name for p in store.root.iterdir()) == [previous.path.name]


# ----- Context: llama.cpp's own state ---------------------------------------------------------------


def test_a_context_restores_what_another_context_held(tiny_model):
    with _runner(tiny_model) as a, _runner(tiny_model) as b:
        tokens = a.chat_tokens([{"role": "user", "content": OPENING}])
        a.ctx.eval(tokens)
        data = a.ctx.state_bytes()
        b.ctx.restore_state(bytearray(data), tokens)
        assert b.ctx.held() == tokens
        # the next token's logits agree: the restored cache is the evaluated one
        a.ctx.eval([tokens[-1]])
        b.ctx.eval([tokens[-1]])
        assert (a.ctx.logits() == b.ctx.logits()).all()


def test_llama_cpp_refuses_a_payload_cut_short_and_the_sequence_is_left_empty(tiny_model):
    with _runner(tiny_model) as r:
        tokens = r.chat_tokens([{"role": "user", "content": OPENING}])
        r.ctx.eval(tokens)
        data = r.ctx.state_bytes()
        with pytest.raises(EngineError, match="does not fit this context"):
            r.ctx.restore_state(bytearray(data[: len(data) // 2]), tokens)
        assert r.ctx.held() == []
        with pytest.raises(EngineError, match="positions 0..4"):
            r.ctx.restore_state(bytearray(data), tokens[:5])  # the payload holds more than recorded
        assert r.ctx.held() == []


# ----- resuming a conversation --------------------------------------------------------------------


@pytest.mark.parametrize("spec", [{}, {"ngram": True}, {"draft": "self"}], ids=["plain", "ngram", "draft"])
def test_the_reply_after_a_restore_equals_the_reply_after_a_full_prefill(tiny_model, hist, store, spec):
    spec = {"draft": str(tiny_model)} if spec.get("draft") == "self" else spec
    conv = _first_turn(tiny_model, hist, store, **spec)
    saved = hist.kv_states(conv)
    assert {s.role for s in saved} == ({"target", "draft"} if "draft" in spec else {"target"})
    expected = _prefilled_answer(tiny_model, hist, conv, **spec)
    with _runner(tiny_model, **spec) as r:
        session = _session(r, hist, store, conv)
        tokens, prefill = _reply(session, FOLLOW_UP)
    assert tokens == expected
    target = next(s for s in saved if s.role == "target")
    assert session.resumed.tokens > 0 and session.resumed.note is None
    assert session.resumed.tokens <= target.n_tokens
    assert prefill.evaluated == prefill.prompt_tokens - session.resumed.tokens
    assert session.resumed.draft_tokens == (session.resumed.tokens if "draft" in spec else 0)  # the same prefix
    # the longer conversation's state replaced the first one's
    now = hist.kv_states(conv)
    assert len(now) == len(saved) and all(n.n_tokens > s.n_tokens for n, s in zip(now, saved))
    assert sorted(e.path.name for e in store.entries()) == sorted(n.name for n in now)


def test_a_conversation_going_on_in_memory_reads_no_state(tiny_model, hist, store):
    with _runner(tiny_model) as r:
        session = _session(r, hist, store)
        _reply(session, OPENING)
        _reply(session, FOLLOW_UP)
        assert session.resumed.tokens == 0 and session.resumed.note is None


def _other_model(tmp_path) -> Path:
    from edgerun.convert.source import prepare_f16
    from testkit.tiny import write_tiny_checkpoint

    hf = write_tiny_checkpoint(tmp_path / "other-hf", "qwen2", seed=1, n_ctx=4096, tie=False, head_scale=4.0)
    return prepare_f16(str(hf), tmp_path / "other-work")


def _replace_with(saved_path: Path, make_state) -> None:
    """Put another state's bytes under the name the history records."""
    other = make_state()
    shutil.copyfile(other, saved_path)


@pytest.mark.parametrize("bad", ["truncated", "flipped", "other_model", "other_ctx", "missing"])
def test_a_bad_state_is_caught_said_in_one_line_and_the_reply_is_a_prefills(tiny_model, hist, store, tmp_path, bad):
    conv = _first_turn(tiny_model, hist, store)
    (saved,) = hist.kv_states(conv)
    path = store.path(saved.name)
    if bad == "truncated":
        _truncated(path)
    elif bad == "flipped":
        _flipped(path)
    elif bad == "missing":
        path.unlink()
    else:  # the same conversation saved by another model, or with another context size
        other_store = KvStore(tmp_path / "other-kv", max_bytes=1 << 30)
        model = _other_model(tmp_path) if bad == "other_model" else tiny_model
        engine = ENGINE.replace(n_ctx=2048) if bad == "other_ctx" else ENGINE
        with Runner(model, engine) as r, History(tmp_path / "other.sqlite3") as h2:
            session = ChatSession(r, h2, model_name="x", states=StateCache(r, other_store, min_tokens=MIN_TOKENS))
            list(session.reply(OPENING, GREEDY, max_tokens=N, cancel=None))
            (theirs,) = h2.kv_states(session.conversation_id)
        shutil.copyfile(other_store.path(theirs.name), path)
    expected = _prefilled_answer(tiny_model, hist, conv)
    with _runner(tiny_model) as r:
        session = _session(r, hist, store, conv)
        tokens, prefill = _reply(session, FOLLOW_UP)
    words = {"truncated": "truncated", "flipped": "checksum mismatch", "missing": "gone from the KV cache",
             "other_model": "another model file", "other_ctx": "another context size (2048 x 1, now 1024 x 1)"}[bad]
    note = session.resumed.note
    assert note and words in note and "evaluating the prompt" in note and "\n" not in note, note
    assert session.resumed.tokens == 0 and prefill.evaluated == prefill.prompt_tokens
    assert tokens == expected
    if bad in ("truncated", "flipped"):
        assert not path.exists()  # a broken file is removed, not tried again
    (now,) = hist.kv_states(conv)  # the reply saved a good state in its place
    store.read(store.path(now.name), StateCache(r, store, min_tokens=1).key("target"))


# ----- edgerun run: a long fixed prompt -----------------------------------------------------------

SYSTEM = "You review code. " * 20


def test_run_with_the_same_long_system_prompt_restores_it(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDGERUN_KV_DIR", str(tmp_path / "kv"))
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    argv = ["run", "-m", tiny_model, "--threads", "1", "--temp", "0", "-n", "12", "--ctx", "1024", "--system", SYSTEM]
    first = run_cli(capsys, *argv, "question one", "--stats-json", tmp_path / "1.json")
    again = run_cli(capsys, *argv, "question two", "--stats-json", tmp_path / "2.json")
    fresh = run_cli(capsys, *argv, "question two", "--no-kv-cache")
    assert first.returncode == again.returncode == fresh.returncode == 0
    import json

    one, two = (json.loads((tmp_path / f"{i}.json").read_text()) for i in (1, 2))
    assert one["resumed"]["tokens"] == 0 and one["prompt_evaluated"] == one["prompt_tokens"]
    assert two["resumed"]["tokens"] > 100 and two["prompt_evaluated"] == two["prompt_tokens"] - two["resumed"]["tokens"]
    assert f"resumed {two['resumed']['tokens']:,} tokens from cache in" in again.stderr
    assert again.stdout == fresh.stdout  # the same reply as evaluating the whole prompt
    assert len(KvStore(max_bytes=1 << 30).entries()) == 1  # the second run added nothing: it was mostly restored


def test_edgerun_cache_lists_removes_and_clears(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDGERUN_KV_DIR", str(tmp_path / "kv"))
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    base = ["run", "-m", tiny_model, "--threads", "1", "--temp", "0", "-n", "4", "--ctx", "1024"]
    for system in ("A " * 200, "B " * 200):
        assert run_cli(capsys, *base, "--system", system, "hi").returncode == 0
    listed = run_cli(capsys, "cache")
    names = [line.split()[0] for line in listed.stdout.splitlines()[1:-1]]
    assert listed.returncode == 0 and len(names) == 2 and "2 saved KV state(s)" in listed.stdout
    assert tiny_model.name in listed.stdout
    assert run_cli(capsys, "cache", "rm", names[0]).returncode == 0
    gone = run_cli(capsys, "cache", "rm", names[0])
    assert gone.returncode == 2 and "no saved state named" in gone.stderr and "\n" not in gone.stderr.strip()
    cleared = run_cli(capsys, "cache", "clear")
    assert cleared.returncode == 0 and "removed 1" in cleared.stderr
    assert "0 saved KV state(s)" in run_cli(capsys, "cache").stdout


# ----- the real models ----------------------------------------------------------------------------

REAL = EngineSettings(n_ctx=2048, gpu_layers="0")
REAL_OPENING = ("Here is a function I wrote:\n\n```python\ndef merge(a, b):\n    out = []\n    i = j = 0\n"
                "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
                "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n"
                "    return out + a[i:] + b[j:]\n```\n\nExplain what it does in two sentences.")
REAL_FOLLOW_UP = "Now write a short docstring for it."


@pytest.mark.parametrize("case", ["0.5b", "0.5b-ngram", "1.5b", "1.5b-ngram", "1.5b-draft"])
def test_real_models_reply_after_a_restore_as_after_a_full_prefill(case, small_model, target_model, tmp_path):
    model = small_model if case.startswith("0.5b") else target_model
    spec = {"ngram": {"ngram": True}, "draft": {"draft": str(small_model)}}.get(case.partition("-")[2], {})
    store = KvStore(tmp_path / "kv", max_bytes=1 << 34)

    def answer(history, conv, states_store, text, n=32):
        with Runner(model, REAL, spec_k=4 if spec else None, **spec) as r:
            session = ChatSession(r, history, model_name=case, conversation_id=conv,
                                  states=StateCache(r, states_store, min_tokens=MIN_TOKENS) if states_store else None)
            records = list(session.reply(text, GREEDY, max_tokens=n, cancel=None))
            return session, [x.token for x in records if isinstance(x, Step)], next(x for x in records if isinstance(x, Prefill))

    with History(tmp_path / "h.sqlite3") as h:
        first, _, _ = answer(h, None, store, REAL_OPENING)
        conv = first.conversation_id
        roles = {s.role for s in h.kv_states(conv)}
        assert roles == ({"target", "draft"} if "draft" in spec else {"target"})
        expected_conv = h.messages(conv)
    with History(tmp_path / "fresh.sqlite3") as fresh:  # the same conversation, no cache: a full prefill
        other = fresh.new_conversation(case)
        for m in expected_conv:
            fresh.add_message(other, m.role, m.content)
        _, expected, full = answer(fresh, other, None, REAL_FOLLOW_UP)
        assert full.evaluated == full.prompt_tokens
    with History(tmp_path / "h.sqlite3") as h:
        session, tokens, prefill = answer(h, conv, store, REAL_FOLLOW_UP)
    assert session.resumed.note is None and session.resumed.tokens > 100
    assert prefill.evaluated == prefill.prompt_tokens - session.resumed.tokens
    assert tokens == expected
