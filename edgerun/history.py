"""Conversations kept in SQLite. A reply is written as it streams, so a crash loses nothing that
was shown; `recover()` on the next start marks such replies 'interrupted', and only those whose
writer is gone: two chat apps may share one history."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from edgerun import paths
from edgerun.errors import HistoryError, HistoryUnreadable
from edgerun.runtime.kvstate import SavedState

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
), (
    # which History streams a reply (its _WriterLock token): recover() takes only replies whose
    # writer is gone. NULL (rows from before this column) counts as gone.
    "ALTER TABLE messages ADD COLUMN writer TEXT",
), (
    # the saved KV state files of a conversation (edgerun/runtime/kvstate.py), one per context role
    # and state key (a conversation continued with another model keeps the first model's too)
    ("CREATE TABLE kv_states (conversation_id INTEGER NOT NULL REFERENCES conversations(id)"
     " ON DELETE CASCADE, role TEXT NOT NULL, key TEXT NOT NULL, file TEXT NOT NULL,"
     " n_tokens INTEGER NOT NULL, bytes INTEGER NOT NULL, updated REAL NOT NULL,"
     " PRIMARY KEY (conversation_id, role, key))"),
    "CREATE INDEX kv_states_by_file ON kv_states(file)",
),)
_FIRST_TABLES = {"conversations", "messages"}  # what any version's file has
# What the code reads; a file at the current version without these is not an edgerun history.
_COLUMNS = {"conversations": {"id", "title", "model", "draft", "system", "created", "updated"},
            "messages": {"id", "conversation_id", "role", "content", "status", "stats", "created", "writer"},
            "kv_states": {"conversation_id", "role", "key", "file", "n_tokens", "bytes", "updated"}}
_UNREADABLE = ("SQLITE_NOTADB", "SQLITE_CORRUPT")


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
    if getattr(e, "sqlite_errorname", None) in _UNREADABLE:
        return HistoryUnreadable(f"{path} is damaged or not a database ({text}); "
                                 "move the file away and edgerun will start a new one")
    if isinstance(e, sqlite3.IntegrityError):
        return HistoryError(f"history refused a write ({text}); was the conversation deleted?")
    if "locked" in text or "busy" in text:
        return HistoryError(f"{path} is locked by another edgerun; close it and try again")
    if "full" in text:
        return HistoryError(f"cannot write {path}: the disk is full; free some space and retry")
    return HistoryError(f"cannot use the history database {path} ({text}); "
                        "move the file away and edgerun will start a new one")


def _unreadable(path: Path, why: str) -> HistoryUnreadable:
    return HistoryUnreadable(f"{path} {why}; move the file away and edgerun will start a new one")


def _tables(c: sqlite3.Connection) -> set[str]:
    return {name for (name,) in c.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}


def _missing(c: sqlite3.Connection) -> list[str]:
    """The tables and columns the code reads that the file lacks."""
    missing = []
    for table, columns in _COLUMNS.items():
        have = {row[1] for row in c.execute(f"PRAGMA table_info({table})")}
        missing += [table] if not have else [f"{table}.{column}" for column in sorted(columns - have)]
    return missing


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
            self._writer = _WriterLock(self.path.with_name(self.path.name + ".writers"))
        except BaseException:
            self._conn.close()
            raise

    def _setup(self) -> None:
        version = self._inspect()
        with self._locked() as c:
            # WAL + synchronous=NORMAL: a commit appends to the WAL without fsync, so a streamed
            # chunk costs microseconds and survives the process dying (power loss may drop the
            # last commits).
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")
            c.execute("PRAGMA foreign_keys=ON")
        while version < len(_MIGRATIONS):
            with self._tx() as c:
                # re-read under the write lock: another process may have migrated meanwhile
                version = c.execute("PRAGMA user_version").fetchone()[0]
                if version < len(_MIGRATIONS):
                    for statement in _MIGRATIONS[version]:
                        c.execute(statement)
                    version += 1
                    c.execute(f"PRAGMA user_version = {version}")
        self._refuse_foreign_columns()

    def _inspect(self) -> int:
        """The file's schema version, once it is known to be a readable edgerun history. Only
        reads (even the switch to WAL writes): the first read is where a garbage file fails, and
        quick_check reads every page (70 ms for a 20 MB history on a busy 2-core VM), so damage
        shows now, not in the middle of a chat."""
        with self._locked() as c:
            problem = c.execute("PRAGMA quick_check(1)").fetchone()[0]
            version = c.execute("PRAGMA user_version").fetchone()[0]
            tables = _tables(c)
        if problem != "ok":
            raise _unreadable(self.path, f"is damaged ({' '.join(problem.split())[:200]})")
        if (tables and version == 0) or (version > 0 and not _FIRST_TABLES <= tables):
            raise _unreadable(self.path, f"is not an edgerun history (schema {version}, tables:"
                                         f" {', '.join(sorted(tables)) or 'none'})")
        if version > len(_MIGRATIONS):
            raise HistoryError(f"{self.path} was written by a newer edgerun (schema {version});"
                               " upgrade edgerun or move the file away")
        if version == len(_MIGRATIONS):
            self._refuse_foreign_columns()
        return version

    def _refuse_foreign_columns(self) -> None:
        with self._locked() as c:
            missing = _missing(c)
        if missing:
            raise _unreadable(self.path, f"is not an edgerun history (it lacks {', '.join(missing)})")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            self._writer.release()

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
        writer = self._writer.token if status == "streaming" else None
        with self._tx() as c:
            msg_id = c.execute("INSERT INTO messages (conversation_id, role, content, status, stats,"
                               " created, writer) VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (conv_id, role, content, status, _json(stats), now, writer)).lastrowid
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

    def delete(self, conv_id: int) -> list[str]:
        """Its messages and state records go with it (ON DELETE CASCADE); a missing id is a
        no-op. Returns the state files no other conversation records, for the caller to remove."""
        with self._tx() as c:
            files = [f for (f,) in c.execute("SELECT file FROM kv_states WHERE conversation_id = ?", (conv_id,))]
            c.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
            return _unused(c, files)

    # ----- saved KV states ----------------------------------------------------------------------

    def kv_states(self, conv_id: int) -> list[SavedState]:
        """The conversation's saved states, most recently saved first."""
        with self._locked() as c:
            rows = c.execute("SELECT role, key, file, n_tokens, bytes FROM kv_states WHERE conversation_id = ?"
                             " ORDER BY updated DESC, rowid DESC", (conv_id,)).fetchall()
        return [SavedState(*row) for row in rows]

    def record_kv_states(self, conv_id: int, states: list[SavedState]) -> list[str]:
        """Record states just saved for a conversation, each replacing the one of its role and
        key. Returns the replaced files that no conversation records any more."""
        now = self._clock()
        with self._tx() as c:
            old = []
            for s in states:
                old += [f for (f,) in c.execute("SELECT file FROM kv_states WHERE conversation_id = ? AND role = ?"
                                                " AND key = ? AND file != ?", (conv_id, s.role, s.key, s.name))]
                c.execute("INSERT OR REPLACE INTO kv_states (conversation_id, role, key, file, n_tokens, bytes,"
                          " updated) VALUES (?, ?, ?, ?, ?, ?, ?)",
                          (conv_id, s.role, s.key, s.name, s.n_tokens, s.bytes, now))
            return _unused(c, old)

    def forget_kv_states(self, files: list[str] | None = None) -> int:
        """Drop the records of these state files (all, with None): the files were removed."""
        with self._tx() as c:
            if files is None:
                return c.execute("DELETE FROM kv_states").rowcount
            return sum(c.execute("DELETE FROM kv_states WHERE file = ?", (f,)).rowcount for f in files)

    def kv_state_owners(self) -> dict[str, list[str]]:
        """State file -> the titles of the conversations that record it."""
        owners: dict[str, list[str]] = {}
        with self._locked() as c:
            for file, title in c.execute("SELECT k.file, coalesce(c.title, ?) FROM kv_states k JOIN conversations c"
                                         " ON c.id = k.conversation_id ORDER BY k.updated DESC", (UNTITLED,)):
                owners.setdefault(file, []).append(title)
        return owners

    def recover(self) -> int:
        """Mark 'interrupted' the replies left 'streaming' by a writer that is gone (its process
        died, or it closed its History mid-reply); returns how many. A reply another live History
        is streaming, in this process or another, is left alone."""
        with self._tx() as c:
            writers = {w for (w,) in c.execute("SELECT DISTINCT writer FROM messages WHERE status = 'streaming'")}
            return sum(c.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming'"
                                 " AND writer IS ?", (writer,)).rowcount for writer in self._writer.gone(writers))

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


