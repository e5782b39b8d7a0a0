"""`edgerun rpc-server`: this machine's backend (its GPUs, else its CPU) served to other edgeruns'
`--rpc` through ggml's own RPC server (runtime/rpc.py), until Ctrl-C or SIGTERM."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading

from edgerun import settings
from edgerun.errors import ConfigError
from edgerun.runtime import engine as _engine  # noqa: F401  (llama's log goes to logging before ggml speaks)
from edgerun.runtime import rpc

GiB = 2**30
NO_AUTH_WARNING = ("ggml's RPC protocol has no authentication or encryption: anyone who can reach {ep} can run"
                   " code on this machine's backend and read what clients send. Use it on a trusted network only.")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_port(ep: rpc.Endpoint) -> None:
    """Bind once here, so a port in use or a foreign address is one line, not a thread that ends."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ep.host, ep.port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {ep} ({exc.strerror or exc}): pick another --port or --host") from None


def run(args) -> int:
    ep = rpc.Endpoint(args.host, int(args.port))
    _check_port(ep)
    devices = rpc.serve_devices(cpu=args.cpu)
    if not devices:
        raise ConfigError("ggml found no device to serve")
    threads = args.threads or settings.default_threads()
    mem = int(args.mem * GiB) if args.mem else None
    cache = None
    if args.cache:
        args.cache.mkdir(parents=True, exist_ok=True)
        cache = str(args.cache.resolve())
    if not _loopback(ep.host):
        print(f"edgerun rpc-server: warning: {NO_AUTH_WARNING.format(ep=ep)}", file=sys.stderr, flush=True)
    cap = f", at most {mem / GiB:.2f} GiB" if mem else ""
    for d in devices:
        print(f"edgerun rpc-server: serving {rpc.describe(d)}{cap}, {threads} threads, on {ep}", file=sys.stderr)
    # in place before the server thread starts (a KeyboardInterrupt then would finalize ggml under
    # it); put back only if it does not start: once it runs, the process ends in os._exit
    stop = threading.Event()
    previous = [(sig, signal.signal(sig, lambda *_: stop.set())) for sig in (signal.SIGINT, signal.SIGTERM)]
    try:
        server = rpc.start_server(ep, threads=threads, mem_bytes=mem, cache_dir=cache, devices=devices)
    except BaseException:
        for sig, handler in previous:
            signal.signal(sig, handler)
        raise
    print(f"edgerun rpc-server: clients use --rpc {ep}; Ctrl-C stops", file=sys.stderr, flush=True)
    while not stop.wait(0.2):
        if not server.is_alive():
            print(f"edgerun: error: ggml's RPC server on {ep} stopped (see its message above)", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)
    print("edgerun rpc-server: stopped", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # the server thread is inside ggml's accept loop, which has no stop: end the process here rather
    # than finalize ggml under it
    os._exit(0)
