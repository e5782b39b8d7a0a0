"""The server processes of `edgerun bench serve`: edgerun serve and llama.cpp's llama-server on
free 127.0.0.1 ports, each stopped (SIGSTOP) while the other is measured so it takes no CPU,
and always stopped at the end (SIGTERM, then SIGKILL after a bounded wait). `edgerun bench rpc`
(and tests/test_rpc.py) start their `edgerun rpc-server`s the same way.

Both logs go to files, not pipes: a server that logs every request would block on a full pipe
that nobody reads. The ready wait is bounded too (a model load, not a measurement).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from edgerun.errors import ConfigError, EdgerunError

READY_S = 300.0  # a model load on a slow disk; past it the server is reported as not starting
STOP_S = 30.0  # the drain a server gets before it is killed
TOOL_S = 900.0  # a reference tool's whole run (llama-batched-bench, edgerun run): past it, an error
CHECKOUT_BIN = Path(__file__).resolve().parents[2] / "build" / "bin"
READY_LINE = "edgerun serve: ready at "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_tool(name: str, given: str | None = None) -> str:
    """A llama.cpp tool: the given path, else build/bin's (setup.sh), else PATH's."""
    if given is not None:
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise ConfigError(f"no {name} at {given}")
        return given
    found = shutil.which(str(CHECKOUT_BIN / name)) or shutil.which(name)
    if found is None:
        raise ConfigError(f"{name} is not built: run `EDGERUN_LLAMA_BENCH=1 scripts/setup.sh`, or pass its path")
    return found


@contextlib.contextmanager
def _signals_held():
    """Holds SIGINT and SIGTERM back from the main thread while a server process starts, yielding
    the list of those that came. Delivered at once, a handler that raises (the bench's SIGTERM,
    Ctrl-C's KeyboardInterrupt) would raise inside Popen after the fork, and the default action
    would end the bench there: either way a running server that nothing stops. An ignored signal
    stays ignored."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held  # a handler runs in the main thread only: this thread's Popen returns whole
        return
    # (None: a handler installed outside Python, which could not be put back)
    previous = {sig: h for sig in (signal.SIGINT, signal.SIGTERM) if (h := signal.getsignal(sig)) not in (signal.SIG_IGN, None)}
    for sig in previous:
        signal.signal(sig, lambda got, _: held.append(got))
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Server:
    """One server process; `url` is its address once ready (http://127.0.0.1:PORT; an rpc-server's
    127.0.0.1:PORT)."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name, self.log, self.url = name, log, ""
        with open(log, "wb") as out, _signals_held() as held:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # a Ctrl-C of the bench is not the server's
        if held:  # the bench was told to stop while the server started: stop the server, then the bench
            self.close()
            signal.raise_signal(held[0])

    def _last_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def wait_ready(self, ready) -> None:
        """Poll `ready()` (the URL once known, else None) until the server answers."""
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EdgerunError(f"{self.name} exited ({self.proc.returncode}) before it was ready: {self._last_line()}")
            url = ready()
            if url:
                self.url = url
                return
            time.sleep(0.2)
        raise EdgerunError(f"{self.name} was not ready after {READY_S:.0f} s: {self._last_line()}")

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _health(url: str) -> bool:
    import httpx

    from edgerun.bench.loadgen import tls

    try:
        return httpx.get(url + "/health", timeout=5, verify=tls()).status_code == 200
    except httpx.HTTPError:
        return False


def start_edgerun(model: Path, threads: int, ctx: int, parallel: int, log: Path, extra: list[str]) -> Server:
    """`edgerun serve` on a port it picks (--port 0): ready when it prints its URL and /health answers."""
    cmd = [sys.executable, "-m", "edgerun.cli", "serve", "-m", str(model), "--host", "127.0.0.1", "--port", "0",
           "--parallel", str(parallel), "--ctx", str(ctx), "--threads", str(threads), *extra]
    server = Server("edgerun serve", cmd, log)

    def ready() -> str | None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(READY_LINE):
                url = line[len(READY_LINE):].split()[0].removesuffix("/v1")
                return url if _health(url) else None
        return None

    _start(server, ready)
    return server


def start_llama_server(binary: str, model: Path, threads: int, ctx: int, parallel: int, log: Path, *,
                       ngl: int = 0) -> Server:
    """llama-server with `parallel` slots of `ctx` tokens each (-c is the total it splits), continuous
    batching, no web UI; ready when /health answers 200 (503 while it loads)."""
    port = free_port()
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx * parallel), "-np", str(parallel), "-cb", "--no-webui", "-ngl", str(ngl)]
    server = Server("llama-server", cmd, log)
    url = f"http://127.0.0.1:{port}"
    _start(server, lambda: url if _health(url) else None)
    return server


@contextlib.contextmanager
def rpc_servers(logs: Path, kinds: list[str], mems: list[float | None], threads: int):
    """`edgerun rpc-server`s on free 127.0.0.1 ports, one per kind ("gpu": this machine's GPU where
    it has one; "cpu": its CPU even then), each capped at its `mems` GiB (None: no cap). Started
    together, ready once each accepts a connection, all stopped at the end. Yields the Servers;
    each one's `url` is its HOST:PORT, what --rpc takes."""
    started: list[Server] = []
    try:
        for i, (kind, mem) in enumerate(zip(kinds, mems, strict=True)):
            port = free_port()
            cmd = [sys.executable, "-m", "edgerun.cli", "rpc-server", "--port", str(port), "--threads", str(threads)]
            cmd += (["--mem", f"{mem:.3f}"] if mem else []) + (["--cpu"] if kind == "cpu" else [])
            started.append(Server(f"rpc-server {i} ({kind})", cmd, logs / f"rpc-server-{i}.log"))
            started[-1].url = f"127.0.0.1:{port}"
        for server in started:
            server.wait_ready(lambda ep=server.url: ep if _accepts(ep) else None)
        yield started
    finally:
        for server in started:
            server.close()


def _accepts(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def _start(server: Server, ready) -> None:
    try:
        server.wait_ready(ready)
    except BaseException:
        server.close()
        raise


def llama_batched_bench(binary: str, model: Path, threads: int, batches: list[int], prompt: int, gen: int, *,
                        ngl: int = 0) -> dict[int, float]:
    """llama.cpp's own batched decode ceiling: S_TG (generated tok/s over all sequences) per batch
    size, each sequence with a `prompt`-token prompt and `gen` generated tokens."""
    import json

    ctx = max(batches) * (prompt + gen) + 64
    cmd = [binary, "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-b", "2048",
           "-ub", "512", "-ngl", str(ngl), "-npp", str(prompt), "-ntg", str(gen), "--output-format", "jsonl"]
    # its rows go through llama.cpp's asynchronous log, which now and then loses all of a run's
    # output at exit (a quarter of the runs on a loaded 2-core machine): the batch sizes whose rows
    # were lost are run again, at most five times
    got: dict[int, float] = {}
    for _ in range(6):
        missing = [b for b in batches if b not in got]
        try:
            proc = subprocess.run([*cmd, "-npl", ",".join(map(str, missing))], capture_output=True, text=True,
                                  timeout=TOOL_S)
        except subprocess.TimeoutExpired:
            raise EdgerunError(f"llama-batched-bench did not finish in {TOOL_S:.0f} s") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise EdgerunError(f"llama-batched-bench failed (exit {proc.returncode}): {last}")
        rows = [json.loads(line) for line in (proc.stdout + proc.stderr).splitlines()
                if line.startswith("{") and '"speed_tg"' in line]
        got.update({int(r["pl"]): float(r["speed_tg"]) for r in rows})
        if set(batches) <= set(got):
            return got
    raise EdgerunError(f"llama-batched-bench printed no result for batch sizes {sorted(set(batches) - set(got))}")
