"""The chat app meeting a history file it cannot use (edgerun/tui/history_open.py): driven by
Textual's Pilot, and `edgerun chat` itself on a pseudo-terminal for its exit status."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from edgerun.history import History
from edgerun.tui.app import EdgerunApp
from edgerun.tui.history_open import MoveAsideScreen
from testkit.tui import notes, wait_for

GARBAGE = b"this is not a database\n" * 400


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def unreadable(home):
    path = home / "data" / "history.sqlite3"
    path.parent.mkdir(parents=True)
    path.write_bytes(GARBAGE)
    return path




async def test_an_unreadable_history_is_said_and_moved_aside_on_request(unreadable):
    app = EdgerunApp("no-such-model", draft="none", live=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, MoveAsideScreen))
        shown = str(app.screen.query_one("#problem").render())
        assert str(unreadable) in shown and "move the file away" in shown
        assert app.history is None and "unknown model" not in notes(app)  # no model loads meanwhile
        await pilot.press("m")
        await wait_for(pilot, lambda: app.history is not None)
        assert app.history.list_conversations() == []
        (moved,) = unreadable.parent.glob("history.sqlite3.corrupt-*")
        assert moved.read_bytes() == GARBAGE and "moved to" in notes(app)
        await wait_for(pilot, lambda: "unknown model" in notes(app))  # then the start went on
        assert app.is_running
        await pilot.press("ctrl+q")  # a plain quit once the history is fine: status 0
        await wait_for(pilot, lambda: app.return_code is not None)
    assert app.return_code == 0
    with History() as h:  # the new file is a history
        assert h.list_conversations() == []


@pytest.mark.parametrize("key", ["q", "escape", "ctrl+q"])
async def test_declining_ends_the_app_with_an_error_status_and_keeps_the_file(unreadable, key):
    app = EdgerunApp("no-such-model", draft="none", live=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, MoveAsideScreen))
        await pilot.press(key)  # q answers no; Esc pops the screen; Ctrl+Q quits the app
        await wait_for(pilot, lambda: app.return_code is not None)
    assert app.return_code == 1
    assert unreadable.read_bytes() == GARBAGE
    assert list(unreadable.parent.glob("*.corrupt-*")) == []


def _read_until(fd: int, needle: bytes, timeout: float = 120.0) -> bytes:
    """What the terminal shows, read until `needle` appears or the program ends."""
    seen, deadline = b"", time.monotonic() + timeout
    while needle not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the program closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    return seen


def test_edgerun_chat_exits_non_zero_with_the_line_when_the_history_is_declined(unreadable):
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 400, 0, 0))  # wide: no wrapping
    proc = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "chat", "no-such-model", "--draft", "none"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env=os.environ | {"TERM": "xterm-256color"})
    os.close(slave)
    try:
        shown = _read_until(master, b"cannot be used")
        assert b"cannot be used" in shown, shown[-2000:]
        os.write(master, b"q")
        shown += _read_until(master, b"\0never")  # to the end
        assert proc.wait(timeout=60) == 1
        # the terminal breaks the long line (mid-word, where a longer tmp path as under
        # pytest-xdist puts the break inside the words checked here): join its rows
        said = shown.replace(b"\r\n", b"")
        assert f"edgerun: error: {unreadable} is damaged or not a database".encode() in said, shown[-2000:]
        assert b"Traceback" not in shown
    finally:
        proc.kill()
        proc.wait(timeout=60)
        os.close(master)
    assert unreadable.read_bytes() == GARBAGE
