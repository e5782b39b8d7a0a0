"""Saved KV states: one sequence's llama.cpp KV cache on disk, so a conversation (or a long fixed
prompt) resumes without evaluating its prefix again.

A state file is

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON) | tokens (i32 LE each) | payload | sha256

where the payload is llama.cpp's own serialization of the sequence (llama_state_seq_get_data),
the tokens are what its positions 0..n-1 hold, and the sha256 covers every byte before it. The
header holds the StateKey: what must be equal for the payload to mean the same KV here (the model
file, the context settings that shape the cache, the llama.cpp build). A file is named by its
key and its tokens (`<key digest>-<tokens digest>.kvstate`), so equal states share one file and
the states that could serve a key are found by name.

A file is only ever used whole and checked: the magic, the header, the key, the length (a
truncated file), the checksum (flipped bytes), then llama.cpp's own load and the position count
it restored. Anything else is a StateUnusable with the reason, and the caller prefills instead.
Files are written atomically (convert/atomic.py: a temp fsynced and renamed), so a writer killed
mid-write leaves the old file or none. The directory is kept under a byte cap, least recently
used first (a use sets the file's mtime)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgerun import paths
from edgerun.convert.atomic import atomic_path, sweep

MAGIC = b"EDGERKV\x00"
FORMAT = 1
SUFFIX = ".kvstate"
_LEN = struct.Struct("<I")
_DIGEST = 32  # sha256
_HEADER_MAX = 1 << 20  # a header is a few hundred bytes; more is not a state file
_HEAD_READ = 1 << 16  # read at once when a file's header is wanted (most tokens lists fit)
_MODEL_HEAD = 1 << 20  # bytes of a local model file hashed into its identity


class StateUnusable(Exception):
    """A saved state that must not be restored; str() says why, for the one line a user sees.
    `broken`: the file can never be used (truncated, corrupt), as opposed to one for another
    model or build."""

    def __init__(self, reason: str, *, broken: bool = False):
        super().__init__(reason)
        self.broken = broken


@dataclass(frozen=True)
class StateKey:
    """What must be equal for a saved KV payload to mean the same cache in this context."""

    model: str  # "sha256:<hex>" for a verified catalog file, else "file:<size>:<mtime_ns>:<sha256 of its head>"
    n_ctx: int  # positions per sequence: the cells a state needs and the cache it was cut from
    n_seq: int  # sequences (streams) of the cache
    gpu_layers: int  # where the K and V were computed: another device's kernels round differently
    kv_type: str  # K and V cache element type
    llama: str  # llama-cpp-python's version and libllama's identity

    def digest(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def mismatch(self, saved: StateKey) -> str | None:
        """Why a state saved under `saved` cannot serve this key, in words; None when equal."""
        if saved.model != self.model:
            return "it was saved for another model file"
        if (saved.n_ctx, saved.n_seq) != (self.n_ctx, self.n_seq):
            return f"it was saved with another context size ({saved.n_ctx} x {saved.n_seq}, now {self.n_ctx} x {self.n_seq})"
        if saved.llama != self.llama:
            return f"it was saved by another llama.cpp build ({saved.llama})"
        if saved.gpu_layers != self.gpu_layers:
            return f"it was computed with {saved.gpu_layers} GPU layers, now {self.gpu_layers}"
        if saved.kv_type != self.kv_type:
            return f"its KV type is {saved.kv_type}, now {self.kv_type}"
        return None


@dataclass(frozen=True)
class SavedState:
    """A state file one of a runner's contexts was saved to, as the history records it."""

    role: str  # "target" or "draft"
    key: str  # the StateKey's digest
    name: str  # the file's name in the store
    n_tokens: int
    bytes: int


