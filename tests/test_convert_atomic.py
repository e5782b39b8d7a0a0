"""Convert's writes (atomic.py): a file appears whole or not at all, is on disk before its rename
makes it current, and a killed writer's temporary is removed by the next write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgerun.convert import pipeline, report
from edgerun.convert.imatrix import Imatrix
from testkit.fixture import make_hf_fixture
from edgerun.convert.quantize import quantize
from edgerun.convert.source import prepare_f16
from testkit.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def f16(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    return prepare_f16(str(write_tiny_checkpoint(root / "src", "qwen2")), root / "work")


@pytest.fixture
def io_log(monkeypatch) -> list[tuple]:
    """Every fsync (of which inode) and every rename (which inode, to where), in order. A spy on
    os.fsync rather than a real crash: no test can cut the power between a rename and the disk."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        st = os.stat(src)
        events.append(("replace", (st.st_dev, st.st_ino), Path(dst)))
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def assert_durable(events: list[tuple], dst: Path) -> None:
    """What was renamed to DST (every file of it, for a directory) was fsynced before the rename,
    and DST's directory after it, so the rename itself is on disk."""
    renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == dst]
    assert len(renames) == 1, events
    i = renames[0]
    before = {e[1] for e in events[:i] if e[0] == "fsync"}
    assert events[i][1] in before
    assert {inode(p) for p in dst.rglob("*") if p.is_file()} <= before
    assert ("fsync", inode(dst.parent)) in events[i + 1:]


def _gguf(tmp: Path, f16: Path) -> Path:
    return prepare_f16(str(write_tiny_checkpoint(tmp / "src", "llama")), tmp / "work")


def _text(tmp: Path, f16: Path) -> Path:
    report.write_text_atomic(tmp / "costs.json", "[]\n")
    return tmp / "costs.json"


def _imatrix(tmp: Path, f16: Path) -> Path:
    return Imatrix(values={"blk.0.attn_q.weight": np.ones(64, np.float32)}, tokens=1, chunks=1).save(tmp / "im.npz")


def _quantized(tmp: Path, f16: Path) -> Path:
    return quantize(f16, tmp / "q8.gguf", ftype="Q8_0", overrides={}, imatrix=None, n_threads=1)


def _kept_f16(tmp: Path, f16: Path) -> Path:
    pipeline._copy_atomic(f16, tmp / "kept.gguf")
    return tmp / "kept.gguf"


def _hf_fixture(tmp: Path, f16: Path) -> Path:
    return make_hf_fixture(f16, tmp / "fixture", shard_bytes=1 << 16)


@pytest.mark.parametrize("write", [_gguf, _text, _imatrix, _quantized, _kept_f16, _hf_fixture],
                         ids=lambda f: f.__name__.strip("_"))
def test_every_write_is_fsynced_before_its_rename(tmp_path, f16, io_log, write):
    dst = write(tmp_path, f16)
    assert dst.exists()
    assert_durable(io_log, dst)
    assert not [p for p in dst.parent.iterdir() if ".part" in p.name]


_KILL_MID_WRITE = """
import os, signal, sys
from edgerun.convert.source import prepare_f16

def die(label, done, total):
    if label == "write GGUF" and done == 5:
        os.kill(os.getpid(), signal.SIGKILL)

prepare_f16(sys.argv[1], sys.argv[2], progress=die)
"""


def test_killed_writer_leaves_no_output_and_the_next_run_sweeps_its_temp(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "llama")
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-c", _KILL_MID_WRITE, str(src), str(work)], timeout=300)
    assert proc.returncode == -signal.SIGKILL
    left = list(work.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".") and left[0].stat().st_size > 0  # its temp, never the GGUF

    out = prepare_f16(str(src), work)
    assert list(work.iterdir()) == [out]
    assert len(gguf.GGUFReader(out).tensors) > 5


def test_only_dead_writers_temps_are_swept(tmp_path):
    dst = tmp_path / "report.json"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".{dst.name}.{int(gone.stdout)}.0123abcd.part"
    live = tmp_path / f".{dst.name}.{os.getpid()}.4567cdef.part"
    beside = tmp_path / f"{dead.name}.imatrix.npz"  # what quantize writes beside its temp
    foreign = tmp_path / f".{dst.name}.{int(gone.stdout)}.notes.part"  # not a name temp_name makes
    for path in (dead, live, beside, foreign):
        path.write_text("some bytes")
    report.write_text_atomic(dst, "{}\n")
    assert dst.read_text() == "{}\n"
    assert live.exists() and foreign.exists() and not dead.exists() and not beside.exists()