class _WriterLock:
    """A History's claim on the replies it streams: an exclusive flock on
    <history>.writers/<token>.lock, held while the History is open. The OS drops it when the
    process ends, however it ends (SIGKILL too), so a lock that can be taken means its writer is
    gone; a pid alone could belong to a new process by then. flock, not fcntl/lockf: a POSIX
    record lock belongs to the process, so probing a lock this process holds would succeed."""

    def __init__(self, folder: Path):
        self.folder, self.token = folder, secrets.token_hex(8)
        self._fd: int | None = None
        pending = folder / f"{self.token}.new"
        try:
            folder.mkdir(exist_ok=True)
            self._fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # a name nobody else knows: never waits
            # a file carries a .lock name only once locked, so a sweep (which removes the ones it
            # can lock) never takes a writer that is still starting
            os.rename(pending, self._file(self.token))
        except OSError as e:
            if self._fd is not None:
                os.close(self._fd)
                pending.unlink(missing_ok=True)
            raise HistoryError(f"cannot create a lock file in {folder} ({e}); check its permissions") from e

    def _file(self, token: str) -> Path:
        return self.folder / f"{token}.lock"

    def release(self) -> None:
        if self._fd is not None:
            self._file(self.token).unlink(missing_ok=True)
            os.close(self._fd)  # drops the lock
            self._fd = None

    def gone(self, tokens: set[str | None]) -> set[str | None]:
        """Those of `tokens` whose writer has ended (None, a reply from before writers were
        recorded, counts as ended). Removes every ended writer's lock file on the way."""
        try:
            for path in self.folder.glob("*.lock"):
                _remove_if_free(path)
        except OSError as e:
            raise HistoryError(f"cannot check the writers' locks in {self.folder} ({e}); "
                               "check its permissions") from e
        return {t for t in tokens if t is None or not self._file(t).exists()}


