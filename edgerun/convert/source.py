"""Step 1 of `edgerun convert`: whatever the user gave (an HF directory, hf://org/repo, or a GGUF)
as an unquantized GGUF (F16/BF16/F32) that the later steps measure and quantize."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader

from edgerun.convert.gguf_writer import OUT_TYPES, write_gguf
from edgerun.convert.hf_reader import PICKLE_SUFFIXES, SUPPORTED_ARCHS, download, is_hf_uri, open_checkpoint
from edgerun.errors import ConvertError, EdgerunError

__all__ = ["SUPPORTED_ARCHS", "prepare_f16", "unquantized_gguf"]

Progress = Callable[[str, int, int], None]
UNQUANTIZED = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
_UNQUANTIZED_FILE_TYPES = frozenset({"F16", "BF16", "ALL_F32", "?"})  # gguf_check's labels; "?": not declared
# Bump when the writer's output changes, so stale intermediates in a work dir are not reused.
_WRITER_VERSION = 1
_FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                      "model.safetensors.index.json", "special_tokens_map.json", "chat_template.jinja")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def unquantized_gguf(path: Path) -> Path:
    """PATH, checked to be a well-formed GGUF whose tensors are all F32/F16/BF16.

    Requantizing an already quantized file compounds two rounding errors and measures the
    sensitivity of the wrong weights, so it is refused."""
    from edgerun.models import gguf_check

    try:
        info = gguf_check.inspect(path)
    except EdgerunError as exc:
        raise ConvertError(str(exc)) from None
    if info.arch not in SUPPORTED_ARCHS:
        raise ConvertError(f"{path}: architecture {info.arch!r} is not supported by edgerun convert; "
                           f"supported: {', '.join(SUPPORTED_ARCHS)}")
    # the declared file type refuses most quantized files without parsing the tensor table again
    # (gguf-py takes seconds on a large vocabulary); the table is still checked for the rest
    if info.file_type not in _UNQUANTIZED_FILE_TYPES:
        raise _quantized(path, f"file type {info.file_type}")
    quantized = sorted({t.tensor_type.name for t in GGUFReader(path).tensors if t.tensor_type not in UNQUANTIZED})
    if quantized:
        raise _quantized(path, f"{', '.join(quantized)} tensors")
    return path


def _quantized(path: Path, what: str) -> ConvertError:
    return ConvertError(f"{path}: already quantized ({what}); give an F16/BF16/F32 GGUF or the original HF checkpoint")


def _fingerprint(root: Path, out_type: str) -> str:
    """A short hash naming the intermediate: changes when the checkpoint's files do."""
    h = hashlib.sha256(f"{_WRITER_VERSION} {out_type}".encode())
    files = [root / n for n in _FINGERPRINT_FILES if (root / n).is_file()] + sorted(root.glob("*.safetensors"))
    for path in files:
        st = path.stat()
        h.update(json.dumps([path.name, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()[:12]


def _from_checkpoint(root: Path, work_dir: Path, out_type: str, progress: Progress | None) -> Path:
    with open_checkpoint(root) as ckpt:
        work_dir.mkdir(parents=True, exist_ok=True)
        out = work_dir / f"source-{ckpt.arch}-{_fingerprint(root, out_type)}-{out_type.lower()}.gguf"
        if out.is_file():  # written atomically, so present means complete
            if progress:
                progress("write GGUF (cached)", 1, 1)
            return out
        return write_gguf(ckpt, out, out_type=out_type, progress=progress)


def prepare_f16(src: str, work_dir: Path, *, out_type: str = "F16", progress: Progress | None = None) -> Path:
    """The path of an F16/BF16/F32 GGUF made from SRC: an HF checkpoint directory, hf://org/repo
    [@revision], or a GGUF (returned as is when unquantized). Conversions are written atomically
    into WORK_DIR and reused when already there."""
    out_type = out_type.upper()
    if out_type not in OUT_TYPES:
        raise ConvertError(f"output type {out_type!r} is not supported; use one of {', '.join(OUT_TYPES)}")
    work_dir = Path(work_dir)
    if is_hf_uri(src):
        return _from_checkpoint(download(src), work_dir, out_type, progress)
    path = Path(src).expanduser()
    if path.is_dir():
        return _from_checkpoint(path, work_dir, out_type, progress)
    if not path.is_file():
        raise ConvertError(f"{src}: no such file or directory; give an HF checkpoint directory, hf://org/repo or a GGUF")
    if _is_gguf(path):
        return unquantized_gguf(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise ConvertError(f"{path}: pickled weights; edgerun never loads pickles, give a safetensors checkpoint")
    raise ConvertError(f"{path}: not a GGUF; give a GGUF file, an HF checkpoint directory or hf://org/repo")
