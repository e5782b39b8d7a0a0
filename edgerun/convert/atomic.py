"""Durable atomic writes for convert's outputs and intermediates.

A file appears under its final name only whole: it is written under a temporary name in the same
directory, fsynced, renamed into place, and then the directory is fsynced so that the rename itself
is on disk. Without the first fsync a power cut soon after the rename can leave the final name on
an empty or partial file (file systems may commit the rename before the data), and the pipeline
takes a file that exists for a finished intermediate and reuses it. A writer killed outright
(SIGKILL, a power cut) cannot remove its temporary; the next write of the same file does."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path


def temp_name(dst: Path) -> Path:
    """A name beside DST for its temporary: hidden, with the writer's pid (see sweep) and a random
    part (two writers in one process stay apart), and not created, so whatever writes it
    (llama.cpp too) creates it with the usual permissions."""
    return dst.with_name(f".{dst.name}.{os.getpid()}.{secrets.token_hex(4)}.part")


def sweep(dst: Path) -> None:
    """Remove what killed writers of DST left behind: temporaries whose writer process is gone
    (a killed conversion would otherwise leave a model-sized file in the cache for good). A live
    writer's temporary, in this process or another, is left alone."""
    dst = Path(dst)
    # temp_name's pattern exactly, and what is written beside a temp (quantize's imatrix)
    ours = re.compile(rf"\.{re.escape(dst.name)}\.(\d+)\.[0-9a-f]{{8}}\.part(\..+)?")
    for path in dst.parent.glob(f".{glob.escape(dst.name)}.*.part*"):
        m = ours.fullmatch(path.name)
        if m and path.is_file() and not _alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


def fsync_path(path: Path) -> None:
    """Flush PATH (a file or a directory) to disk. fsync syncs the inode whatever the descriptor's
    mode, so a read-only descriptor serves for files that other code (gguf-py, llama.cpp) wrote."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, dst: Path) -> None:
    """Make the finished file (or directory tree) TMP the file DST, durably."""
    tmp, dst = Path(tmp), Path(dst)
    if tmp.is_dir():
        for path in sorted(tmp.rglob("*"), reverse=True):  # deepest first: a directory after its files
            if not path.is_symlink():
                fsync_path(path)
    fsync_path(tmp)
    os.replace(tmp, dst)
    fsync_path(dst.parent)


@contextlib.contextmanager
def atomic_path(dst: Path) -> Iterator[Path]:
    """A temporary path beside DST for the caller to write by any means (a file object, gguf-py,
    llama.cpp in a child process). On a clean exit it becomes DST durably; on any exception
    (Ctrl-C too) it is removed and DST is left as it was."""
    dst = Path(dst)
    sweep(dst)
    tmp = temp_name(dst)
    try:
        yield tmp
        publish(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_bytes(dst: Path, data: bytes) -> None:
    """DST holds DATA, written as atomic_path writes (its folder made if it is missing)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst) as tmp:
        tmp.write_bytes(data)
