"""Validate a GGUF file in Python before llama.cpp ever opens it.

llama.cpp trusts the file's offsets and counts; a truncated or hostile file can crash the process.
Here gguf-py parses the header, metadata and tensor table, and every tensor's data range is checked
to lie inside the file, so only well-formed files reach native code."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, MODEL_ARCH_NAMES

from edgerun import paths
from edgerun.errors import InvalidModelFile, ModelNotFound

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
KNOWN_ARCHS = frozenset(MODEL_ARCH_NAMES.values())
_MAX_DIMS = 4


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
    data_offset: int = 0  # where tensor data starts: everything before it is structure


def _fail(path: Path, what: str) -> InvalidModelFile:
    return InvalidModelFile(f"{path}: {what}; re-download it (edgerun pull) or pick another file")


def _header_check(path: Path, size: int) -> None:
    if size < 24:
        raise _fail(path, f"not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:4] != GGUF_MAGIC:
        raise _fail(path, f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version = struct.unpack_from("<I", head, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise _fail(path, f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = struct.unpack_from("<QQ", head, 8)
    # each tensor-info entry takes at least 24 bytes and each key/value at least 12
    if n_tensors * 24 + n_kv * 12 > size:
        raise _fail(path, f"corrupt header: {n_tensors} tensors and {n_kv} keys cannot fit in {size} bytes")


def _scalar(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None or not f.types:
        return default
    if f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    if f.types[0] == GGUFValueType.ARRAY:
        return default
    return f.parts[f.data[0]][0].item()


def _array_len(reader: GGUFReader, key: str) -> int:
    f = reader.fields.get(key)
    return len(f.data) if f is not None else 0


def _tensor_bytes(tensor) -> int:
    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    n = int(np.prod(tensor.shape, dtype=np.uint64))
    if int(tensor.shape[0]) % block:
        raise ValueError(f"tensor {tensor.name}: row of {tensor.shape[0]} is not a multiple of block {block}")
    return n // block * type_size


def _check_tensors(path: Path, reader: GGUFReader, size: int) -> tuple[list[int], int]:
    n_layers = 0
    per_layer: dict[int, int] = {}
    other = 0
    for t in reader.tensors:
        if len(t.shape) > _MAX_DIMS or any(int(d) <= 0 for d in t.shape):
            raise _fail(path, f"tensor {t.name} has bad shape {list(map(int, t.shape))}")
        nbytes = _tensor_bytes(t)
        start = int(t.data_offset)
        if start < 0 or start + nbytes > size:
            raise _fail(path, f"tensor {t.name} lies past the end of the file (truncated download?)")
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
            layer = int(parts[1])
            per_layer[layer] = per_layer.get(layer, 0) + nbytes
            n_layers = max(n_layers, layer + 1)
        else:
            other += nbytes
    return [per_layer.get(i, 0) for i in range(n_layers)], other


def _parse(path: Path, size: int) -> GGUFInfo:
    _header_check(path, size)
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf-py raises many kinds on malformed input; all mean "corrupt"
        raise _fail(path, f"corrupt GGUF ({type(exc).__name__}: {str(exc)[:120]})") from None
    arch = _scalar(reader, "general.architecture")
    if arch is None:
        raise _fail(path, "no general.architecture key")
    if arch not in KNOWN_ARCHS:
        raise InvalidModelFile(f"{path}: unknown architecture '{arch}'; edgerun runs what llama.cpp knows")
    try:
        layer_bytes, other = _check_tensors(path, reader, size)
    except (KeyError, ValueError) as exc:
        raise _fail(path, f"corrupt tensor table ({exc})") from None
    n_layers = int(_scalar(reader, f"{arch}.block_count", len(layer_bytes)) or 0)
    n_head = int(_scalar(reader, f"{arch}.attention.head_count", 1) or 1)
    n_embd = int(_scalar(reader, f"{arch}.embedding_length", 0) or 0)
    head_dim = int(_scalar(reader, f"{arch}.attention.key_length", n_embd // max(n_head, 1)) or 0)
    from gguf import LlamaFileType  # local: only needed for the label

    ftype = _scalar(reader, "general.file_type")
    try:
        file_type = LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else "?"
    except ValueError:
        file_type = str(ftype)
    return GGUFInfo(
        path=path,
        size=size,
        arch=arch,
        name=_scalar(reader, "general.name", path.stem) or path.stem,
        n_layers=n_layers,
        context_length=int(_scalar(reader, f"{arch}.context_length", 0) or 0),
        n_embd=n_embd,
        n_head_kv=int(_scalar(reader, f"{arch}.attention.head_count_kv", n_head) or n_head),
        head_dim=head_dim,
        chat_template=_scalar(reader, "tokenizer.chat_template"),
        n_vocab=_array_len(reader, "tokenizer.ggml.tokens"),
        file_type=file_type,
        layer_bytes=tuple(layer_bytes),
        other_bytes=other,
        data_offset=int(reader.data_offset),
    )


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
        if _structure_hash(path, info["data_offset"]) != record["structure_sha256"]:
            return None
        info.update(path=Path(info["path"]), layer_bytes=tuple(info["layer_bytes"]))
        return GGUFInfo(**info)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember(info: GGUFInfo) -> None:
    memo = _memo_file(info.path, info.size)
    info_json = dataclasses.asdict(info) | {"path": str(info.path), "layer_bytes": list(info.layer_bytes)}
    record = {"structure_sha256": _structure_hash(info.path, info.data_offset), "info": info_json}
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
        raise ModelNotFound(f"{path}: no such file; check the path or run `edgerun list`")
    if not path.is_file():
        raise InvalidModelFile(f"{path}: not a regular file; pass a .gguf file")
    path = path.resolve()
    size = path.stat().st_size
    info = _recall(path, size)
    if info is None:
        info = _parse(path, size)
        _remember(info)
    return info
