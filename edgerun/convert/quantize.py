"""The quantizer call: llama.cpp's llama_model_quantize with per-tensor types and the imatrix.

llama_model_quantize has no abort callback, so it runs in a child process (`python -m
edgerun.convert.quantize`): Ctrl-C, or any exception (e.g. from a progress callback), kills the
child and removes its half-written temp file; the destination only ever appears whole, by rename
(after an fsync, see atomic.py)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from edgerun.convert.atomic import atomic_path
from edgerun.errors import ConvertError

if TYPE_CHECKING:
    from edgerun.convert.imatrix import Imatrix

# The child process imports this module, once per quantize: what only the parent's checks use
# (llama-cpp-python, gguf-py, sensitivity.py and what it brings, the settings) is imported where
# they run. The child loads llama.cpp through the native extension alone: importing llama_cpp's
# Python side would cost it 0.15 s of CPU per quantize, and a convert runs several. NumPy (0.12 s
# of CPU) is imported only by a child that reads an imatrix.

Progress = Callable[[str, int, int], None]


def ftype_value(name: str) -> int:
    """llama.h's llama_ftype for a name like "Q4_K_M" (the base recipe of the quantize)."""
    import llama_cpp

    value = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}", None)
    if value is None:
        raise ConvertError(f"unknown quantization {name!r}; use a llama.cpp type such as Q4_K_M, Q3_K_M or Q8_0")
    return int(value)


def anchored(name: str) -> str:
    """An ECMAScript regex (llama.cpp matches overrides with std::regex_search) that matches
    exactly `name`: anchored, and only the characters special to regexes escaped."""
    return "^" + re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", name) + "$"


def check_overrides(src: Path, overrides: dict[str, str]) -> list[tuple[str, int]]:
    """(pattern, ggml type) per override, after checking that each names a tensor of SRC whose
    rows the type can hold (else llama.cpp would silently pick another type)."""
    import gguf

    from edgerun import _native
    from edgerun.convert.sensitivity import block_size

    if not overrides:
        return []
    try:
        row_len = {name: dims[0] for name, (_, dims) in _native.gguf_tensors(str(src)).items()}
    except ValueError as e:
        raise ConvertError(f"{e}; give an F16/BF16/F32 GGUF") from e
    out = []
    for name, type_name in sorted(overrides.items()):
        size = block_size(type_name)  # ConvertError on an unknown type
        if name not in row_len:
            raise ConvertError(f"{src} has no tensor {name!r} to give type {type_name}; check the plan's names")
        if row_len[name] % size:
            raise ConvertError(f"{name} has rows of {row_len[name]} values, which {type_name} (blocks of {size})"
                               " cannot hold; choose a type with smaller blocks")
        out.append((anchored(name), int(gguf.GGMLQuantizationType[type_name])))
    return out


def quantize(src: Path, dst: Path, *, ftype: str, overrides: dict[str, str], imatrix: Imatrix | None,
             n_threads: int | None = None, progress: Progress | None = None) -> Path:
    """Quantize SRC into DST with llama.cpp: `ftype` is the base recipe, every tensor named in
    `overrides` gets exactly its type. Returns DST, which exists only if the quantize completed."""
    from edgerun.settings import threads_from_env

    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise ConvertError(f"{src}: no such GGUF file")
    if not dst.parent.is_dir():
        raise ConvertError(f"{dst.parent}: the output directory does not exist")
    job = {
        "src": str(src),
        "ftype": ftype_value(ftype),
        "n_threads": n_threads or threads_from_env() or 0,  # 0: llama.cpp uses every core
        "overrides": check_overrides(src, overrides),
    }
    with atomic_path(dst) as tmp:  # llama.cpp creates it (so it gets the usual permissions)
        imatrix_path = None
        try:
            if imatrix is not None:
                imatrix_path = imatrix.save(tmp.with_name(tmp.name + ".imatrix.npz"))
            _run_child(job, str(tmp), imatrix_path, progress)
        finally:
            if imatrix_path is not None:
                imatrix_path.unlink(missing_ok=True)
    return dst


def _run_child(job: dict, tmp: str, imatrix_path: Path | None, progress: Progress | None) -> None:
    job = dict(job, dst=tmp, imatrix=str(imatrix_path) if imatrix_path else None)
    read_fd, write_fd = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "edgerun.convert.quantize", json.dumps(job), str(write_fd)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(write_fd,))
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # the child holds its own copy: EOF on read_fd means it has exited
    total = 0
    with os.fdopen(read_fd, "rb") as lines, child:
        try:
            for line in lines:  # "done total" per tensor; ends when the child exits
                done, total = map(int, line.split())
                if progress:
                    progress("quantize", done, total)
            errors = child.stderr.read().decode("utf-8", "replace")
            child.wait()
        finally:
            if child.returncode is None:  # interrupted: stop the work; the caller removes the temp
                child.kill()
                child.wait()
    if child.returncode != 0:
        detail = [line for line in errors.strip().splitlines() if line.strip()]
        reason = detail[-1] if detail else f"the quantizer exited with status {child.returncode}"
        raise ConvertError(f"{job['src']}: llama.cpp could not quantize it: {reason}")
    if progress and total:
        progress("quantize", total, total)


def _child_main(job_json: str, progress_fd: int) -> int:
    """The child process: quantize into job["dst"]. Terminal Ctrl-C reaches the whole process
    group; the parent alone decides what it means, so the child ignores it."""
    # the extension links llama.cpp by its soname; with no llama_cpp module here it is the only copy
    from edgerun import _native_ext

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    job = json.loads(job_json)
    values = {}
    if job["imatrix"]:
        import numpy as np

        from edgerun.convert.imatrix import Imatrix

        values = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in Imatrix.load(job["imatrix"]).values.items()}
    overrides = [(pattern, int(t)) for pattern, t in job["overrides"]]
    rc, errors = _native_ext.quantize_model(job["src"], job["dst"], job["ftype"], job["n_threads"], True, overrides,
                                        values, progress_fd)
    if rc != 0:
        sys.stderr.write(errors)  # the parent reads it into its ConvertError
    return 1 if rc else 0


def _die_with_parent() -> None:
    """Linux: have the kernel end this process if the parent dies (no orphan writing a temp file)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], int(sys.argv[2])))
