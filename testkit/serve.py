"""A real `edgerun serve` process for tests and benchmarks: started on a free 127.0.0.1 port,
waited for until it prints its ready line, stopped (SIGINT, then a kill) when the block ends."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from openai import AsyncOpenAI, OpenAI

READY = re.compile(r"edgerun serve: ready at (http://\S+/v1)")
# httpx builds an SSL context for every client it makes (the CA bundle read and parsed: about 35 ms
# of CPU), even for one that only speaks http:// to 127.0.0.1: the tests' clients share this one
TLS = httpx.create_ssl_context()


def client(url: str, api_key: str = "unused", timeout: float = 120.0) -> OpenAI:
    """The official client for a test server; no retries, so a failure shows as it happens."""
    return OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=timeout,
                  http_client=httpx.Client(verify=TLS))


def async_client(url: str, api_key: str = "unused", timeout: float = 300.0) -> AsyncOpenAI:
    """client()'s asyncio twin, for many requests at once."""
    return AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=timeout,
                       http_client=httpx.AsyncClient(verify=TLS))


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # ends in /v1
    stderr: list[str] = field(default_factory=list)

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start(model, *flags: str, env: dict | None = None, timeout: float = 120.0) -> Server:
    """`edgerun serve -m MODEL --port 0 FLAGS...`; raises RuntimeError with its stderr if it exits
    or does not get ready within `timeout` seconds."""
    cmd = [sys.executable, "-m", "edgerun.cli", "serve", "-m", str(model), "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | (env or {}))
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if (m := READY.search(line)) and not found:
                found.append(m.group(1))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"edgerun serve did not get ready: {''.join(err)[-2000:]}")
    return Server(proc, found[0], err)


@contextlib.contextmanager
def running(model, *flags: str, env: dict | None = None) -> Iterator[Server]:
    server = start(model, *flags, env=env)
    try:
        yield server
    finally:
        server.stop()


def greedy_steps(model_path, messages: list[dict], max_tokens: int, ctx: int = 1024, threads: int = 2):
    """The reply to `messages` at T=0 as one sequence alone decodes it (a context of its own, one
    token per llama_decode), step by step: (the text released so far, the top-2 logit gap of the
    step's pick) per token. What a served reply is compared against: a batch of several sequences
    runs other llama.cpp kernels (tinyBLAS for two or more rows, a tiled flash attention), whose
    sums round differently, so a pick whose two best logits are nearly equal may go either way."""
    import numpy as np

    from edgerun.runner import chat_tokens
    from edgerun.runtime.engine import Context, Model
    from edgerun.serve.text import ReplyText
    from edgerun.settings import EngineSettings

    steps: list[tuple[str, float]] = []
    with Model(model_path) as model, Context(model, EngineSettings(n_ctx=ctx, n_threads=threads)) as c:
        prompt = chat_tokens(model, messages)
        text, out = ReplyText(model, [], max_tokens), ""
        c.prefill(prompt)
        while text.finish is None:
            logits = c.logits()
            top2 = np.partition(logits, -2)[-2:]
            token = int(np.argmax(logits))
            out += text.push(token)
            steps.append((out, float(top2[1] - top2[0])))
            if text.finish is None:
                c.eval([token])
    return steps


def explain_difference(steps, served: str, window: int = 4) -> float | None:
    """None when the served reply is the alone reply (the last step's text); else the smallest
    top-2 logit gap over the `window` steps up to the one whose text first leaves the served
    reply: where a batched pick may have gone the other way."""
    if served == steps[-1][0]:
        return None
    first = next(i for i, (text, _) in enumerate(steps) if not served.startswith(text))
    return min(gap for _, gap in steps[max(0, first - window + 1): first + 1])
