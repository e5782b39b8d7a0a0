"""Conversation history (edgerun/history.py) on real SQLite files under tmp_path."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from edgerun import history
from edgerun.errors import EdgerunError, HistoryError, HistoryUnreadable
from edgerun.history import History, Message
from edgerun.runtime.kvstate import SavedState


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def hist():
    ticks = itertools.count(1000.0)  # a clock that always moves, so ordering never ties
    with History(clock=lambda: next(ticks)) as h:
        yield h


def raw(h: History) -> sqlite3.Connection:
    """A second, independent connection: what another process would see on disk."""
    return sqlite3.connect(h.path)


# ---------------------------------------------------------------- the file

def test_lives_in_the_data_dir_with_wal_and_a_schema_version(home):
    with History() as h:
        assert h.path == home / "data" / "history.sqlite3"
        conn = h._conn
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(history._MIGRATIONS)


def test_reopening_keeps_everything_and_close_checkpoints_the_wal(home):
    with History() as h:
        conv = h.new_conversation("m")
        h.add_message(conv, "user", "hello")
        path = h.path
    # the last connection closing folds the WAL back and removes it: close really closed
    assert not path.with_name(path.name + "-wal").exists()
    with History() as h:
        assert [m.content for m in h.messages(conv)] == ["hello"]


def test_an_empty_file_is_a_new_database(home):
    path = home / "empty.sqlite3"
    path.write_bytes(b"")
    with History(path) as h:
        assert h.list_conversations() == []


def test_garbage_file_is_a_history_error_saying_what_to_do(home):
    path = home / "data" / "history.sqlite3"
    path.parent.mkdir(parents=True)
    path.write_bytes(os.urandom(8192))
    with pytest.raises(HistoryError) as err:
        History()
    assert isinstance(err.value, EdgerunError)
    message = str(err.value)
    assert str(path) in message and "move the file away" in message and "\n" not in message


def test_unopenable_path_is_a_history_error(home):
    (home / "data" / "history.sqlite3").mkdir(parents=True)  # a directory where the file goes
    with pytest.raises(HistoryError, match="move the file away"):
        History()


def test_a_newer_schema_is_refused(home):
    path = home / "data" / "history.sqlite3"
    with History(path):
        pass
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(HistoryError, match="newer edgerun"):
        History(path)


# ---------------------------------------------------------------- messages

def test_a_streamed_reply_round_trips(hist):
    conv = hist.new_conversation("qwen", draft="qwen-0.5b", system="be brief")
    hist.add_message(conv, "user", "What is 2+2?")
    reply = hist.begin_reply(conv)
    assert hist.messages(conv)[-1].status == "streaming"
    for chunk in ["It ", "is ", "4."]:
        hist.append_reply(reply, chunk)
    hist.finish_reply(reply, "done", {"tokens": 3, "tok_s": 41.5, "accepted": [1, 2]})
    user, assistant = hist.messages(conv)
    assert (user.role, user.content, user.status, user.stats) == ("user", "What is 2+2?", "done", None)
    assert assistant == Message(reply, conv, "assistant", "It is 4.", "done",
                                {"tokens": 3, "tok_s": 41.5, "accepted": [1, 2]}, assistant.created)
    with pytest.raises(dataclasses.FrozenInstanceError):
        assistant.content = "changed"


def test_a_finished_reply_takes_no_more_text(hist):
    conv = hist.new_conversation("m")
    reply = hist.begin_reply(conv)
    hist.finish_reply(reply, "stopped")
    with pytest.raises(HistoryError, match="not a streaming reply"):
        hist.append_reply(reply, "late")


def test_statuses_are_checked(hist):
    conv = hist.new_conversation("m")
    reply = hist.begin_reply(conv)
    with pytest.raises(ValueError):
        hist.finish_reply(reply, "streaming")
    with pytest.raises(ValueError):
        hist.add_message(conv, "user", "x", status="bogus")
    with pytest.raises(HistoryError, match="no message"):
        hist.finish_reply(reply + 100, "done")


def test_a_message_for_a_missing_conversation_is_refused(hist):
    with pytest.raises(HistoryError, match="deleted"):
        hist.add_message(12345, "user", "hello")


# ---------------------------------------------------------------- titles

def test_the_first_user_message_names_the_conversation(hist):
    conv = hist.new_conversation("m")
    assert hist.list_conversations()[0].title == history.UNTITLED
    hist.add_message(conv, "system", "ignored for the title")
    hist.add_message(conv, "user", "\n  Explain the speculative round  \nin detail please")
    hist.add_message(conv, "user", "a second question does not rename it")
    assert hist.list_conversations()[0].title == "Explain the speculative round"


def test_a_given_or_renamed_title_is_kept(hist):
    given = hist.new_conversation("m", title="Mine")
    hist.add_message(given, "user", "hello")
    renamed = hist.new_conversation("m")
    hist.rename(renamed, "Renamed")
    hist.add_message(renamed, "user", "hello")
    assert {c.id: c.title for c in hist.list_conversations()} == {given: "Mine", renamed: "Renamed"}
    with pytest.raises(HistoryError):
        hist.rename(999, "nothing there")


def test_title_from_trims_long_lines_at_a_word():
    assert history.title_from("short") == "short"
    assert history.title_from("x" * 60) == "x" * 60
    long = "word " * 30
    title = history.title_from(long)
    assert title.endswith("…") and len(title) <= history.TITLE_CHARS + 1 and "wor…" not in title
    assert history.title_from("y" * 200) == "y" * 60 + "…"  # no space to cut at
    assert history.title_from("  \n \n") == history.UNTITLED


# ---------------------------------------------------------------- listing and deleting

def test_list_is_newest_activity_first_with_counts(hist):
    a = hist.new_conversation("m")
    b = hist.new_conversation("m")
    assert [c.id for c in hist.list_conversations()] == [b, a]
    hist.add_message(a, "user", "one")
    hist.add_message(a, "user", "two")
    assert [(c.id, c.message_count) for c in hist.list_conversations()] == [(a, 2), (b, 0)]
    reply = hist.begin_reply(b)
    hist.append_reply(reply, "text")
    hist.finish_reply(reply, "done")
    assert [(c.id, c.message_count) for c in hist.list_conversations()] == [(b, 1), (a, 2)]


def test_delete_cascades_to_messages(hist):
    keep = hist.new_conversation("m")
    hist.add_message(keep, "user", "stay")
    gone = hist.new_conversation("m")
    hist.add_message(gone, "user", "go")
    hist.begin_reply(gone)
    hist.delete(gone)
    hist.delete(gone)  # again: a no-op
    assert [c.id for c in hist.list_conversations()] == [keep]
    assert hist.messages(gone) == []
    with raw(hist) as conn:
        assert conn.execute("SELECT conversation_id FROM messages").fetchall() == [(keep,)]


# ---------------------------------------------------------------- export

def test_export_markdown_marks_replies_cut_short(hist):
    conv = hist.new_conversation("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", system="Be brief.")
    hist.add_message(conv, "user", "Say hi")
    hist.add_message(conv, "assistant", "Hi!")
    hist.add_message(conv, "user", "Count to three")
    hist.add_message(conv, "assistant", "One, two", status="stopped")
    hist.add_message(conv, "user", "Again")
    reply = hist.begin_reply(conv)
    hist.append_reply(reply, "One")
    hist.finish_reply(reply, "interrupted")
    assert hist.export_markdown(conv) == textwrap.dedent("""\
        # Say hi

        _model: qwen2.5-coder-1.5b, draft: qwen2.5-coder-0.5b_

        ## System

        Be brief.

        ## User

        Say hi

        ## Assistant

        Hi!

        ## User

        Count to three

        ## Assistant

        One, two

        _(stopped)_

        ## User

        Again

        ## Assistant

        One

        _(interrupted: edgerun exited mid-reply)_
        """)
    with pytest.raises(HistoryError):
        hist.export_markdown(conv + 1)


# ---------------------------------------------------------------- crashes

def test_recover_marks_the_replies_of_a_closed_writer_interrupted(home):
    with History() as writer:
        conv = writer.new_conversation("m")
        reply = writer.begin_reply(conv)
        done = writer.begin_reply(conv)
        writer.finish_reply(done, "done")
        with History() as other:
            assert writer.recover() == other.recover() == 0  # its writer is still open
    with History() as h:
        assert h.recover() == 1
        assert [m.status for m in h.messages(conv)] == ["interrupted", "done"]
        assert h.recover() == 0
        with pytest.raises(HistoryError):
            h.append_reply(reply, "too late")
    assert [p.name for p in (home / "data" / "history.sqlite3.writers").iterdir()] == []


CHUNKS = ["The ", "reply ", "so ", "far", ", with ünïcode ✓"]


def test_a_reply_survives_the_process_being_killed_mid_stream(home):
    script = textwrap.dedent(f"""
        import os, signal
        from edgerun.history import History
        h = History()
        conv = h.new_conversation("m")
        h.add_message(conv, "user", "tell me")
        reply = h.begin_reply(conv)
        for chunk in {CHUNKS!r}:
            h.append_reply(reply, chunk)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint, no atexit
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, env=os.environ, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    path = home / "data" / "history.sqlite3"
    assert path.with_name(path.name + "-wal").exists()  # the chunks live only in the WAL
    with History() as h:
        assert h.recover() == 1
        (conv,) = h.list_conversations()
        user, reply = h.messages(conv.id)
        assert (conv.title, user.content) == ("tell me", "tell me")
        assert (reply.status, reply.content) == ("interrupted", "".join(CHUNKS))


