"""Validate a GGUF file in Python before llama.cpp ever opens it.

llama.cpp trusts the file's offsets and counts; a truncated or hostile file can crash the process.
Here gguf-py parses the header, metadata and tensor table (with every read bounded by the file's
size), and every tensor's data range is checked to lie inside the file where llama.cpp expects it,
so only well-formed files reach native code."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, MODEL_ARCH_NAMES

from edgerun import paths
from edgerun.errors import InvalidModelFile, ModelNotFound
from edgerun.models import gguf_bounded, gguf_hparams
from edgerun.models.gguf_bounded import MAX_KEYS, MAX_TENSORS, BoundedReader, PastEnd

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
KNOWN_ARCHS = frozenset(MODEL_ARCH_NAMES.values())
_MAX_DIMS = 4
_MAX_NAME = 63  # llama.cpp keeps tensor names in 64-byte buffers (GGML_MAX_NAME)
_INT_TYPES = frozenset({
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
})


@dataclass(frozen=True)
class GGUFInfo:
    """What edgerun needs to know about a model file, read without llama.cpp."""

    path: Path
    size: int
    arch: str
    name: str
    n_layers: int
    context_length: int
    n_embd: int
    n_head_kv: int
    head_dim: int
    chat_template: str | None
    n_vocab: int
    file_type: str
    layer_bytes: tuple[int, ...] = field(repr=False)  # weight bytes of each repeating block
    other_bytes: int = 0  # embeddings, output head, norms outside the blocks
    input_bytes: int = 0  # token embeddings: llama.cpp keeps them in host memory
    output_bytes: int = 0  # output head + final norm: on the GPU once every block is
    tied_head: bool = False  # no output.weight: the head reuses token_embd
    n_head: int = 1
    n_ff: int = 0
    data_offset: int = 0  # where tensor data starts: everything before it is structure


def _one_line(text: str) -> str:
    """Names and strings in a message come from the file: escape anything that would break the
    one-line error (newlines, \\x85, U+2028, other control characters)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _quote(text: str, limit: int = 64) -> str:
    """A file-supplied name, short enough for a message (an architecture can be 1 MB long)."""
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def _fail(path: Path, what: str) -> InvalidModelFile:
    return InvalidModelFile(_one_line(f"{path}: {what}; re-download it (edgerun pull) or pick another file"))