def _remove_if_free(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return  # its writer closed, or another recover() removed it meanwhile
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink(missing_ok=True)  # while holding its lock: no live writer can be using it
    except BlockingIOError:
        pass  # its writer is alive
    finally:
        os.close(fd)


def move_aside(path: Path, clock: Callable[[], float] = time.time) -> Path:
    """Rename a history file that cannot be used (with its -wal and -shm, which belong to it) to
    `<name>.corrupt-<time>`, so a new one can start; returns the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(clock()))
    target, n = path.with_name(f"{path.name}.corrupt-{stamp}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.corrupt-{stamp}-{n}"), n + 1
    try:
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.exists():
                side.rename(target.with_name(target.name + suffix))
        path.rename(target)
    except OSError as e:
        raise HistoryError(f"cannot move {path} aside ({e}); move it away by hand") from e
    return target


def _unused(c: sqlite3.Connection, files: list[str]) -> list[str]:
    """Those of `files` that no kv_states row names."""
    return sorted({f for f in files if c.execute("SELECT 1 FROM kv_states WHERE file = ?", (f,)).fetchone() is None})


def _check_status(status: str, final: bool = False) -> None:
    allowed = FINAL_STATUSES if final else STATUSES
    if status not in allowed:
        raise ValueError(f"status must be one of {allowed}, not {status!r}")


def _json(stats: dict | None) -> str | None:
    return json.dumps(stats) if stats is not None else None