# ---------------------------------------------------------------- threads and speed

def test_a_worker_thread_streams_while_the_ui_thread_reads(hist):
    conv = hist.new_conversation("m")
    hist.add_message(conv, "user", "go")
    reading, finished, errors = threading.Event(), threading.Event(), []

    def worker():  # the Textual thread worker: it did not create the History
        try:
            reading.wait(timeout=30)  # start once the UI side reads (on a loaded machine it could finish first)
            reply = hist.begin_reply(conv)
            for i in range(300):
                hist.append_reply(reply, f"{i} ")
            hist.finish_reply(reply, "done", {"n": 300})
        except BaseException as e:
            errors.append(e)
        finally:
            finished.set()

    thread = threading.Thread(target=worker)
    thread.start()
    other, reads = hist.new_conversation("m"), 0
    while not finished.is_set():  # the UI keeps reading, and writing elsewhere, meanwhile
        hist.messages(conv)
        hist.list_conversations()
        hist.add_message(other, "user", "typed meanwhile")  # a transaction of its own
        reads += 1
        reading.set()
    thread.join()
    assert errors == [] and reads > 0
    assert len(hist.messages(other)) == reads
    reply = hist.messages(conv)[-1]
    expected = "".join(f"{i} " for i in range(300))
    assert (reply.content, reply.status, reply.stats) == (expected, "done", {"n": 300})