def _header_check(path: Path, size: int) -> None:
    if size < 24:
        raise _fail(path, f"not a GGUF file (only {size} bytes)")
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as exc:  # unreadable (permissions, I/O error): say so, not a traceback
        what = f"{path}: cannot read it ({exc.strerror or exc}); check its permissions"
        raise InvalidModelFile(_one_line(what)) from None
    if head[:4] != GGUF_MAGIC:
        raise _fail(path, f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version = struct.unpack_from("<I", head, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise _fail(path, f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = struct.unpack_from("<QQ", head, 8)
    # each tensor-info entry takes at least 24 bytes and each key/value at least 12
    if n_tensors * 24 + n_kv * 12 > size:
        raise _fail(path, f"corrupt header: {n_tensors} tensors and {n_kv} keys cannot fit in {size} bytes")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KEYS:
        raise _fail(path, f"corrupt header: {n_tensors} tensors and {n_kv} keys, more than any real model")


def _scalar(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None or not f.types:
        return default
    if f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    if f.types[0] == GGUFValueType.ARRAY:
        return default
    return f.parts[f.data[0]][0].item()


def _count(path: Path, reader: GGUFReader, key: str, default: int, *, per_layer: bool = False) -> int:
    """A size the runtime plans with (layers, context, heads): a string, float or negative
    value would otherwise surface later as a crash or a baffling placement error.

    per_layer: llama.cpp also takes an array with one value per layer for this key (OpenELM,
    DeciLM and Jamba store head counts so); such an array gives the default, as before."""
    f = reader.fields.get(key)
    if f is None:
        return default
    if per_layer and f.types[:1] == [GGUFValueType.ARRAY] and f.types[-1] in _INT_TYPES:
        return default
    if len(f.types) != 1 or f.types[0] not in _INT_TYPES:
        raise _fail(path, f"{key} is not an integer ({'/'.join(t.name for t in f.types)})")
    value = int(f.parts[f.data[0]][0])
    if value < 0:
        raise _fail(path, f"{key} is negative ({value})")
    return value


def _text(path: Path, reader: GGUFReader, key: str) -> str | None:
    """A string field, or None when absent; any other type is a malformed file."""
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types != [GGUFValueType.STRING]:
        raise _fail(path, f"{key} is not a string ({'/'.join(t.name for t in f.types)})")
    return _scalar(reader, key)


def _array_len(reader: GGUFReader, key: str) -> int:
    f = reader.fields.get(key)
    return len(f.parts[f.data[0]]) if f is not None and f.types[0] == GGUFValueType.ARRAY else 0


def _tensor_bytes(tensor) -> int:
    """Bytes of one tensor, counted in Python ints: numpy's uint64 product wraps silently, and a
    wrapped count (2**32 x 2**32 = 0) would make a huge tensor look tiny."""
    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    dims = [int(d) for d in tensor.shape]
    row = dims[0] if dims else 1  # a tensor of no dimensions is one element
    if row % block:
        raise ValueError(f"tensor {_quote(tensor.name)}: row of {row} is not a multiple of block {block}")
    return math.prod(dims) // block * type_size


def _check_tensors(path: Path, reader: GGUFReader, size: int) -> tuple[list[int], dict[str, int]]:
    n_layers = 0
    per_layer: dict[int, int] = {}
    other: dict[str, int] = {}
    expected = 0  # llama.cpp wants each tensor's data right after the previous one's, padded
    align = int(reader.alignment)
    for t in reader.tensors:
        name = _quote(t.name)
        if len(t.name.encode()) > _MAX_NAME:
            raise _fail(path, f"tensor name {name} is longer than llama.cpp's {_MAX_NAME} bytes")
        if len(t.shape) > _MAX_DIMS or any(int(d) <= 0 for d in t.shape):
            raise _fail(path, f"tensor {name} has bad shape {list(map(int, t.shape))}")
        nbytes = _tensor_bytes(t)
        start = int(t.data_offset)
        if start < 0 or start + nbytes > size:
            raise _fail(path, f"tensor {name} lies past the end of the file (truncated download?)")
        if start - reader.data_offset != expected:
            raise _fail(path, f"tensor {name} is at data offset {start - reader.data_offset}, expected {expected}")
        expected += -(-nbytes // align) * align
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
            layer = int(parts[1])
            per_layer[layer] = per_layer.get(layer, 0) + nbytes
            n_layers = max(n_layers, layer + 1)
        else:
            other[t.name] = nbytes
    return [per_layer.get(i, 0) for i in range(n_layers)], other


def _parse(path: Path, size: int) -> GGUFInfo:
    _header_check(path, size)
    try:
        reader = BoundedReader(path)
    except PastEnd as exc:
        raise _fail(path, f"data runs past the end of the file ({exc}; truncated download?)") from None
    except Exception as exc:  # gguf-py raises many kinds on malformed input; all mean "corrupt"
        raise _fail(path, f"corrupt GGUF ({type(exc).__name__}: {str(exc)[:120]})") from None
    arch = _text(path, reader, "general.architecture")
    if arch is None:
        raise _fail(path, "no general.architecture key")
    if arch not in KNOWN_ARCHS:
        raise InvalidModelFile(_one_line(
            f"{path}: unknown architecture {_quote(arch)}; edgerun runs what llama.cpp knows"))
    try:
        layer_bytes, other = _check_tensors(path, reader, size)
    except (KeyError, ValueError) as exc:
        raise _fail(path, f"corrupt tensor table ({exc})") from None
    try:
        gguf_hparams.check(reader, arch)
    except gguf_hparams.Refused as exc:
        raise _fail(path, str(exc)) from None
    n_layers = _count(path, reader, f"{arch}.block_count", len(layer_bytes))
    n_head = _count(path, reader, f"{arch}.attention.head_count", 1, per_layer=True) or 1
    n_embd = _count(path, reader, f"{arch}.embedding_length", 0)
    head_dim = _count(path, reader, f"{arch}.attention.key_length", n_embd // n_head)
    from gguf import LlamaFileType  # local: only needed for the label

    embd = other.get("token_embd.weight", 0)
    # a tied head reuses token_embd; llama.cpp then uploads a second copy of it for the output layer
    head = sum(v for k, v in other.items() if k != "token_embd.weight")
    head += 0 if "output.weight" in other else embd
    ftype = _scalar(reader, "general.file_type")
    try:
        file_type = LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else "?"
    except ValueError:
        file_type = str(ftype)
    return GGUFInfo(
        path=path,
        size=size,
        arch=arch,
        name=_text(path, reader, "general.name") or path.stem,
        n_layers=n_layers,
        context_length=_count(path, reader, f"{arch}.context_length", 0),
        n_embd=n_embd,
        n_head_kv=_count(path, reader, f"{arch}.attention.head_count_kv", n_head, per_layer=True) or n_head,
        head_dim=head_dim,
        chat_template=_text(path, reader, "tokenizer.chat_template"),
        n_vocab=_array_len(reader, "tokenizer.ggml.tokens"),
        file_type=file_type,
        layer_bytes=tuple(layer_bytes),
        other_bytes=sum(other.values()),
        input_bytes=embd,
        output_bytes=head,
        tied_head="output.weight" not in other,
        n_head=n_head,
        n_ff=_count(path, reader, f"{arch}.feed_forward_length", 0, per_layer=True),
        data_offset=int(reader.data_offset),
    )


_RULES = (__file__, gguf_bounded.__file__, gguf_hparams.__file__)


def _rules_version(sources: tuple[str, ...] = _RULES) -> str:
    """A remembered result is only as good as the rules that produced it: the memo is keyed by
    the validator's own source (this module, gguf_bounded, gguf_hparams) and gguf-py's version,
    so any change to a rule invalidates every result remembered under the old ones."""
    h = hashlib.sha256(importlib.metadata.version("gguf").encode())
    for source in sources:
        h.update(Path(source).read_bytes())
    return h.hexdigest()[:16]


_MEMO_VERSION = _rules_version()


def _structure_hash(path: Path, data_offset: int) -> str:
    """Validity depends only on the bytes before tensor data and on the file size, so a hash of
    that region identifies a result exactly (tensor values cannot make a file malformed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(data_offset))
    return h.hexdigest()


def _memo_file(path: Path, size: int) -> Path:
    key = hashlib.sha256(f"{path}\0{size}".encode()).hexdigest()[:32]
    return paths.cache_dir() / "inspected" / f"{key}.json"


def _recall(path: Path, size: int) -> GGUFInfo | None:
    try:
        record = json.loads(_memo_file(path, size).read_text())
        info = record["info"]
        if record.get("version") != _MEMO_VERSION or set(info) != {f.name for f in dataclasses.fields(GGUFInfo)}:
            return None
        if _structure_hash(path, info["data_offset"]) != record["structure_sha256"]:
            return None
        info.update(path=Path(info["path"]), layer_bytes=tuple(info["layer_bytes"]))
        return GGUFInfo(**info)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember(info: GGUFInfo) -> None:
    memo = _memo_file(info.path, info.size)
    info_json = dataclasses.asdict(info) | {"path": str(info.path), "layer_bytes": list(info.layer_bytes)}
    record = {"version": _MEMO_VERSION, "structure_sha256": _structure_hash(info.path, info.data_offset), "info": info_json}
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache only costs the next run a re-parse


def inspect(path: str | os.PathLike) -> GGUFInfo:
    """Parse and validate a GGUF file; raise InvalidModelFile with one clear line if it is bad.

    gguf-py walks every vocab entry (seconds for a 150k vocab), so a good result is remembered
    and reused while the file's structure bytes are unchanged."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFound(_one_line(f"{path}: no such file; check the path or run `edgerun list`"))
    if not path.is_file():
        raise InvalidModelFile(_one_line(f"{path}: not a regular file; pass a .gguf file"))
    path = path.resolve()
    size = path.stat().st_size
    info = _recall(path, size)
    if info is None:
        info = _parse(path, size)
        _remember(info)
    return info
