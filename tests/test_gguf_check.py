"""gguf_check: a small valid GGUF is read right, and every malformed one is refused with one clear
line (InvalidModelFile), in a bounded number of reads, in-process and through the CLI, without
crashing the process.

The malformed files are made by byte-patching one valid file that GGUFWriter wrote, at offsets a
small struct walker finds, so each case is exactly the one malformation its name says."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from edgerun.errors import InvalidModelFile, ModelNotFound
from edgerun.models import gguf_bounded, gguf_check
from edgerun.models.gguf_check import inspect
from testkit.cli import run_cli

N_VOCAB, N_EMBD, N_HEAD, N_HEAD_KV, N_CTX = 300, 64, 4, 2, 256
N_EMBD_KV = N_EMBD // N_HEAD * N_HEAD_KV
ALIGN = 32
EDGERUN = Path(sys.executable).with_name("edgerun")
# A refusal takes at most this many reads of the file (gguf_bounded's _get; the valid file takes
# 72, the most any of the ~400 malformed cases takes is 76): a reader walking a hostile count item
# by item would take millions. Only a case still
# running after HUNG_AFTER is stopped, as a hang: a guard, not a measure of speed.
MAX_READS = 1000
HUNG_AFTER = 60.0
MAX_PEAK_BYTES = 32 << 20  # Python/numpy allocations while refusing one case (the memmap is free)

# weight bytes the fixture's tensors take: per repeating block, and outside the blocks
Q8_0_BYTES = N_EMBD_KV * N_EMBD // 32 * 34
LAYER_BYTES = N_EMBD * N_EMBD * 4 + Q8_0_BYTES  # attn_q F32 + attn_k Q8_0
OTHER_BYTES = N_VOCAB * N_EMBD * 2 + N_EMBD * 4  # token_embd F16 + output_norm F32


# ---------------------------------------------------------------------------------------------
# the valid file


def write_gguf(path: Path, *, override: dict[str, tuple] | None = None) -> Path:
    """A tiny llama-shaped GGUF. `override` maps a key to (value, type[, item type]) to write
    instead, so a wrongly-typed field can be made by the real writer."""
    kv: dict[str, tuple] = {
        "general.name": ("tiny-test", VT.STRING),
        "general.file_type": (1, VT.UINT32),  # MOSTLY_F16
        "general.alignment": (ALIGN, VT.UINT32),
        "llama.block_count": (2, VT.UINT32),
        "llama.context_length": (N_CTX, VT.UINT32),
        "llama.embedding_length": (N_EMBD, VT.UINT32),
        "llama.feed_forward_length": (4 * N_EMBD, VT.UINT32),
        "llama.attention.head_count": (N_HEAD, VT.UINT32),
        "llama.attention.head_count_kv": (N_HEAD_KV, VT.UINT32),
        "tokenizer.ggml.model": ("llama", VT.STRING),
        "tokenizer.ggml.tokens": (["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(3, N_VOCAB)], VT.ARRAY, VT.STRING),
        "tokenizer.ggml.scores": ([-float(i) for i in range(N_VOCAB)], VT.ARRAY, VT.FLOAT32),
        "tokenizer.ggml.token_type": ([2, 3, 3] + [1] * (N_VOCAB - 3), VT.ARRAY, VT.INT32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", VT.STRING),
    }
    kv.update(override or {})
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    for key, (value, vtype, *item) in kv.items():
        w.add_key_value(key, value, vtype, sub_type=item[0] if item else None)
    w.add_tensor("token_embd.weight", rng.standard_normal((N_VOCAB, N_EMBD)).astype(np.float16))
    for layer in range(2):
        w.add_tensor(f"blk.{layer}.attn_q.weight", rng.standard_normal((N_EMBD, N_EMBD)).astype(np.float32))
        k = gguf.quants.quantize(rng.standard_normal((N_EMBD_KV, N_EMBD)).astype(np.float32), QT.Q8_0)
        w.add_tensor(f"blk.{layer}.attn_k.weight", k, raw_dtype=QT.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------
# where things are in it: a walker for the test's own bytes (gguf_check itself uses gguf-py)

_SCALAR = {VT.UINT8: 1, VT.INT8: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4,
           VT.FLOAT32: 4, VT.BOOL: 1, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8}


def u32(blob, at: int) -> int:
    return struct.unpack_from("<I", blob, at)[0]


def u64(blob, at: int) -> int:
    return struct.unpack_from("<Q", blob, at)[0]


@dataclass
class KV:
    start: int  # the key's length field
    key: int  # the key's first byte
    type: int  # the value-type field
    value: int  # the value (for a string: its length field; for an array: its item-type field)
    end: int


@dataclass
class TensorInfo:
    start: int  # the name's length field
    name: int  # the name's first byte
    n_dims: int
    dims: list[int]  # offset of each dimension field
    type: int
    offset: int  # the data-offset field
    end: int
    nbytes: int
    rel_offset: int


def _skip_value(blob, at: int, vtype: int) -> int:
    if vtype in _SCALAR:
        return at + _SCALAR[VT(vtype)]
    if vtype == VT.STRING:
        return at + 8 + u64(blob, at)
    assert vtype == VT.ARRAY
    item, count, at = u32(blob, at), u64(blob, at + 4), at + 12
    if item in _SCALAR:
        return at + count * _SCALAR[VT(item)]
    for _ in range(count):
        at = _skip_value(blob, at, item)
    return at


class Layout:
    """Byte offsets of every field of a (valid) GGUF file."""

    def __init__(self, blob: bytes):
        self.size = len(blob)
        n_tensors, n_kv = struct.unpack_from("<QQ", blob, 8)
        self.kv: dict[str, KV] = {}
        at = 24
        for _ in range(n_kv):
            klen = u64(blob, at)
            key = blob[at + 8:at + 8 + klen].decode()
            t = at + 8 + klen
            end = _skip_value(blob, t + 4, u32(blob, t))
            self.kv[key] = KV(at, at + 8, t, t + 4, end)
            at = end
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            nlen = u64(blob, at)
            name = blob[at + 8:at + 8 + nlen].decode()
            nd = at + 8 + nlen
            n_dims = u32(blob, nd)
            dims = [nd + 4 + 8 * i for i in range(n_dims)]
            ty = nd + 4 + 8 * n_dims
            ne = [u64(blob, d) for d in dims]
            block, type_size = GGML_QUANT_SIZES[QT(u32(blob, ty))]
            nbytes = int(np.prod(ne)) // block * type_size
            self.tensors[name] = TensorInfo(at, at + 8, nd, dims, ty, ty + 4, ty + 12, nbytes, u64(blob, ty + 4))
            at = ty + 12
        self.infos_end = at
        self.data_offset = -(-at // ALIGN) * ALIGN
        self.data_end = max(self.data_offset + t.rel_offset + t.nbytes for t in self.tensors.values())


def patch(blob: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(blob)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def splice(blob: bytes, lay: Layout, at: int, remove: int, insert: bytes) -> bytes:
    """Replace bytes inside the structure region, re-padding it so the tensor data keeps its
    alignment (for malformations that change the length of a field)."""
    assert at + remove <= lay.infos_end
    head = blob[:at] + insert + blob[at + remove:lay.infos_end]
    head += b"\0" * (-len(head) % ALIGN)
    return head + blob[lay.data_offset:]


def rename(blob: bytes, lay: Layout, key: str, new: str) -> bytes:
    """Rename a key to one of the same length (nothing else moves)."""
    assert len(new) == len(key)
    k = lay.kv[key].key
    return blob[:k] + new.encode() + blob[k + len(key):]


def set_string(blob: bytes, lay: Layout, key: str, new: bytes) -> bytes:
    """Give a string-valued key a new value of any length."""
    kv = lay.kv[key]
    return splice(blob, lay, kv.value, kv.end - kv.value, struct.pack("<Q", len(new)) + new)


# ---------------------------------------------------------------------------------------------
# the corpus: name -> (make the bad bytes from the good ones, a word the refusal must contain)

Maker = Callable[[bytes, Layout], bytes]
CASES: dict[str, tuple[Maker, str]] = {}


def case(name: str, expect: str = "") -> Callable[[Maker], Maker]:
    def register(make: Maker) -> Maker:
        CASES[name] = (make, expect)
        return make
    return register


def simple(name: str, make: Maker, expect: str = "") -> None:
    CASES[name] = (make, expect)


simple("bad-magic", lambda b, lay: b"GGUG" + b[4:], "magic")
simple("bad-magic-zeros", lambda b, lay: b"\0\0\0\0" + b[4:], "magic")
simple("ggml-magic", lambda b, lay: b"lmgg" + b[4:], "magic")
for _v in (0, 1, 99, 3 << 24):  # 3 << 24: a big-endian v3 file
    simple(f"version-{_v}", lambda b, lay, v=_v: patch(b, 4, "<I", v), "version")
simple("huge-tensor-count", lambda b, lay: patch(b, 8, "<Q", 2**63), "tensor")
simple("max-tensor-count", lambda b, lay: patch(b, 8, "<Q", 2**64 - 1), "tensor")
simple("huge-kv-count", lambda b, lay: patch(b, 16, "<Q", 2**62), "key")
simple("tensor-count-plus-one", lambda b, lay: patch(b, 8, "<Q", len(lay.tensors) + 1))
simple("kv-count-plus-one", lambda b, lay: patch(b, 16, "<Q", len(lay.kv) + 1))
simple("huge-key-length", lambda b, lay: patch(b, lay.kv["general.name"].start, "<Q", 2**62))
simple("huge-string-length", lambda b, lay: patch(b, lay.kv["general.name"].value, "<Q", 2**63))
simple("string-length-past-end", lambda b, lay: patch(b, lay.kv["general.name"].value, "<Q", lay.size))
simple("huge-tensor-name-length", lambda b, lay: patch(b, lay.tensors["output_norm.weight"].start, "<Q", 2**63))
simple("huge-string-array-count",
       lambda b, lay: patch(b, lay.kv["tokenizer.ggml.tokens"].value + 4, "<Q", 2**62), "array")
simple("huge-int32-array-count",
       lambda b, lay: patch(b, lay.kv["tokenizer.ggml.token_type"].value + 4, "<Q", 2**63), "array")
simple("max-float-array-count",
       lambda b, lay: patch(b, lay.kv["tokenizer.ggml.scores"].value + 4, "<Q", 2**64 - 1), "array")
simple("int32-array-count-x1000",
       lambda b, lay: patch(b, lay.kv["tokenizer.ggml.token_type"].value + 4, "<Q", N_VOCAB * 1000), "array")
simple("unknown-value-type", lambda b, lay: patch(b, lay.kv["general.name"].type, "<I", 99))
simple("unknown-array-item-type", lambda b, lay: patch(b, lay.kv["tokenizer.ggml.token_type"].value, "<I", 99))
simple("bad-utf8-key", lambda b, lay: patch(b, lay.kv["general.name"].key, "<B", 0xFF))
simple("bad-utf8-tensor-name", lambda b, lay: patch(b, lay.tensors["output_norm.weight"].name, "<B", 0xFF))
simple("duplicate-key", lambda b, lay: rename(b, lay, "llama.block_count", "general.file_type"))
simple("duplicate-tensor-name",
       lambda b, lay: b[:lay.tensors["blk.1.attn_q.weight"].name] + b"blk.0.attn_q.weight"
       + b[lay.tensors["blk.1.attn_q.weight"].name + len("blk.1.attn_q.weight"):])
simple("tensor-offset-past-end",
       lambda b, lay: patch(b, lay.tensors["output_norm.weight"].offset, "<Q", lay.size), "past the end")
simple("tensor-offset-huge",
       lambda b, lay: patch(b, lay.tensors["blk.0.attn_q.weight"].offset, "<Q", 2**63), "past the end")
simple("tensor-offset-overlaps",
       lambda b, lay: patch(b, lay.tensors["blk.1.attn_q.weight"].offset, "<Q", 0), "offset")
simple("tensor-offset-misaligned",
       lambda b, lay: patch(b, lay.tensors["blk.1.attn_q.weight"].offset, "<Q",
                            lay.tensors["blk.1.attn_q.weight"].rel_offset + 4), "offset")
simple("tensor-n-dims-huge", lambda b, lay: patch(b, lay.tensors["blk.0.attn_q.weight"].n_dims, "<I", 2**31))
simple("tensor-zero-dim", lambda b, lay: patch(b, lay.tensors["blk.0.attn_q.weight"].dims[1], "<Q", 0), "shape")
simple("tensor-dims-overflow-u64",  # 2**32 * 2**32 wraps a uint64 product to 0
       lambda b, lay: patch(patch(b, lay.tensors["blk.0.attn_q.weight"].dims[0], "<Q", 2**32),
                            lay.tensors["blk.0.attn_q.weight"].dims[1], "<Q", 2**32))
simple("tensor-dim-huge", lambda b, lay: patch(b, lay.tensors["output_norm.weight"].dims[0], "<Q", 2**62))
simple("tensor-unknown-type", lambda b, lay: patch(b, lay.tensors["blk.0.attn_q.weight"].type, "<I", 9999))
simple("tensor-removed-type-q4_2", lambda b, lay: patch(b, lay.tensors["blk.0.attn_q.weight"].type, "<I", 4))
simple("tensor-type-changed-f32-to-f16",
       lambda b, lay: patch(b, lay.tensors["blk.0.attn_q.weight"].type, "<I", QT.F16), "offset")
simple("q8_0-row-not-multiple-of-block",
       lambda b, lay: patch(b, lay.tensors["blk.0.attn_k.weight"].dims[0], "<Q", 48))
simple("unknown-architecture", lambda b, lay: set_string(b, lay, "general.architecture", b"llamb"), "architecture")
simple("architecture-with-newline",
       lambda b, lay: set_string(b, lay, "general.architecture", b"ll\nma\r\x85\xe2\x80\xa8x"), "architecture")
simple("architecture-1mb-long", lambda b, lay: set_string(b, lay, "general.architecture", b"x" * 2**20), "architecture")
simple("missing-architecture",
       lambda b, lay: rename(b, lay, "general.architecture", "general.architectur_"), "general.architecture")
simple("alignment-zero", lambda b, lay: patch(b, lay.kv["general.alignment"].value, "<I", 0), "align")
simple("alignment-not-power-of-two", lambda b, lay: patch(b, lay.kv["general.alignment"].value, "<I", 48), "align")
simple("alignment-2GiB", lambda b, lay: patch(b, lay.kv["general.alignment"].value, "<I", 2**31))
simple("empty-file", lambda b, lay: b"", "bytes")
simple("magic-only", lambda b, lay: b[:4], "bytes")
simple("header-only", lambda b, lay: b[:24])
simple("zeros-same-size", lambda b, lay: bytes(len(b)), "magic")


@case("architecture-not-a-string", "architecture")
def _arch_uint32(b: bytes, lay: Layout) -> bytes:
    kv = lay.kv["general.architecture"]
    return splice(b, lay, kv.type, kv.end - kv.type, struct.pack("<II", VT.UINT32, 7))


@case("tensor-five-dims", "shape")
def _five_dims(b: bytes, lay: Layout) -> bytes:
    # the same 64x64 tensor, described with three more dimensions of 1
    t = lay.tensors["blk.0.attn_q.weight"]
    b = patch(b, t.n_dims, "<I", 5)
    return splice(b, lay, t.type, 0, struct.pack("<QQQ", 1, 1, 1))


@case("tensor-name-too-long", "name")
def _long_name(b: bytes, lay: Layout) -> bytes:
    # llama.cpp keeps tensor names in 64-byte buffers
    t = lay.tensors["output_norm.weight"]
    name = b"output_norm." + b"x" * 60 + b".weight"
    return splice(b, lay, t.start, t.n_dims - t.start, struct.pack("<Q", len(name)) + name)


# wrongly-typed metadata, written by GGUFWriter itself (key -> override)
TYPED_CASES = {
    "block-count-is-a-string": ("llama.block_count", ("two", VT.STRING)),
    "block-count-negative": ("llama.block_count", (-2, VT.INT32)),
    "context-length-is-a-float": ("llama.context_length", (256.5, VT.FLOAT32)),
    "context-length-is-an-array": ("llama.context_length", ([256, 512], VT.ARRAY, VT.UINT32)),
    "head-count-is-a-string": ("llama.attention.head_count", ("4", VT.STRING)),
    "chat-template-is-a-number": ("tokenizer.chat_template", (7, VT.UINT32)),
}


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(autouse=True)
def _edgerun_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("valid") / "tiny.gguf")


@pytest.fixture(scope="module")
def valid_bytes(valid) -> bytes:
    return valid.read_bytes()


@pytest.fixture(scope="module")
def layout(valid_bytes) -> Layout:
    return Layout(valid_bytes)


def truncation_points(lay: Layout) -> list[int]:
    """Every offset of the first 64 bytes, a step through the rest of the structure region, and a
    spread through the tensor data (short of its end: padding after the last tensor is optional)."""
    head = set(range(64)) | set(range(64, lay.data_offset + 1, 37))
    head |= {kv.start for kv in lay.kv.values()} | {t.start for t in lay.tensors.values()}
    head |= {lay.infos_end - 1, lay.infos_end, lay.data_offset - 1}
    data = set(np.linspace(lay.data_offset + 1, lay.data_end - 1, 60).astype(int).tolist())
    data |= {lay.data_offset + t.rel_offset + t.nbytes - 1 for t in lay.tensors.values()}
    return sorted(p for p in head | data if p < lay.data_end)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, valid_bytes, layout) -> dict[str, Path]:
    """Every malformed file, by name (truncations are named trunc-<offset>)."""
    root = tmp_path_factory.mktemp("corpus")
    files: dict[str, Path] = {}
    for name, (make, _) in CASES.items():
        files[name] = root / f"{name}.gguf"
        files[name].write_bytes(make(valid_bytes, layout))
    for name, (key, override) in TYPED_CASES.items():
        files[name] = write_gguf(root / f"{name}.gguf", override={key: override})
    for at in truncation_points(layout):
        files[f"trunc-{at}"] = root / f"trunc-{at}.gguf"
        files[f"trunc-{at}"].write_bytes(valid_bytes[:at])
    (root / "a-directory.gguf").mkdir()
    files["directory"] = root / "a-directory.gguf"
    files["missing"] = root / "no-such-file.gguf"
    return files


class Hung(BaseException):
    """Raised into a case that runs too long; not an Exception, so gguf_check's broad
    `except Exception` around gguf-py cannot turn it into a refusal."""


@contextlib.contextmanager
def deadline(seconds: float = HUNG_AFTER):
    def expire(*_):
        raise Hung(f"still running after {seconds} s (gguf-py looping on a huge count?)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def counted_reads():
    """A list that grows by one for each bounded read of the file while the block runs."""
    reads: list[None] = []
    real_get = gguf_bounded.BoundedReader._get

    def counted_get(self, *args, **kwargs):
        reads.append(None)
        return real_get(self, *args, **kwargs)

    gguf_bounded.BoundedReader._get = counted_get
    try:
        yield reads
    finally:
        gguf_bounded.BoundedReader._get = real_get


def assert_refused(path: Path, expect: str = "") -> str:
    """inspect() refuses the file in a bounded number of reads, with one line that names it;
    returns the line."""
    with pytest.raises(InvalidModelFile) as caught, deadline(), counted_reads() as reads:
        inspect(path)
    msg = str(caught.value)
    assert len(msg.splitlines()) == 1 and msg.isprintable(), f"not one printable line: {msg[:300]!r}"
    assert str(path.resolve()) in msg, msg[:300]
    said = msg.replace(str(path.resolve()), "<file>").lower()  # the file's name would match anything
    assert expect.lower() in said, f"{path.name}: expected {expect!r} in {said[:300]!r}"
    assert len(msg) < 400, msg[:300]
    assert len(reads) <= MAX_READS, f"{path.name}: {len(reads)} reads"
    return msg


# ---------------------------------------------------------------------------------------------
# the valid file


def test_valid_file_is_read_right(valid):
    info = inspect(valid)
    assert info.path == valid.resolve()
    assert info.size == valid.stat().st_size
    assert info.arch == "llama"
    assert info.name == "tiny-test"
    assert info.n_layers == 2
    assert info.layer_bytes == (LAYER_BYTES, LAYER_BYTES)
    assert info.other_bytes == OTHER_BYTES
    assert info.context_length == N_CTX
    assert info.n_embd == N_EMBD
    assert info.n_head_kv == N_HEAD_KV
    assert info.head_dim == N_EMBD // N_HEAD
    assert info.n_vocab == N_VOCAB
    assert info.file_type == "F16"
    assert info.chat_template and "messages" in info.chat_template
    assert info.data_offset == Layout(valid.read_bytes()).data_offset


def test_per_layer_head_counts_are_accepted(tmp_path):
    """llama.cpp takes per-layer arrays for head counts (OpenELM, DeciLM, Jamba): not malformed."""
    path = write_gguf(tmp_path / "per-layer.gguf", override={
        "llama.attention.head_count": ([N_HEAD, N_HEAD], VT.ARRAY, VT.INT32),
        "llama.attention.head_count_kv": ([N_HEAD_KV, N_HEAD_KV // 2], VT.ARRAY, VT.INT32),
    })
    info = inspect(path)
    assert info.n_layers == 2 and info.n_head_kv >= 1


def test_layout_walker_agrees_with_gguf_py(valid, layout):
    """The corpus is only as exact as the walker that places its patches."""
    reader = gguf.GGUFReader(valid)
    assert reader.data_offset == layout.data_offset
    assert {f.name: f.offset for f in reader.fields.values() if not f.name.startswith("GGUF.")} == \
        {k: kv.start for k, kv in layout.kv.items()}
    for t in reader.tensors:
        assert t.data_offset == layout.data_offset + layout.tensors[t.name].rel_offset
        assert t.n_bytes == layout.tensors[t.name].nbytes
    assert layout.data_end == layout.size  # every tensor fills whole alignment units


# ---------------------------------------------------------------------------------------------
# the corpus, in-process


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_file_is_refused(corpus, name):
    assert_refused(corpus[name], CASES[name][1])


@pytest.mark.parametrize("name", sorted(TYPED_CASES))
def test_wrongly_typed_metadata_is_refused(corpus, name):
    key = TYPED_CASES[name][0]
    assert_refused(corpus[name], key)


def test_truncated_file_is_refused_at_every_offset(corpus, layout):
    points = truncation_points(layout)
    assert len(points) >= 200
    for at in points:
        assert_refused(corpus[f"trunc-{at}"])


def test_directory_and_missing_path(corpus):
    assert_refused(corpus["directory"], "regular file")
    with pytest.raises(ModelNotFound, match="no such file"):
        inspect(corpus["missing"])


def test_unreadable_file_is_refused(valid, monkeypatch):
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_check, "open", denied, raising=False)  # tests run as root, so chmod won't do
    assert_refused(valid, "cannot read")


@pytest.mark.parametrize("name", ["huge-int32-array-count", "max-float-array-count", "huge-string-array-count",
                                  "kv-count-plus-one", "tensor-n-dims-huge", "tensor-dims-overflow-u64",
                                  "alignment-2GiB", "architecture-1mb-long"])
def test_refusal_needs_little_memory(corpus, name):
    """Huge counts and sizes are refused before anything is allocated for them."""
    tracemalloc.start()
    try:
        with pytest.raises(InvalidModelFile), deadline():
            inspect(corpus[name])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_PEAK_BYTES, f"{name}: peak {peak >> 20} MiB"


def test_nothing_but_refusals_from_the_whole_corpus(corpus, valid_bytes, layout, tmp_path):
    """Any exception other than InvalidModelFile/ModelNotFound is a bug in gguf_check; so are
    random one-byte and eight-byte corruptions of the structure region (which may stay valid)."""
    bugs = []

    def check(path: Path, must_refuse: bool) -> None:
        try:
            with deadline():
                inspect(path)
            if must_refuse:
                bugs.append(f"{path.name}: accepted")
        except (InvalidModelFile, ModelNotFound):
            pass
        except Exception as exc:  # noqa: BLE001 - reporting exactly these is the point
            bugs.append(f"{path.name}: {type(exc).__name__}: {exc}")

    for path in corpus.values():
        check(path, must_refuse=True)
    rng = random.Random(1234)
    mutant = tmp_path / "mutant.gguf"
    for i in range(300):
        at = rng.randrange(24, layout.data_offset - 8)
        if i % 3:
            blob = patch(valid_bytes, at, "<B", rng.randrange(256))
        else:
            blob = patch(valid_bytes, at, "<Q", rng.choice([0, 2**31, 2**32, 2**63, 2**64 - 1, rng.getrandbits(64)]))
        mutant.write_bytes(blob)
        check(mutant, must_refuse=False)
    assert not bugs, "\n".join(bugs)


# ---------------------------------------------------------------------------------------------
# the corpus, through the CLI

CLI_CASES = [
    "empty-file", "bad-magic", "version-99", "huge-tensor-count", "huge-kv-count",
    "huge-string-length", "huge-int32-array-count", "tensor-offset-past-end", "tensor-five-dims",
    "tensor-zero-dim", "unknown-architecture", "architecture-with-newline", "missing-architecture",
    "block-count-is-a-string", "directory", "missing",
]
# also run as real edgerun processes, side by side: the kinds llama.cpp would abort on, where the
# exit status (an error code, not a signal) is the process's own
IN_A_PROCESS = ["huge-tensor-count", "tensor-offset-past-end", "tensor-five-dims", "unknown-architecture"]


def _cli_problems(name: str, path: Path, code: int, out: str, err: str) -> list[str]:
    lines = err.splitlines()
    problems = []
    if code <= 0:
        problems.append(f"{name}: exit code {code}")
    if "Traceback" in err or len(lines) != 1 or not lines[0].startswith("edgerun: error: "):
        problems.append(f"{name}: stderr {err!r}")
    elif path.name not in lines[0]:
        problems.append(f"{name}: the error does not name the file: {lines[0]!r}")
    if out:
        problems.append(f"{name}: stdout {out!r}")
    return problems


def test_cli_refuses_without_crashing(corpus, tmp_path, monkeypatch, capsys):
    """`edgerun run` on a bad file exits with an error code (not a signal), one `edgerun: error:`
    line naming the file on stderr, and no traceback: every case through cli.main, the
    IN_A_PROCESS ones also as processes (started first, so they run while the others are read)."""
    if not EDGERUN.exists():
        pytest.skip(f"no edgerun script next to {sys.executable}")
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "cli-home"))
    procs = {
        name: subprocess.Popen(
            [str(EDGERUN), "run", "hi", "-m", str(corpus[name]), "-n", "1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy(),
            text=True,
        )
        for name in IN_A_PROCESS
    }
    problems = []
    for name in CLI_CASES:
        result = run_cli(capsys, "run", "hi", "-m", str(corpus[name]), "-n", "1")
        problems += _cli_problems(name, corpus[name], result.returncode, result.stdout, result.stderr)
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            problems.append(f"{name}: still running after 60 s")
            continue
        problems += _cli_problems(f"{name} (process)", corpus[name], proc.returncode, out, err)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# the memo


def _memo_files() -> list[Path]:
    return list((Path(os.environ["EDGERUN_HOME"]) / "cache" / "inspected").glob("*.json"))


def test_memo_is_used_for_an_unchanged_file(valid, tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    shutil.copyfile(valid, path)
    first = inspect(path)
    assert len(_memo_files()) == 1
    monkeypatch.setattr(gguf_check, "_parse", lambda *a: pytest.fail("re-parsed an unchanged file"))
    assert inspect(path) == first


def test_memo_does_not_hide_a_structure_change(valid, layout, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(valid, path)
    inspect(path)
    assert _memo_files()
    arch = layout.kv["general.architecture"].value + 8  # the string's first byte: "llama"
    with open(path, "r+b") as f:
        f.seek(arch)
        assert f.read(5) == b"llama"
        f.seek(arch + 4)
        f.write(b"b")  # same size, same data offset: only the structure hash can tell
    assert_refused(path, "unknown architecture 'llamb'")


def test_memo_keeps_a_data_change_valid(valid, layout, tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    shutil.copyfile(valid, path)
    first = inspect(path)
    with open(path, "r+b") as f:
        f.seek(layout.data_offset + 100)
        byte = f.read(1)
        f.seek(layout.data_offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with monkeypatch.context() as m:
        m.setattr(gguf_check, "_parse", lambda *a: pytest.fail("re-parsed after a tensor-data change"))
        assert inspect(path) == first
    for memo in _memo_files():
        memo.unlink()
    assert inspect(path) == first  # and a fresh parse agrees


def test_memo_does_not_hide_truncation(valid, layout, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(valid, path)
    inspect(path)
    with open(path, "r+b") as f:
        f.truncate(layout.data_end - 1)
    assert_refused(path)


def test_memo_from_other_rules_is_not_trusted(tmp_path, monkeypatch):
    """A result remembered under other rules (an older edgerun's, which let zero blocks through)
    is parsed again under today's, which refuse the file."""
    path = write_gguf(tmp_path / "zero-blocks.gguf", override={"llama.block_count": (0, VT.UINT32)})
    with monkeypatch.context() as m:
        m.setattr(gguf_check, "_MEMO_VERSION", "older-rules")
        m.setattr(gguf_check.gguf_hparams, "check", lambda *a: None)
        assert inspect(path).n_layers == 0
    assert len(_memo_files()) == 1
    assert_refused(path, "llama.block_count is 0")


def test_memo_version_follows_the_rules_source(tmp_path):
    """The memo's version is derived from the validator's own source: the same bytes give the
    same version, a changed rule a new one."""
    rules = [Path(p) for p in gguf_check._RULES]
    assert gguf_check._MEMO_VERSION == gguf_check._rules_version()
    copies = [tmp_path / f"{i}-{p.name}" for i, p in enumerate(rules)]
    for src, dst in zip(rules, copies):
        shutil.copyfile(src, dst)
    assert gguf_check._rules_version(tuple(map(str, copies))) == gguf_check._MEMO_VERSION
    hparams = copies[[p.name for p in rules].index("gguf_hparams.py")]
    hparams.write_text(hparams.read_text().replace("LLAMA_MAX_LAYERS = 512", "LLAMA_MAX_LAYERS = 1024"))
    assert gguf_check._rules_version(tuple(map(str, copies))) != gguf_check._MEMO_VERSION