def _bytes_written() -> int:
    """What this process has passed to write() so far (Linux's /proc/self/io)."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("wchar:")).split()[1])


def test_append_is_cheap(hist):
    """Each append is one UPDATE that commits on its own and rewrites only its row: on a short
    reply one WAL frame (a 4 KB page and its header; 4136 bytes measured). The row rewrite makes
    a chunk cost grow with the reply (about 75 KB written per chunk at 36 KB; on the dev VM ~0.05 ms
    a chunk short, ~1 ms at 64 KB: still far below a token's decode time)."""
    conv = hist.new_conversation("m")
    reply = hist.begin_reply(conv)
    before = _bytes_written()
    for _ in range(1000):
        hist.append_reply(reply, "tok ")
    per_append = (_bytes_written() - before) / 1000
    assert per_append < 2 * 4096, f"{per_append:.0f} bytes written per append"
    assert hist.messages(conv)[0].content == "tok " * 1000


# ---------------------------------------------------------------- two processes, one history

WRITER = textwrap.dedent("""
    import sys
    from edgerun.history import History
    h = History()
    conv = h.new_conversation("m")
    first = h.begin_reply(conv)
    h.append_reply(first, "streamed ")
    print(conv, first, flush=True)
    sys.stdin.readline()  # meanwhile the test's History, a second chat app starting, recovers
    h.append_reply(first, "on")
    h.finish_reply(first, "done")
    second = h.begin_reply(conv)
    h.append_reply(second, "cut")
    print(second, flush=True)
    sys.stdin.readline()  # never answered: the test kills this process here
""")


def test_recover_leaves_a_live_processs_reply_alone_and_takes_it_once_killed(home):
    writer = subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=os.environ)
    try:
        conv, first = map(int, writer.stdout.readline().split())
        with History() as h:
            assert h.recover() == 0
            assert [(m.content, m.status) for m in h.messages(conv)] == [("streamed ", "streaming")]
            writer.stdin.write("go on\n")
            writer.stdin.flush()
            second = int(writer.stdout.readline())  # the writer's later append and finish landed
            assert [(m.id, m.content, m.status) for m in h.messages(conv)] == [
                (first, "streamed on", "done"), (second, "cut", "streaming")]
            assert h.recover() == 0
            writer.kill()  # SIGKILL: no close, the OS drops its lock
            assert writer.wait(timeout=60) == -signal.SIGKILL
            assert h.recover() == 1
            assert [(m.content, m.status) for m in h.messages(conv)][-1] == ("cut", "interrupted")
            locks = home / "data" / "history.sqlite3.writers"
            assert [p.name for p in locks.iterdir()] == [f"{h._writer.token}.lock"]  # the dead one's is gone
    finally:
        writer.kill()
        writer.wait(timeout=60)


