"""Read a Hugging Face checkpoint directory lazily, one tensor at a time.

Only safetensors are read: safetensors itself checks each file's header (its length, and that every
tensor lies inside the file), then the file is memory-mapped and a tensor is a numpy view of its
bytes (bfloat16 as its 16-bit patterns, see floats.py), so nothing is copied until a conversion
needs it. Pickled weights (`*.bin`, `*.pt`, ...) are refused, never opened, because unpickling runs
arbitrary code. `hf://org/repo[@revision]` is fetched with
huggingface_hub into edgerun's cache, weights and JSON only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgerun import paths
from edgerun.errors import ConvertError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# The HF class names (config.json "architectures") each GGUF architecture is made from.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
# The other direction, for writing checkpoints (fixture.py, tiny.py): class and model_type.
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma3": "Gemma3ForCausalLM"}
HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HF_SCHEME = "hf://"
# safetensors dtypes a weight may be stored in, as numpy reads their bytes (little-endian)
NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}
_DOWNLOAD_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.jinja"]


def is_hf_uri(src: str) -> bool:
    return src.startswith(HF_SCHEME)


def parse_hf_uri(uri: str) -> tuple[str, str | None]:
    """`hf://org/repo[@revision]` -> (repo id, revision or None)."""
    body = uri[len(HF_SCHEME):].strip("/")
    repo, _, revision = body.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ConvertError(f"{uri}: expected hf://org/repo or hf://org/repo@revision")
    return repo, revision or None


def download(uri: str) -> Path:
    """Fetch the safetensors, JSON and tokenizer files of an hf:// checkpoint (HF_ENDPOINT and
    HF_HUB_OFFLINE are honoured by huggingface_hub itself) and return the local snapshot dir."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, revision = parse_hf_uri(uri)
    try:
        path = snapshot_download(repo, revision=revision, allow_patterns=_DOWNLOAD_PATTERNS,
                                 cache_dir=str(paths.cache_dir() / "hf"))
    except (RepositoryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConvertError(f"{uri}: download failed ({what}); check the name, the network or HF_ENDPOINT") from None
    return Path(path)


def _load_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{path}: cannot read it as JSON ({exc}); fix or re-download the checkpoint") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: expected a JSON object; fix or re-download the checkpoint")
    return value


