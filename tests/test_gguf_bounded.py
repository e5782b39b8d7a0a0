"""gguf_bounded: validation stays cheap on hostile metadata. A file of a few MB with millions of
array items, hundreds of thousands of strings or tokens, nested arrays, or tens of thousands of
tensors is refused or accepted in a number of reads that grows with its keys, never with its
items, and in little memory, each measured in a child process of its own (peak RSS growth, so
nothing earlier in the process hides it; Linux's /proc/self/status). gguf-py's own parse read
item by item: millions of reads and gigabytes for these files. The CPU time is printed (at most
about 0.3 s a file on a 2-core CPU, against a 2 s goal), not asserted: it depends on the machine."""

from __future__ import annotations

import functools
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType as VT

from edgerun.errors import InvalidModelFile
from edgerun.models.gguf_bounded import MAX_KEYS, MAX_TENSORS
from edgerun.models.gguf_check import inspect

pytestmark = pytest.mark.usefixtures("edgerun_home")

SIZE = 4 << 20
READS_PER_KEY, READS_FIXED = 5, 16  # measured: 35 reads for 7 keys, 16389 for 4096
MAX_RSS_GROWTH = 64 << 20  # ~10x the largest file here; gguf-py's own parse needed gigabytes
HANG_S = 60  # a child still running after this is a hang, whatever its CPU time

# One child imports the checker once, then forks a child of its own per file (importing gguf-py
# and numpy is most of a fresh process's CPU). Peak RSS from VmHWM: a forked child's starts afresh
# at its RSS at the fork (and at exec), where getrusage's ru_maxrss keeps the parent's.
MEASURE = """
import json, os, resource, sys, time, traceback
from edgerun.errors import InvalidModelFile
from edgerun.models import gguf_bounded
from edgerun.models.gguf_check import inspect

reads = 0
real_get = gguf_bounded.BoundedReader._get

def counted_get(self, *args, **kwargs):  # every bounded read of the file goes through _get
    global reads
    reads += 1
    return real_get(self, *args, **kwargs)

gguf_bounded.BoundedReader._get = counted_get

def peak():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

def measure(path, home, out):
    os.environ["EDGERUN_HOME"] = home  # a memo of its own per file
    peak_before, cpu_before = peak(), cpu()
    try:
        inspect(path)
        outcome = "accepted"
    except InvalidModelFile as exc:
        outcome = str(exc)
    with open(out, "w") as f:
        json.dump({"outcome": outcome, "cpu_s": cpu() - cpu_before, "rss_growth": peak() - peak_before,
                   "reads": reads}, f)

hang_s = float(sys.argv[1])
for path, home, out in zip(*[iter(sys.argv[2:])] * 3):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            measure(path, home, out)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + hang_s  # still running after this is a hang, whatever its CPU time
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print(f"{path}: still running after {hang_s:g} s", file=sys.stderr)
            break
        time.sleep(0.01)
"""


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _kv(key: str, vtype: VT, payload: bytes) -> bytes:
    return _s(key.encode()) + struct.pack("<I", vtype) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, VT.UINT32, struct.pack("<I", value))


def _array(key: str, item: VT, count: int, body: bytes) -> bytes:
    return _kv(key, VT.ARRAY, struct.pack("<IQ", item, count) + body)


def _gguf(kvs: list[bytes], n_tensors: int = 0, infos: bytes = b"", data: bytes = b"") -> bytes:
    """A GGUF v3 file of a small valid llama header plus KVS (and tensor infos)."""
    head = [_kv("general.architecture", VT.STRING, _s(b"llama")), _u32("llama.block_count", 1),
            _u32("llama.context_length", 64), _u32("llama.embedding_length", 64),
            _u32("llama.attention.head_count", 4), _kv("tokenizer.ggml.model", VT.STRING, _s(b"llama"))]
    kvs = head + kvs
    body = struct.pack("<4sIQQ", b"GGUF", 3, n_tensors, len(kvs)) + b"".join(kvs) + infos
    return body + b"\0" * (-len(body) % 32) + data