def test_an_older_file_gains_the_writer_column_and_its_streaming_reply_is_recovered(home):
    path = home / "data" / "history.sqlite3"
    path.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for statement in history._MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute("PRAGMA user_version = 1")
        conn.execute("INSERT INTO conversations (model, created, updated) VALUES ('m', 0, 0)")
        conn.execute("INSERT INTO messages (conversation_id, role, content, status, created)"
                     " VALUES (1, 'assistant', 'older', 'streaming', 0)")
        conn.commit()
    with History() as h:
        assert h._conn.execute("PRAGMA user_version").fetchone()[0] == len(history._MIGRATIONS) == 3
        assert h.recover() == 1  # no writer recorded: an edgerun from before writers were, long gone
        assert [(m.content, m.status) for m in h.messages(1)] == [("older", "interrupted")]


def test_a_version_2_file_gains_the_kv_states_table_and_keeps_its_conversations(home):
    path = home / "data" / "history.sqlite3"
    path.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for migration in history._MIGRATIONS[:2]:
            for statement in migration:
                conn.execute(statement)
        conn.execute("PRAGMA user_version = 2")
        conn.execute("INSERT INTO conversations (model, created, updated) VALUES ('m', 0, 0)")
        conn.execute("INSERT INTO messages (conversation_id, role, content, status, created)"
                     " VALUES (1, 'user', 'kept', 'done', 0)")
        conn.commit()
    with History() as h:
        assert h._conn.execute("PRAGMA user_version").fetchone()[0] == 3
        assert [m.content for m in h.messages(1)] == ["kept"] and h.kv_states(1) == []
        state = SavedState("target", "k1", "k1-a.kvstate", 300, 9000)
        assert h.record_kv_states(1, [state]) == []
        assert h.kv_states(1) == [state]


