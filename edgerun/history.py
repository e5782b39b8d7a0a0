"""Conversations kept in SQLite. A reply is written as it streams, so a crash loses nothing that
was shown; `recover()` on the next start marks such replies 'interrupted'."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from edgerun import paths
from edgerun.errors import HistoryError

STATUSES = ("done", "streaming", "stopped", "interrupted")
FINAL_STATUSES = ("done", "stopped", "interrupted")
UNTITLED = "New conversation"
TITLE_CHARS = 60
_MARKS = {"stopped": "_(stopped)_", "interrupted": "_(interrupted: edgerun exited mid-reply)_",
          "streaming": "_(still streaming)_"}

# Entry i takes the schema from version i to i + 1 (PRAGMA user_version). Append, never edit: an
# older file is upgraded by running, in order, the entries it has not seen.
_MIGRATIONS: tuple[tuple[str, ...], ...] = ((
    ("CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT, model TEXT NOT NULL,"
     " draft TEXT, system TEXT, created REAL NOT NULL, updated REAL NOT NULL)"),
    ("CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL"
     " REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL,"
     " status TEXT NOT NULL CHECK (status IN ('done', 'streaming', 'stopped', 'interrupted')),"
     " stats TEXT, created REAL NOT NULL)"),
    # the cascade, the counts and the per-conversation reads all find messages by conversation
    "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
),)


@dataclass(frozen=True)
class ConversationInfo:
    id: int
    title: str
    model: str
    draft: str | None
    system: str | None
    created: float
    updated: float
    message_count: int


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    status: str
    stats: dict | None
    created: float


def default_path() -> Path:
    return paths.data_dir() / "history.sqlite3"


def title_from(text: str) -> str:
    """The first non-empty line, cut at a word boundary near TITLE_CHARS."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    if len(line) <= TITLE_CHARS:
        return line or UNTITLED
    return (line[:TITLE_CHARS].rsplit(" ", 1)[0] or line[:TITLE_CHARS]).rstrip() + "…"


def _explain(path: Path, e: sqlite3.DatabaseError) -> HistoryError:
    text = str(e)
    if isinstance(e, sqlite3.IntegrityError):
        return HistoryError(f"history refused a write ({text}); was the conversation deleted?")
    if "locked" in text or "busy" in text:
        return HistoryError(f"{path} is locked by another edgerun; close it and try again")
    if "full" in text:
        return HistoryError(f"cannot write {path}: the disk is full; free some space and retry")
    return HistoryError(f"cannot use the history database {path} ({text}); "
                        "move the file away and edgerun will start a new one")


@contextlib.contextmanager
def _translated(path: Path) -> Iterator[None]:
    try:
        yield
    except (sqlite3.ProgrammingError, sqlite3.InterfaceError):
        raise  # misuse (e.g. a closed History) is our bug, not the file's
    except sqlite3.DatabaseError as e:
        raise _explain(path, e) from e


