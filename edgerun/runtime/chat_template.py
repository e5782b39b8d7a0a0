"""Render a model's chat template. The template comes from an untrusted file, so it runs in Jinja's
immutable sandbox (no attribute access to Python internals, no mutation of our objects), and the
sandbox runs in a helper process with a time limit, a memory limit and a cap on the text it writes.

Why a process: a template can loop for ever or build a huge value inside one C call
(`'x' * 10**9`, `'%*d' % (10**9, 1)`, `'x'.ljust(10**10)`), which nothing inside our interpreter
can interrupt or bound, so the limits are the kernel's (RLIMIT_AS, a kill on timeout). The helper
starts once per edgerun process, on the first render, and then answers each turn over a pipe.

A template that fails in any way is a clean InvalidModelFile, never a fallback to ChatML: the
template may be refusing these messages on purpose (`raise_exception('...')`), and in the chat app
(whose log goes to a file) a fallback would quietly run the model on a prompt format it was not
trained on. ChatML is used only where the file carries no template at all."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from edgerun.errors import EngineError, InvalidModelFile

# jinja2 is imported only where a template is compiled: in the helper, not in edgerun itself

# Used when a GGUF carries no template: plain ChatML, which most instruct models understand.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TIME_LIMIT_S = 2.0  # a real template renders in milliseconds; this is for one that never ends
MEMORY_LIMIT_BYTES = 512 << 20  # the helper's address space (its interpreter and Jinja take ~25 MiB)
OUTPUT_LIMIT_CHARS = 1 << 20  # a prompt may be 4x its request (messages, template) plus this much
START_TIMEOUT_S = 60.0  # the helper's interpreter start and import on a loaded machine
_HINT = "use --raw to skip it"


def render(template: str | None, messages: list[dict], *, bos: str = "", eos: str = "",
           tools: list[dict] | None = None) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opened; `tools` (OpenAI's
    function definitions) go to the template as its `tools`. InvalidModelFile if
    the template fails, runs past TIME_LIMIT_S, needs more than MEMORY_LIMIT_BYTES or writes more
    than 4x its request plus OUTPUT_LIMIT_CHARS."""
    request = json.dumps({"template": template or CHATML, "messages": messages, "bos": bos, "eos": eos,
                          "tools": tools or None})
    with _lock:
        reply = _helper().ask(request.encode() + b"\n")
    if "error" in reply:
        raise InvalidModelFile(f"the model's chat template failed ({reply['error']}); {_HINT}")
    return reply["text"]


# ----- the parent side: one helper process, restarted after a timeout or a crash -------------------

class _Helper:
    """The helper process and its pipes. Its stdin closing (our exit, even a kill) ends it."""

    def __init__(self):
        self.pid = os.getpid()  # a forked copy of us must not share these pipes
        package_root = Path(__file__).resolve().parents[2]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from edgerun.runtime.chat_template import serve; serve()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                cwd=package_root, bufsize=0)
        except OSError as exc:
            raise EngineError(f"cannot start the chat template renderer ({exc}); {_HINT}") from None
        self._buf = bytearray()
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while self._read_line(deadline) != b"ready":
                pass  # whatever a site hook printed before the helper took over its stdout
        except (TimeoutError, EOFError):
            self.kill()
            raise EngineError(f"the chat template renderer did not start ({sys.executable}); {_HINT}") from None

    def ask(self, request: bytes) -> dict:
        try:
            self._write(request)
            return json.loads(self._read_line(time.monotonic() + TIME_LIMIT_S))
        except TimeoutError:
            self.kill()
            raise InvalidModelFile(f"the model's chat template ran longer than its {TIME_LIMIT_S:g} s limit "
                                   f"(a runaway loop or value?); {_HINT}") from None
        except (EOFError, BrokenPipeError):
            self.kill()
            raise InvalidModelFile(f"the model's chat template crashed its renderer (over its "
                                   f"{MEMORY_LIMIT_BYTES >> 20} MiB memory limit?); {_HINT}") from None
        except BaseException:
            self.kill()  # e.g. Ctrl+C mid-render: its late reply must not answer the next request
            raise

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.proc.stdin.fileno(), view):]

    def _read_line(self, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        while (end := self._buf.find(b"\n")) < 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[:end + 1]
        return line

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.close()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


_lock = threading.Lock()
_current: _Helper | None = None


def _helper() -> _Helper:
    global _current
    if _current is None or not _current.alive():
        if _current is not None and _current.pid == os.getpid():
            _current.close()  # it died between renders: free its pipes
        _current = _Helper()
    return _current


@atexit.register
def _close_helper() -> None:
    if _current is not None and _current.alive():
        _current.close()


# ----- the helper side ----------------------------------------------------------------------------

def serve() -> None:
    """The helper's loop: one JSON request per line on stdin, one JSON reply per line on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in the terminal is for edgerun, not us
    _limit_memory()
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        # a backstop should edgerun die mid-render: SIGALRM's default action ends us, even in C
        signal.alarm(int(TIME_LIMIT_S) + 2)
        try:
            reply = {"text": _render_request(json.loads(line), OUTPUT_LIMIT_CHARS + 4 * len(line))}
        except MemoryError:
            reply = {"error": f"it needed more than {MEMORY_LIMIT_BYTES >> 20} MiB of memory"}
        except Exception as exc:  # noqa: BLE001 - any failure of untrusted code is reported
            reply = {"error": _describe(exc)}
        finally:
            signal.alarm(0)
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


def _limit_memory() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass  # no RLIMIT_AS here (macOS ignores it): the time limit still ends a runaway render


def _render_request(req: dict, limit: int) -> str:
    parts, size = [], 0
    stream = _compile(req["template"]).generate(
        messages=req["messages"], add_generation_prompt=True, bos_token=req["bos"], eos_token=req["eos"],
        tools=req.get("tools"))
    for part in stream:
        size += len(part)
        if size > limit:
            raise _TooLong(f"it wrote more than {limit} characters")
        parts.append(part)
    return "".join(parts)


class _TooLong(Exception):
    pass


def _describe(exc: Exception) -> str:
    from jinja2 import TemplateError, TemplateSyntaxError

    text = " ".join(str(exc).split())[:300]
    if isinstance(exc, TemplateSyntaxError):
        return f"syntax error on line {exc.lineno}: {text}"
    if type(exc) in (TemplateError, _TooLong):  # raise_exception's own words, or our limit
        return text
    text = text.split(";")[0]  # Python's advice after a ';' (set_int_max_str_digits) is not the user's
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@lru_cache(maxsize=8)
def _compile(template: str):
    return _env().from_string(template)


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


_FOLD_MAX_CHARS = 1 << 16  # far above any real template's constant text


def _env():
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class SmallConstants(CodeGenerator):
        """Jinja computes constant output (`{{ 'x' * 10**8 }}`) while compiling and writes its repr
        into the generated Python source: a 100 MB value costs ~2 s of compile and several times
        its memory. A large one is left to render time, where the output cap stops it in 0.1 s."""

        def _output_child_to_const(self, node, frame, finalize):
            const = super()._output_child_to_const(node, frame, finalize)
            if len(const) > _FOLD_MAX_CHARS:
                raise nodes.Impossible()
            return const

    # optimized=False: the optimizer would fold the same constants into the tree before the code
    # generator sees them
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, optimized=False)
    env.code_generator_class = SmallConstants
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


def _tojson(value, indent=None, ensure_ascii=False, **_):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)
