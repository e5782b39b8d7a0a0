"""Remote devices through ggml's RPC backend: the client side (`--rpc HOST:PORT,...`) and the
server side (`edgerun rpc-server`), both on the libggml-rpc that llama-cpp-python installed.

The library entry points are reached with ctypes (llama-cpp-python binds none of them). setup.sh
builds ggml with GGML_RPC=ON and edgerun's RPC patch (scripts/llama_patches.py): a server that
dies or stops answering marks itself failed instead of aborting this process, which
`check_failures` turns into one EngineError naming it; `--mem` caps what a server reports and
allocates; the client counts the bytes it moves."""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import ConfigError, EngineError

DEFAULT_PORT = 50052
PROBE_TIMEOUT_S = 3.0  # connecting at start: a server down or unreachable is said in seconds

_DEV_CPU, _DEV_GPU = 0, 1  # enum ggml_backend_dev_type


class _Lib:
    """The ggml functions used here, bound once."""

    def __init__(self) -> None:
        # here, not at the top: the CLI's parser reads DEFAULT_PORT, and a command that fails on its
        # arguments (or asks for --help) need not load llama.cpp (about 0.2 s of CPU)
        import llama_cpp

        libdir = Path(llama_cpp.__file__).parent / "lib"
        self.base = ctypes.CDLL(str(libdir / "libggml-base.so"))
        self.ggml = ctypes.CDLL(str(libdir / "libggml.so"))
        path = libdir / "libggml-rpc.so"
        self.rpc = ctypes.CDLL(str(path)) if path.exists() else None  # a build with GGML_RPC=OFF has none
        self.patched = self.rpc is not None and hasattr(self.rpc, "ggml_backend_rpc_edgerun_failed")
        p, sz = ctypes.c_void_p, ctypes.c_size_t
        if self.rpc is not None:
            self.rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
            self.rpc.ggml_backend_rpc_add_server.restype = p
            self.rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, sz, sz, p]
            self.rpc.ggml_backend_rpc_start_server.restype = None
        if self.patched:
            f = self.rpc.ggml_backend_rpc_edgerun_failed
            f.argtypes = [ctypes.c_char_p, sz, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
            f.restype = sz
        for name, args, res in (
            ("ggml_backend_reg_dev_count", [p], sz), ("ggml_backend_reg_dev_get", [p, sz], p),
            ("ggml_backend_dev_name", [p], ctypes.c_char_p), ("ggml_backend_dev_description", [p], ctypes.c_char_p),
            ("ggml_backend_dev_memory", [p, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
            ("ggml_backend_dev_type", [p], ctypes.c_int),
        ):
            fn = getattr(self.base, name)
            fn.argtypes, fn.restype = args, res
        for name, args, res in (("ggml_backend_dev_count", [], sz), ("ggml_backend_dev_get", [sz], p)):
            fn = getattr(self.ggml, name)
            fn.argtypes, fn.restype = args, res


_lib: _Lib | None = None
_lock = threading.Lock()


def lib() -> _Lib:
    global _lib
    with _lock:
        if _lib is None:
            _lib = _Lib()
        return _lib


def available() -> str:
    """What `doctor` says about RPC in this build."""
    binding = lib()
    if binding.rpc is None:
        return "not built (GGML_RPC=OFF): run scripts/setup.sh"
    return "built in (GGML_RPC=ON)" + ("" if binding.patched else "; without edgerun's patch: run scripts/setup.sh")


def _patched() -> _Lib:
    binding = lib()
    if not binding.patched:
        raise ConfigError("this llama.cpp build lacks the RPC backend or edgerun's patch to it (without it a lost"
                          " server aborts the client, and a server's --mem does nothing): run scripts/setup.sh")
    return binding


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse(spec: str) -> tuple[Endpoint, ...]:
    """`HOST:PORT[,HOST:PORT...]` (a bare HOST takes the default port)."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        host, _, port = part.rpartition(":") if ":" in part else (part, "", str(DEFAULT_PORT))
        try:
            number = int(port)
        except ValueError:
            number = -1
        if not host or not 0 < number < 65536:
            raise ConfigError(f"--rpc {part!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})")
        out.append(Endpoint(host, number))
    if not out:
        raise ConfigError(f"--rpc needs at least one HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT})")
    if len(set(out)) != len(out):
        raise ConfigError(f"--rpc {spec!r} names a server twice")
    return tuple(out)


@dataclass(frozen=True)
class RemoteDevice:
    """One device a server offers, with the memory it reported when we connected."""

    endpoint: str
    name: str  # ggml's device name (RPC0, RPC1, ...)
    free: int
    total: int
    handle: int  # ggml_backend_dev_t
    speed: float | None = None  # weight bytes per second it streams (runtime/devspeed.py), once measured


def connect(endpoints: tuple[Endpoint, ...], *, timeout_s: float) -> list[RemoteDevice]:
    """Register each server with ggml and list its devices. A server that is down, or does not
    answer ggml's handshake, is one ConfigError naming it, before anything loads."""
    binding = _patched()
    # read by the patched client at every connect: a silent server fails its request after this long
    os.environ["EDGERUN_RPC_TIMEOUT_S"] = str(max(1, round(timeout_s)))
    found = []
    for ep in endpoints:
        try:
            socket.create_connection((ep.host, ep.port), timeout=PROBE_TIMEOUT_S).close()
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise ConfigError(f"rpc server {ep} is not reachable ({reason}): start `edgerun rpc-server`"
                              f" there or drop it from --rpc") from None
        before = failed_endpoints()
        reg = binding.rpc.ggml_backend_rpc_add_server(str(ep).encode())
        if not reg or failed_endpoints()[len(before):]:
            raise ConfigError(f"rpc server {ep} accepted the connection but did not answer ggml's handshake"
                              f" within {timeout_s:.0f} s (busy with another client, or not an rpc-server)")
        for i in range(binding.base.ggml_backend_reg_dev_count(reg)):
            dev = binding.base.ggml_backend_reg_dev_get(reg, i)
            name = binding.base.ggml_backend_dev_name(dev).decode()
            found.append(RemoteDevice(str(ep), name, *memory(dev), dev))
    return found


def memory(handle: int) -> tuple[int, int]:
    """(free, total) bytes a device reports now (a server's: asked over the network)."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib().base.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def local_gpus() -> list[int]:
    """This machine's GPU devices (ggml_backend_dev_t), in ggml's order; empty on a CPU build."""
    binding = lib()
    devs = (binding.ggml.ggml_backend_dev_get(i) for i in range(binding.ggml.ggml_backend_dev_count()))
    return [d for d in devs if binding.base.ggml_backend_dev_type(d) == _DEV_GPU
            and not binding.base.ggml_backend_dev_name(d).decode().startswith("RPC")]


def _state() -> tuple[str, int, int]:
    binding = lib()
    buf = ctypes.create_string_buffer(4096)
    sent, received = ctypes.c_uint64(), ctypes.c_uint64()
    binding.rpc.ggml_backend_rpc_edgerun_failed(buf, len(buf), ctypes.byref(sent), ctypes.byref(received))
    return buf.value.decode(errors="replace"), sent.value, received.value


def failed_endpoints() -> list[str]:
    """Every server connection that failed in this process, in order (a server may repeat)."""
    text = _state()[0]
    return text.split(",") if text else []


def traffic() -> tuple[int, int]:
    """Bytes this process sent to and received from RPC servers so far."""
    _, sent, received = _state()
    return sent, received


class Watch:
    """The servers one model uses and the failures already on record when it loaded: `check`
    raises once one of them failed since."""

    def __init__(self, endpoints: tuple[Endpoint, ...]):
        self.endpoints = {str(e) for e in endpoints}
        self._seen = len(failed_endpoints())

    def lost(self) -> list[str]:
        new = failed_endpoints()[self._seen:]
        return sorted({e for e in new if e in self.endpoints})

    def check(self) -> None:
        lost = self.lost()
        if lost:
            raise EngineError(f"rpc server {', '.join(lost)} stopped answering (it died, or the network"
                              f" dropped); the reply was cut there: restart it, or load the model without it")


def serve_devices(*, cpu: bool = False) -> list[int]:
    """What `edgerun rpc-server` serves: this machine's GPUs, else (or with cpu) its CPU."""
    binding = lib()
    devs = [binding.ggml.ggml_backend_dev_get(i) for i in range(binding.ggml.ggml_backend_dev_count())]
    gpus = [] if cpu else local_gpus()
    return gpus or [d for d in devs if binding.base.ggml_backend_dev_type(d) == _DEV_CPU][:1]


def describe(handle: int) -> str:
    binding = lib()
    free, total = memory(handle)
    name = binding.base.ggml_backend_dev_name(handle).decode()
    desc = binding.base.ggml_backend_dev_description(handle).decode()
    return f"{name} ({desc}), {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB"


def start_server(endpoint: Endpoint, *, threads: int, mem_bytes: int | None, cache_dir: str | None,
                 devices: list[int]) -> threading.Thread:
    """ggml's RPC server on a daemon thread (it serves until the process ends). The memory cap is
    read by the patched server from the environment, so set it first."""
    binding = _patched()
    if mem_bytes:
        os.environ["EDGERUN_RPC_MEM_BYTES"] = str(mem_bytes)
    arr = (ctypes.c_void_p * len(devices))(*devices)
    args = (str(endpoint).encode(), cache_dir.encode() if cache_dir else None, threads, len(devices), arr)
    # `args` holds the device list for as long as the thread runs the call
    thread = threading.Thread(target=binding.rpc.ggml_backend_rpc_start_server, args=args,
                              name="rpc-server", daemon=True)
    thread.start()
    return thread
