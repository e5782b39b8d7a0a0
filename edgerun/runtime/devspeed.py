"""How fast a device streams weights: the planner's measured speed for --rpc devices.

A decode step reads every weight once and, on a remote device, pays one network round trip per
graph: both are what one quantized matrix-vector product costs, timed on the device through
ggml's own backend API (the tensors are allocated and zeroed on the device; nothing is uploaded).
The result is weight bytes per second, comparable across local and remote devices of any kind;
ggml reports every RPC device as a GPU, so without it a remote CPU and a remote GPU look alike.

The functions are reached with ctypes in the libggml-base that llama-cpp-python installed (as
rpc.py does)."""

from __future__ import annotations

import ctypes
import time

from edgerun.runtime import rpc

PROBE_ROWS, PROBE_COLS = 8192, 8192  # Q4_0: 36 MiB, past any CPU cache, a small share of a GPU
PROBE_REPS = 5  # the fastest of these counts (the first may page the buffer in)
_Q4_0, _F32 = 2, 0  # enum ggml_type


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_bound = False
# (device handle, its total bytes) -> measured speed. ggml registers an endpoint once per process
# and hands back the same device handle on every later connect, so a handle is one server's
# device for the process's life; its total memory tells a server restarted there on another
# device. A probe costs the server ~0.08 s of its CPU: a process that loads several models over
# the same servers (doctor, then a run; a chat reloading) measures each device once.
_measured: dict[tuple[int, int], float] = {}


def _base() -> ctypes.CDLL:
    global _bound
    base = rpc.lib().base
    if not _bound:
        p, sz, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
        for name, args, res in (
            ("ggml_init", [_InitParams], p), ("ggml_free", [p], None),
            ("ggml_tensor_overhead", [], sz), ("ggml_graph_overhead", [], sz), ("ggml_nbytes", [p], sz),
            ("ggml_new_tensor_2d", [p, ctypes.c_int, i64, i64], p), ("ggml_mul_mat", [p, p, p], p),
            ("ggml_new_graph", [p], p), ("ggml_build_forward_expand", [p, p], None),
            ("ggml_backend_dev_init", [p, ctypes.c_char_p], p), ("ggml_backend_free", [p], None),
            ("ggml_backend_alloc_ctx_tensors", [p, p], p), ("ggml_backend_buffer_free", [p], None),
            ("ggml_backend_tensor_memset", [p, ctypes.c_uint8, sz, sz], None),
            ("ggml_backend_tensor_get", [p, p, sz, sz], None),
            ("ggml_backend_graph_compute", [p, p], ctypes.c_int),
        ):
            fn = getattr(base, name)
            fn.argtypes, fn.restype = args, res
        _bound = True
    return base


def weight_bytes_per_s(handle: int, free: int | None = None) -> float | None:
    """Weight bytes per second a matrix-vector product streams on the device (ggml_backend_dev_t),
    a network round trip included for a remote one (measured once per device in a process); None
    when the device has no room for the probe or cannot run it."""
    key = (handle, rpc.memory(handle)[1])
    if key not in _measured:
        speed = _probe(handle, free)
        if speed is None:  # no room now may be room later: only a measured speed is kept
            return None
        _measured[key] = speed
    return _measured[key]


def _probe(handle: int, free: int | None) -> float | None:
    b = _base()
    ctx = b.ggml_init(_InitParams(4 * b.ggml_tensor_overhead() + b.ggml_graph_overhead(), None, True))
    if not ctx:
        return None
    backend = buf = None
    try:
        w = b.ggml_new_tensor_2d(ctx, _Q4_0, PROBE_COLS, PROBE_ROWS)
        x = b.ggml_new_tensor_2d(ctx, _F32, PROBE_COLS, 1)
        y = b.ggml_mul_mat(ctx, w, x)
        graph = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(graph, y)
        size = b.ggml_nbytes(w)
        if free is not None and free < 2 * size:
            return None
        backend = b.ggml_backend_dev_init(handle, None)
        buf = b.ggml_backend_alloc_ctx_tensors(ctx, backend) if backend else None
        if not buf:
            return None
        for t in (w, x):
            b.ggml_backend_tensor_memset(t, 0, 0, b.ggml_nbytes(t))
        out, best = ctypes.create_string_buffer(4), float("inf")
        for _ in range(PROBE_REPS):
            start = time.perf_counter()
            if b.ggml_backend_graph_compute(backend, graph) != 0:  # GGML_STATUS_SUCCESS
                return None
            b.ggml_backend_tensor_get(y, out, 0, 4)  # the result back: the step's round trip
            best = min(best, time.perf_counter() - start)
        return size / best if best > 0 else None
    finally:
        if buf:
            b.ggml_backend_buffer_free(buf)
        if backend:
            b.ggml_backend_free(backend)
        b.ggml_free(ctx)


def local_cpu_bytes_per_s() -> float | None:
    """The same probe on this machine's CPU backend (what the blocks left on the host run at)."""
    return weight_bytes_per_s(rpc.serve_devices(cpu=True)[0])