def test_a_conversations_states_are_replaced_per_role_and_key(hist):
    conv = hist.new_conversation("m")
    first = [SavedState("target", "k1", "k1-a.kvstate", 100, 1000), SavedState("draft", "k2", "k2-a.kvstate", 100, 500)]
    assert hist.record_kv_states(conv, first) == []
    longer = SavedState("target", "k1", "k1-b.kvstate", 200, 2000)
    assert hist.record_kv_states(conv, [longer]) == ["k1-a.kvstate"]  # replaced, and no one else's
    other_model = SavedState("target", "k3", "k3-a.kvstate", 150, 1500)
    assert hist.record_kv_states(conv, [other_model]) == []  # another key: kept beside
    assert {s.name for s in hist.kv_states(conv)} == {"k1-b.kvstate", "k2-a.kvstate", "k3-a.kvstate"}
    assert hist.kv_states(conv)[0] == other_model  # most recently saved first
    hist.rename(conv, "shopping")
    assert hist.kv_state_owners()["k1-b.kvstate"] == ["shopping"]
    assert hist.forget_kv_states(["k2-a.kvstate"]) == 1
    assert {s.name for s in hist.kv_states(conv)} == {"k1-b.kvstate", "k3-a.kvstate"}
    assert hist.delete(conv) == ["k1-b.kvstate", "k3-a.kvstate"] and hist.kv_state_owners() == {}


def test_a_state_two_conversations_record_is_removed_with_the_last(hist):
    a, b = hist.new_conversation("m"), hist.new_conversation("m")
    shared = SavedState("target", "k", "k-shared.kvstate", 10, 100)
    hist.record_kv_states(a, [shared])
    hist.record_kv_states(b, [shared])
    assert hist.record_kv_states(a, [SavedState("target", "k", "k-longer.kvstate", 20, 200)]) == []  # b still has it
    assert hist.delete(b) == ["k-shared.kvstate"]


# ---------------------------------------------------------------- files that are not a history

def _history_with_messages(path):
    with History(path) as h:
        conv = h.new_conversation("m")
        for i in range(400):
            h.add_message(conv, "user", f"{i:03d} " + "words " * 50)


def _random_bytes(path):
    path.write_bytes(os.urandom(8192))


def _text_file(path):
    path.write_text("milk\neggs\nbread\n" * 500)


def _other_programs_database(path):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE bookmarks (url TEXT, title TEXT)")
        conn.execute("INSERT INTO bookmarks VALUES ('https://example.org', 'example')")
        conn.commit()


def _other_programs_database_with_a_schema_version(path):
    _other_programs_database(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA user_version = 2")


def _other_programs_tables_with_edgeruns_names(path):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE conversations (id INTEGER PRIMARY KEY, topic TEXT)")
        conn.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT)")
        conn.execute(f"PRAGMA user_version = {len(history._MIGRATIONS)}")


def _truncated_history(path):
    _history_with_messages(path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _history_with_a_damaged_page(path):
    _history_with_messages(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    middle = len(data) // page // 2 * page
    data[middle:middle + page] = b"\xff" * page  # no b-tree page starts with 0xff
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("make", [_random_bytes, _text_file, _other_programs_database,
                                  _other_programs_database_with_a_schema_version,
                                  _other_programs_tables_with_edgeruns_names, _truncated_history,
                                  _history_with_a_damaged_page], ids=lambda f: f.__name__.strip("_"))
def test_a_file_that_is_not_a_usable_history_is_refused_in_one_line(home, make):
    path = home / "data" / "history.sqlite3"
    path.parent.mkdir(parents=True)
    make(path)
    before = path.read_bytes()
    with pytest.raises(HistoryUnreadable) as err:
        History()
    message = str(err.value)
    assert str(path) in message and "move the file away" in message and "\n" not in message
    assert path.read_bytes() == before  # refused before anything was written into it


def test_move_aside_keeps_the_old_file_and_a_new_history_starts(home):
    path = home / "data" / "history.sqlite3"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(HistoryUnreadable):
        History()
    path.with_name(path.name + "-wal").write_bytes(b"its wal")  # as a killed edgerun leaves one
    moved = history.move_aside(path, clock=lambda: 0.0)
    assert moved.name.startswith("history.sqlite3.corrupt-") and moved.read_bytes() == b"not a database" * 100
    assert moved.with_name(moved.name + "-wal").read_bytes() == b"its wal"
    assert not path.exists() and not path.with_name(path.name + "-wal").exists()
    with History() as h:
        assert h.list_conversations() == []
    again = history.move_aside(path, clock=lambda: 0.0)  # same second: a name of its own
    assert again != moved and again.exists() and moved.exists()
