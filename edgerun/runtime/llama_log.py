"""Route llama.cpp's log into Python's logging (never raw to the terminal: it would tear a TUI)."""

from __future__ import annotations

import ctypes
import logging

import llama_cpp

log = logging.getLogger("edgerun.llama")

# ggml.h's ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continue the previous line
_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


class _LineBuffer:
    """llama.cpp logs in fragments (level 5 continues the last); emit whole lines only."""

    def __init__(self) -> None:
        self.level = logging.INFO
        self.text = ""

    def feed(self, level: int, text: str) -> None:
        if level != 5:
            self.level = _LEVELS.get(level, logging.INFO)
        self.text += text
        while "\n" in self.text:
            line, self.text = self.text.split("\n", 1)
            if line.strip():
                log.log(self.level, "%s", line)


_buffer = _LineBuffer()


@llama_cpp.llama_log_callback
def _callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    _buffer.feed(level, text.decode("utf-8", errors="replace"))


def install() -> None:
    """Point llama.cpp's log at `logging`, its debug lines only while this logger wants them: on a
    GPU ggml logs one per decode step, and each call into Python takes the GIL inside the step
    (the filter runs in C, in the native extension). Call again after changing the level."""
    from edgerun import _native  # it loads llama_cpp first: one libllama in the process

    _native.route_log(ctypes.cast(_callback, ctypes.c_void_p).value, log.isEnabledFor(logging.DEBUG))


install()


def route_to_file(path) -> None:
    """Send all logging to a file instead of the terminal (a full-screen app owns the terminal)."""
    import pathlib

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    root.addHandler(file_handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    log.setLevel(logging.INFO)
