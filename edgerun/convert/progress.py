"""A small progress bar on stderr for the CLI: the `progress(label, done, total)` callback the
convert steps call. On a terminal one line redraws in place; elsewhere (a log, a pipe) each step
prints one line when it finishes, so logs stay readable."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 28


class Bar:
    """Callable as progress(label, done, total); a new label starts a new line."""

    def __init__(self, stream: TextIO | None = None, *, min_interval_s: float = 0.1):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.min_interval_s = min_interval_s
        self.label: str | None = None
        self.started = 0.0
        self.last_draw = 0.0

    def __call__(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if label != self.label:
            self._finish_line()
            self.label, self.started, self.last_draw = label, now, 0.0
        finished = total > 0 and done >= total
        if self.tty and (finished or now - self.last_draw >= self.min_interval_s):
            self.stream.write("\r" + self._line(done, total, now) + "\x1b[K")
            self.stream.flush()
            self.last_draw = now
        if finished:
            if not self.tty:
                self.stream.write(self._line(done, total, now))
            self.stream.write("\n")
            self.stream.flush()
            self.label = None

    def close(self) -> None:
        self._finish_line()

    def _finish_line(self) -> None:
        if self.label is not None and self.tty:
            self.stream.write("\n")
            self.stream.flush()
        self.label = None

    def _line(self, done: int, total: int, now: float) -> str:
        elapsed = now - self.started
        if total <= 0:  # unknown length: a counter
            return f"{self.label}: {done} ({elapsed:.0f}s)"
        frac = min(1.0, done / total)
        filled = int(frac * _WIDTH)
        bar = "#" * filled + "-" * (_WIDTH - filled)
        eta = f", {elapsed / frac - elapsed:.0f}s left" if 0 < frac < 1 and elapsed > 1 else ""
        return f"{self.label:<24} [{bar}] {done}/{total} ({elapsed:.0f}s{eta})"
