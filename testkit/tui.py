"""Helpers for driving the chat app with Textual's pilot in tests."""

from __future__ import annotations

import time


async def wait_for(pilot, condition, timeout: float = 120.0) -> None:
    """Let the app run until `condition()` holds; fail after `timeout` seconds (a bound on a hang,
    not a speed check: loading a model on a loaded 2-core machine takes tens of seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


def notes(app) -> str:
    """Every notification the app has shown, in one line."""
    return " ".join(str(n.message) for n in app._notifications)
