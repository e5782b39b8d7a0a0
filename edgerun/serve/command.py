"""`edgerun serve`: bind, load the model behind a /health that says "loading", serve until a
signal, drain, exit 0."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import sys

from edgerun.errors import ConfigError, EdgerunError

DEFAULT_PORT = 8080
DRAIN_S = 10.0  # how long Ctrl-C waits for running replies before it cancels them
KEY_ENV = "EDGERUN_API_KEY"


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (so --port 0 can name its port at once
    and a port in use is one line, not a load then a failure)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host} is not an address this machine has ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(args, load_runner) -> int:
    """load_runner(): the Runner for args (commands.py builds it, as for `run`)."""
    import asyncio  # here, not at the top: every command's parser reads this module's defaults

    import uvicorn

    from edgerun.serve.app import ServerState, create_app
    from edgerun.serve.scheduler import Scheduler

    key = args.api_key or os.environ.get(KEY_ENV) or None
    if not loopback(args.host) and not key:
        raise ConfigError(f"--host {args.host} lets other machines in: give --api-key KEY (or set {KEY_ENV}),"
                          " or serve on 127.0.0.1")
    if args.parallel >= args.n_batch:
        raise ConfigError(f"--parallel {args.parallel} needs --n-batch above it (a step decodes one token of each)")
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    state = ServerState(names=[args.model or _default_model()], api_key=key, drain_s=args.drain_timeout)
    outcome = {"code": 0}
    server: uvicorn.Server | None = None

    async def load() -> None:
        try:
            runner = await asyncio.to_thread(load_runner)
        except EdgerunError as exc:
            print(f"edgerun: error: {exc}", file=sys.stderr, flush=True)
            outcome["code"] = exc.exit_code
            server.should_exit = True
            return
        for alias in (runner.path.name, runner.path.stem):
            if alias not in state.names:
                state.names.append(alias)
        scheduler = Scheduler(runner, state.metrics, queue_limit=args.queue, step_tokens=args.prefill_chunk,
                              prefill_share=args.prefill_share, cache_bytes=args.cache_ram << 20)
        scheduler.start()
        state.scheduler = scheduler
        shown = f"[{host}]" if ":" in host else host
        print(f"edgerun serve: ready at http://{shown}:{port}/v1 (model {state.names[0]}, {args.parallel} slots"
              f" of {runner.ctx.n_ctx} tokens{', key required' if key else ''})", flush=True)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loading = asyncio.create_task(load())
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            if state.scheduler is not None:
                await asyncio.to_thread(state.scheduler.close)
                state.scheduler.runner.close()

    app = create_app(state, lifespan=lifespan)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=args.drain_timeout,
                            lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it is done: these make that a no-op, so
    # Ctrl-C and SIGTERM end in exit status 0 after the drain
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    return outcome["code"]


def _default_model() -> str:
    from edgerun.models import catalog

    return catalog.load().default_target