def _arch_of(root: Path, config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    shown = ", ".join(map(str, names)) or f"model_type {config.get('model_type')!r}"
    raise ConvertError(f"{root}: unsupported architecture {shown}; edgerun convert supports "
                       f"{', '.join(SUPPORTED_ARCHS)} ({', '.join(HF_ARCHITECTURES)})")


def _weight_files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ConvertError(
            f"{root}: only pickled weights ({', '.join(pickled[:3])}); edgerun never loads pickles, "
            "use a checkpoint with *.safetensors (e.g. convert it once with safetensors' own tools)")
    raise ConvertError(f"{root}: no *.safetensors weights; give a complete HF checkpoint directory")


class Shard:
    """One safetensors file: its header, checked by safetensors, and its bytes memory-mapped."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy"):  # the checks; it reads no tensor
                pass
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self.header = json.loads(f.read(n))
            self.header.pop("__metadata__", None)
            start = 8 + n
            size = path.stat().st_size
            # np.memmap cannot map nothing: a file of empty tensors has no bytes after its header
            self.data = np.memmap(path, np.uint8, "r", start) if size > start else np.empty(0, np.uint8)
        except Exception as exc:
            raise _unreadable(path, exc) from None
        self.path = path

    def tensor(self, name: str) -> tuple[np.ndarray, str]:
        entry = self.header[name]
        dtype = entry["dtype"]
        if dtype not in NUMPY_DTYPES:
            raise ConvertError(f"{self.path}: tensor {name!r} is stored as {dtype}; edgerun convert reads "
                               f"{', '.join(NUMPY_DTYPES)} weights")
        begin, end = entry["data_offsets"]
        return np.asarray(self.data[begin:end]).view(NUMPY_DTYPES[dtype]).reshape(entry["shape"]), dtype


@dataclass
class HFCheckpoint:
    """A checkpoint directory: its config, its architecture and a lazy view of its tensors."""

    root: Path
    config: dict[str, Any]
    arch: str
    files: dict[str, Path]  # tensor name -> the safetensors file holding it
    _shards: dict[Path, Shard] = field(default_factory=dict, repr=False)

    def _shard(self, name: str) -> Shard:
        path = self.files.get(name)
        if path is None:
            raise KeyError(name)
        if path not in self._shards:
            self._shards[path] = Shard(path)
        return self._shards[path]

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shard(name).header[name]["shape"])

    def tensor(self, name: str) -> tuple[np.ndarray, str]:
        """One tensor as stored: a read-only numpy view of the mapped file and its safetensors
        dtype (BF16 values are uint16 bit patterns; floats.py converts)."""
        return self._shard(name).tensor(name)

    def close(self) -> None:
        self._shards.clear()  # a mapping closes when the last view of it goes

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unreadable(path: Path, exc: BaseException) -> ConvertError:
    what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ConvertError(f"{path}: not a readable safetensors file ({what}); re-download it")


def _shard_tensors(path: Path) -> list[str]:
    """The tensor names in one safetensors file's header (safetensors checks the header's length
    and that every tensor lies inside the file; no data is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own SafetensorError for corrupt headers
        raise _unreadable(path, exc) from None


def _allowed_dir(root: Path) -> Path:
    """Where a checkpoint's files may really be: its own directory, or for a snapshot in a
    Hugging Face cache (REPO/snapshots/REV/, whose files link to REPO/blobs/) the repo's folder."""
    root = root.resolve()
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        return root.parent.parent
    return root


def _check_inside(path: Path, allowed: Path) -> None:
    if not path.resolve().is_relative_to(allowed):
        raise ConvertError(f"{path}: a link to {path.resolve()}, outside the checkpoint directory; "
                           "copy the file into the directory instead of linking it")


def _index_shards(index: Path) -> dict[str, str]:
    """The index's weight_map, checked: tensor name -> shard file name, every shard a plain file
    name beside the index (never a path that leads out of the directory)."""
    weight_map = _load_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConvertError(f"{index}: no weight_map of tensor names to shard files; fix or re-download the checkpoint")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(".safetensors"):
            raise ConvertError(f"{index}: {name} is mapped to {shard!r}, not a .safetensors file name; "
                               "fix or re-download the checkpoint")
        if shard != Path(shard).name or "\\" in shard:
            raise ConvertError(f"{index}: shard {shard!r} is not a file in the checkpoint directory; "
                               "an index may only name files beside it")
    return weight_map


def _tensor_files(root: Path, files: list[Path]) -> dict[str, Path]:
    """Tensor name -> the file holding it, from the index if there is one, else from the headers.
    Every shard's header is read here, so a missing, broken or foreign shard is refused before
    any work starts."""
    allowed = _allowed_dir(root)
    for path in files:
        _check_inside(path, allowed)
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return {name: path for path in files for name in _shard_tensors(path)}
    weight_map = _index_shards(index)
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (root / s).is_file()]
    if missing:
        raise ConvertError(f"{root}: shards listed in the index are missing ({', '.join(missing[:3])}); "
                           "download the whole checkpoint")
    for shard in shards:
        _check_inside(root / shard, allowed)
        held = set(_shard_tensors(root / shard))
        absent = sorted(name for name, s in weight_map.items() if s == shard and name not in held)
        if absent:
            more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
            raise ConvertError(f"{index}: {absent[0]}{more} is listed in {shard}, which does not hold it; "
                               "re-download the checkpoint")
    return {name: root / shard for name, shard in weight_map.items()}


def open_checkpoint(root: Path) -> HFCheckpoint:
    """Check a local HF directory and open it lazily; raises ConvertError on what cannot work."""
    root = Path(root)
    if not root.is_dir():
        raise ConvertError(f"{root}: not a directory; give an HF checkpoint directory, hf://org/repo or a GGUF")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{root}: no config.json; give a complete HF checkpoint directory")
    config = _load_json(config_path)
    arch = _arch_of(root, config)
    files = _weight_files(root)
    if not (root / "tokenizer.json").is_file() and not (root / "tokenizer.model").is_file():
        raise ConvertError(f"{root}: no tokenizer.json or tokenizer.model; download the tokenizer files too")
    return HFCheckpoint(root=root, config=config, arch=arch, files=_tensor_files(root, files))