@functools.cache  # built once at collection (for the names) and reused by the fixture: ~0.3 s of CPU
def hostile_files() -> dict[str, bytes]:
    n_bytes, n_strings = SIZE - 300, (SIZE - 300) // 8
    tokens = b"".join(_s(b"%06d" % i) for i in range((SIZE - 300) // 14))
    n_tensors = MAX_TENSORS
    infos = b"".join(_s(b"t%05d" % i) + struct.pack("<IQIQ", 1, 32, 0, 128 * i) for i in range(n_tensors))
    return {
        "4M-uint8-items": _gguf([_array("x.bytes", VT.UINT8, n_bytes, bytes(n_bytes))]),
        "1M-int32-token-types": _gguf([_array("tokenizer.ggml.token_type", VT.INT32, n_bytes // 4, bytes(n_bytes))]),
        "500k-empty-strings": _gguf([_array("x.strings", VT.STRING, n_strings, bytes(8 * n_strings))]),
        "500k-empty-tokens": _gguf([_array("tokenizer.ggml.tokens", VT.STRING, n_strings, bytes(8 * n_strings))]),
        "300k-unique-tokens": _gguf([_array("tokenizer.ggml.tokens", VT.STRING, len(tokens) // 14, tokens)]),
        "300k-repeated-tokens": _gguf([_array("tokenizer.ggml.tokens", VT.STRING, len(tokens) // 14,
                                              _s(b"000000") * (len(tokens) // 14))]),
        "350k-nested-arrays": _gguf([_array("x.nested", VT.ARRAY, (SIZE - 300) // 12,
                                            struct.pack("<IQ", VT.UINT8, 0) * ((SIZE - 300) // 12))]),
        "keys-at-the-cap": _gguf([_u32(f"x.k{i:05d}", i) for i in range(MAX_KEYS - 6)]),
        "tensors-at-the-cap": _gguf([], n_tensors, infos, bytes(128 * n_tensors)),
    }


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    files = {}
    for name, blob in hostile_files().items():
        files[name] = root / f"{name}.gguf"
        files[name].write_bytes(blob)
    return files


@pytest.fixture(scope="module")
def measured(hostile, tmp_path_factory) -> dict[str, dict | str]:
    """Each hostile file's outcome, CPU, peak RSS growth and reads, each inspected in a child of its
    own (a fork of one child that imported the checker), each with an EDGERUN_HOME of its own;
    a file whose child failed or hung maps to the driver's stderr."""
    root = tmp_path_factory.mktemp("measured")
    args = []
    for name, path in hostile.items():
        args += [str(path), str(root / name / "home"), str(root / f"{name}.json")]
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(HANG_S), *args], capture_output=True, text=True,
                          timeout=HANG_S * (len(hostile) + 1))
    results = {}
    for name in hostile:
        out = root / f"{name}.json"
        results[name] = json.loads(out.read_text()) if out.exists() else f"no result: {proc.stderr[-2000:]}"
    return results


@pytest.mark.parametrize("name", sorted(hostile_files()))
def test_hostile_metadata_is_judged_quickly_in_little_memory(measured, hostile, name):
    path = hostile[name]
    got = measured[name]
    assert isinstance(got, dict), got
    assert got["outcome"] == "accepted" or len(got["outcome"].splitlines()) == 1, got
    n_kv = struct.unpack_from("<4sIQQ", path.read_bytes(), 0)[3]
    print(f"\n{name}: {got['cpu_s']:.2f} s of CPU, {got['reads']} reads for {n_kv} keys")
    assert got["reads"] <= READS_PER_KEY * n_kv + READS_FIXED, f"{name}: {got['reads']} reads for {n_kv} keys"
    assert got["rss_growth"] < MAX_RSS_GROWTH, f"{name}: RSS grew {got['rss_growth'] >> 20} MiB"


def test_repeated_tokens_are_refused(hostile):
    """llama.cpp asserts every token's text is unique: the 300k-fold repetition is refused."""
    with pytest.raises(InvalidModelFile, match="repeats the token"):
        inspect(hostile["300k-repeated-tokens"])