@dataclass(frozen=True)
class StateInfo:
    """A state file as its header describes it (the payload unread and unchecked)."""

    path: Path
    key: StateKey
    label: str  # the model's name, for listings
    tokens: tuple[int, ...]
    payload_at: int  # where the payload starts
    payload_bytes: int
    size: int  # the whole file's bytes
    used: float  # last written or restored (the file's mtime)

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def tokens_digest(tokens: list[int] | tuple[int, ...]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()[:16]


def file_name(key: StateKey, tokens: list[int] | tuple[int, ...]) -> str:
    return f"{key.digest()}-{tokens_digest(tokens)}{SUFFIX}"


def default_dir() -> Path:
    return paths.kv_dir()


class KvStore:
    """The directory of saved states, at most `max_bytes` (least recently used evicted first)."""

    def __init__(self, root: Path | None = None, *, max_bytes: int, clock: Callable[[], float] = time.time):
        self.root = Path(root) if root is not None else default_dir()
        self.max_bytes = max_bytes
        self._clock = clock

    def path(self, name: str) -> Path:
        """The file of a state's name (a file name or its stem); never outside the store."""
        stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
        if not stem or "/" in stem or stem.startswith("."):
            raise ValueError(f"{name!r} is not a saved state's name")
        return self.root / (stem + SUFFIX)

    # ----- writing ------------------------------------------------------------------------------

    def save(self, key: StateKey, tokens: list[int], payload: bytes | bytearray, *, label: str) -> StateInfo | None:
        """Write a state atomically, then evict down to the cap, the new file last of all: a
        state larger than the whole cap is not kept (None)."""
        if not tokens:
            raise ValueError("a state of no tokens")
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / file_name(key, tokens)
        header = json.dumps({"format": FORMAT, "key": dataclasses.asdict(key), "label": label,
                             "n_tokens": len(tokens), "payload_bytes": len(payload)}).encode()
        head = MAGIC + _LEN.pack(len(header)) + header + struct.pack(f"<{len(tokens)}i", *tokens)
        digest = hashlib.sha256(head)
        digest.update(payload)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                f.write(digest.digest())
        info = self.info(path)
        return None if path in self.evict(keep=path) else info

    def touch(self, path: Path) -> None:
        """Mark a state used now (eviction takes the least recently used first)."""
        now = self._clock()
        with contextlib.suppress(FileNotFoundError):
            os.utime(path, (now, now))

    def remove(self, path: Path) -> bool:
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def clear(self) -> int:
        """Remove every state (and temporaries killed writers left); returns how many states."""
        removed = sum(self.remove(info.path) for info in self.entries())
        for path in self._files():  # headers too damaged to list
            removed += self.remove(path)
        return removed

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Remove least recently used states until the directory is under the cap; `keep` goes
        last. Also removes the temporaries of writers that were killed."""
        self._sweep()
        files = []
        for path in self._files():
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                files.append((path == keep, st.st_mtime, path.name, path, st.st_size))
        total = sum(f[-1] for f in files)
        removed = []
        for *_, path, size in sorted(files):
            if total <= self.max_bytes:
                break
            self.remove(path)
            removed.append(path)
            total -= size
        return removed

    def _sweep(self) -> None:
        """Remove the temporaries of writers that were killed (atomic.temp_name's pattern)."""
        with contextlib.suppress(FileNotFoundError):
            for tmp in self.root.glob(f".*{SUFFIX}.*.part"):
                sweep(self.root / (tmp.name[1:].split(SUFFIX)[0] + SUFFIX))

    # ----- reading ------------------------------------------------------------------------------

    def _files(self) -> list[Path]:
        try:
            return [p for p in self.root.iterdir() if p.suffix == SUFFIX and not p.name.startswith(".")]
        except FileNotFoundError:
            return []

    def total_bytes(self) -> int:
        total = 0
        for path in self._files():
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    def entries(self) -> list[StateInfo]:
        """Every readable state's header, most recently used first."""
        found = []
        for path in self._files():
            with contextlib.suppress(StateUnusable):
                found.append(self.info(path))
        return sorted(found, key=lambda s: (s.used, s.name), reverse=True)

    def info(self, path: Path) -> StateInfo:
        """A state's header, read without its payload. Raises StateUnusable."""
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                head = f.read(_HEAD_READ)
                header, tokens_at, n = _parse_head(head)
                need = tokens_at + 4 * n
                if len(head) < need:
                    head += f.read(need - len(head))
        except FileNotFoundError:
            raise StateUnusable("its file is gone from the KV cache (evicted or cleared)") from None
        except OSError as e:
            raise StateUnusable(f"its file cannot be read: {e.strerror}") from None
        if len(head) < need:
            raise StateUnusable("its file is truncated", broken=True)
        try:
            key = StateKey(**header["key"])
            payload_bytes, label = int(header["payload_bytes"]), str(header["label"])
        except (KeyError, TypeError, ValueError):
            raise StateUnusable("its header is damaged", broken=True) from None
        tokens = struct.unpack_from(f"<{n}i", head, tokens_at)
        return StateInfo(path, key, label, tokens, need, payload_bytes, st.st_size, st.st_mtime)

    def read(self, path: Path, key: StateKey) -> tuple[StateInfo, memoryview]:
        """A state checked whole for this key: its header and payload. Raises StateUnusable
        naming what is wrong (stale key, truncated, corrupt)."""
        info = self.info(path)
        why = key.mismatch(info.key)
        if why:
            raise StateUnusable(why)
        body = info.payload_at + info.payload_bytes
        if info.size < body + _DIGEST:
            raise StateUnusable("its file is truncated", broken=True)
        if info.size > body + _DIGEST:
            raise StateUnusable("its file is corrupt: bytes past its end", broken=True)
        try:
            with open(path, "rb") as f:
                data = bytearray(info.size)
                got = f.readinto(data)
        except OSError as e:
            raise StateUnusable(f"its file cannot be read: {e.strerror}") from None
        if got != info.size:
            raise StateUnusable("its file is truncated", broken=True)
        view = memoryview(data)
        digest = hashlib.sha256(view[:body]).digest()
        if digest != bytes(view[body:]):
            raise StateUnusable("its file is corrupt: checksum mismatch", broken=True)
        return info, view[info.payload_at : body]  # the payload, not copied

    def best_prefix(self, key: StateKey, tokens: list[int]) -> tuple[StateInfo, int] | None:
        """Of the states saved under this key, the one sharing the longest prefix with `tokens`
        and that length (only headers are read)."""
        # engine pulls in llama-cpp-python (~0.3 s); a process that only lists or removes states
        # (the history's) never gets here
        from edgerun.runtime.engine import common_prefix

        best = None
        prefix = key.digest() + "-"
        for path in self._files():
            if not path.name.startswith(prefix):
                continue
            try:
                info = self.info(path)
            except StateUnusable:
                continue
            shared = common_prefix(info.tokens, tokens)
            if shared and (best is None or shared > best[1]):
                best = (info, shared)
        return best


def _parse_head(head: bytes) -> tuple[dict, int, int]:
    """(header, offset of the tokens, token count) from a file's first bytes."""
    if len(head) < len(MAGIC) + _LEN.size or not head.startswith(MAGIC):
        raise StateUnusable("it is not an edgerun KV state file" if len(head) >= len(MAGIC) else "its file is truncated",
                            broken=True)
    (length,) = _LEN.unpack_from(head, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if length > _HEADER_MAX:
        raise StateUnusable("its header is damaged", broken=True)
    if len(head) < start + length:
        raise StateUnusable("its file is truncated", broken=True)
    try:
        header = json.loads(head[start : start + length])
        fmt, n = header["format"], int(header["n_tokens"])
    except (ValueError, KeyError, TypeError):
        raise StateUnusable("its header is damaged", broken=True) from None
    if fmt != FORMAT:
        raise StateUnusable(f"it is in another edgerun state format ({fmt}, this edgerun reads {FORMAT})")
    if n < 1:
        raise StateUnusable("its header is damaged", broken=True)
    return header, start + length, n


# ----- keys ---------------------------------------------------------------------------------------


def model_identity(path: Path) -> str:
    """A model file's identity: the catalog's sha256 when the file is that catalog entry's, verified
    and unchanged since; else its size, mtime and a hash of its head (the GGUF header)."""
    from edgerun.models import catalog, fetch

    path = Path(path)
    resolved = path.resolve()
    for entry in catalog.load().entries:
        if fetch.local_file(entry).resolve() == resolved and fetch.is_verified(entry):
            return f"sha256:{entry.sha256}"
    st = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(_MODEL_HEAD)).hexdigest()[:32]
    return f"file:{st.st_size}:{st.st_mtime_ns}:{head}"


_LLAMA: str | None = None


def llama_build() -> str:
    """llama-cpp-python's version and the identity (size, mtime) of the libllama it loaded: a
    rebuild, with other flags or backends, is another build."""
    global _LLAMA
    if _LLAMA is None:
        import llama_cpp

        lib = getattr(getattr(llama_cpp.llama_cpp, "_lib", None), "_name", None)
        try:
            st = os.stat(lib) if lib else None
        except OSError:
            st = None
        _LLAMA = llama_cpp.__version__ + (f"/{st.st_size}/{st.st_mtime_ns}" if st else "")
    return _LLAMA