class History:
    """One connection to the history file. Any thread may call it, one call at a time under a
    lock, so a Textual worker can stream into it while the UI thread reads."""

    def __init__(self, path: Path | None = None, clock: Callable[[], float] = time.time):
        self.path = Path(path) if path is not None else default_path()
        self._clock = clock
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HistoryError(f"cannot create {self.path.parent} ({e}); check its permissions") from e
        with _translated(self.path):
            # autocommit: a lone UPDATE commits by itself; multi-statement writes go through _tx
            self._conn = sqlite3.connect(self.path, timeout=5.0, isolation_level=None,
                                         check_same_thread=False)
        try:
            self._setup()
        except BaseException:
            self._conn.close()
            raise

    def _setup(self) -> None:
        with self._locked() as c:
            # WAL + synchronous=NORMAL: a commit appends to the WAL without fsync, so a streamed
            # chunk costs microseconds and survives the process dying (power loss may drop the
            # last commits). This is also the first read, where a garbage file fails.
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")
            c.execute("PRAGMA foreign_keys=ON")
            version = c.execute("PRAGMA user_version").fetchone()[0]
        if version > len(_MIGRATIONS):
            raise HistoryError(f"{self.path} was written by a newer edgerun (schema {version});"
                               " upgrade edgerun or move the file away")
        while version < len(_MIGRATIONS):
            with self._tx() as c:
                # re-read under the write lock: another process may have migrated meanwhile
                version = c.execute("PRAGMA user_version").fetchone()[0]
                if version < len(_MIGRATIONS):
                    for statement in _MIGRATIONS[version]:
                        c.execute(statement)
                    version += 1
                    c.execute(f"PRAGMA user_version = {version}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        with self._lock, _translated(self.path):
            yield self._conn

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction. IMMEDIATE takes the write lock up front, so two edgeruns never
        deadlock trying to upgrade read locks."""
        with self._locked() as c:
            c.execute("BEGIN IMMEDIATE")
            try:
                yield c
                c.execute("COMMIT")
            except BaseException:
                c.rollback()
                raise

    def new_conversation(self, model: str, draft: str | None = None, system: str | None = None,
                         title: str | None = None) -> int:
        """Without a title, the first user message names it."""
        now = self._clock()
        with self._tx() as c:
            return c.execute("INSERT INTO conversations (title, model, draft, system, created, updated)"
                             " VALUES (?, ?, ?, ?, ?, ?)", (title, model, draft, system, now, now)).lastrowid

    def list_conversations(self) -> list[ConversationInfo]:
        """Most recently active first, each with its message count."""
        return self._conversations("", ())

    def _conversations(self, where: str, args: tuple) -> list[ConversationInfo]:
        with self._locked() as c:
            rows = c.execute(
                "SELECT c.id, coalesce(c.title, ?), c.model, c.draft, c.system, c.created, c.updated,"
                " count(m.id) FROM conversations c LEFT JOIN messages m ON m.conversation_id = c.id"
                f" {where} GROUP BY c.id ORDER BY c.updated DESC, c.id DESC", (UNTITLED, *args))
            return [ConversationInfo(*row) for row in rows]

    def messages(self, conv_id: int) -> list[Message]:
        with self._locked() as c:
            rows = c.execute("SELECT id, conversation_id, role, content, status, stats, created FROM"
                             " messages WHERE conversation_id = ? ORDER BY id", (conv_id,)).fetchall()
        return [Message(*row[:5], json.loads(row[5]) if row[5] else None, row[6]) for row in rows]

    def add_message(self, conv_id: int, role: str, content: str, status: str = "done",
                    stats: dict | None = None) -> int:
        _check_status(status)
        now = self._clock()
        with self._tx() as c:
            msg_id = c.execute("INSERT INTO messages (conversation_id, role, content, status, stats,"
                               " created) VALUES (?, ?, ?, ?, ?, ?)",
                               (conv_id, role, content, status, _json(stats), now)).lastrowid
            c.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))
            if role == "user":  # `title IS NULL`: only the first one names it, never over a rename
                c.execute("UPDATE conversations SET title = ? WHERE id = ? AND title IS NULL",
                          (title_from(content), conv_id))
        return msg_id

    def begin_reply(self, conv_id: int) -> int:
        """An empty assistant message, status 'streaming', for append_reply to grow."""
        return self.add_message(conv_id, "assistant", "", status="streaming")

    def append_reply(self, msg_id: int, text: str) -> None:
        """Called per streamed chunk: one UPDATE that commits on its own. SQLite rewrites the
        row, so the cost grows with the reply (~0.05 ms per chunk short, ~1 ms at 64 KB)."""
        with self._locked() as c:
            cur = c.execute("UPDATE messages SET content = content || ? WHERE id = ?"
                            " AND status = 'streaming'", (text, msg_id))
        if cur.rowcount != 1:
            raise HistoryError(f"message {msg_id} is not a streaming reply (finished or deleted)")

    def finish_reply(self, msg_id: int, status: str, stats: dict | None = None) -> None:
        _check_status(status, final=True)
        with self._tx() as c:
            if c.execute("UPDATE messages SET status = ?, stats = ? WHERE id = ?",
                         (status, _json(stats), msg_id)).rowcount != 1:
                raise HistoryError(f"no message {msg_id} in history (was it deleted?)")
            c.execute("UPDATE conversations SET updated = ? WHERE id = (SELECT conversation_id"
                      " FROM messages WHERE id = ?)", (self._clock(), msg_id))

    def rename(self, conv_id: int, title: str) -> None:
        with self._tx() as c:
            if c.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conv_id)).rowcount != 1:
                raise HistoryError(f"no conversation {conv_id} in history (was it deleted?)")

    def delete(self, conv_id: int) -> None:
        """Its messages go with it (ON DELETE CASCADE); a missing id is a no-op."""
        with self._tx() as c:
            c.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))

    def recover(self) -> int:
        """Mark replies a dead process left 'streaming' as 'interrupted'; returns how many. Call
        at startup, before this process streams (another live edgerun's reply would be hit too)."""
        with self._tx() as c:
            return c.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming'").rowcount

    def export_markdown(self, conv_id: int) -> str:
        found = self._conversations("WHERE c.id = ?", (conv_id,))
        if not found:
            raise HistoryError(f"no conversation {conv_id} in history (was it deleted?)")
        info = found[0]
        draft = f", draft: {info.draft}" if info.draft else ""
        parts = [f"# {info.title}", f"_model: {info.model}{draft}_"]
        if info.system:
            parts += ["## System", info.system]
        for m in self.messages(conv_id):
            parts += [f"## {m.role.capitalize()}", m.content]
            if m.status in _MARKS:  # a reply cut short must not read as a complete answer
                parts.append(_MARKS[m.status])
        return "\n\n".join(parts) + "\n"


def _check_status(status: str, final: bool = False) -> None:
    allowed = FINAL_STATUSES if final else STATUSES
    if status not in allowed:
        raise ValueError(f"status must be one of {allowed}, not {status!r}")


def _json(stats: dict | None) -> str | None:
    return json.dumps(stats) if stats is not None else None
