"""Safetensors files read and written with numpy, without torch (seconds to import in every process
that would): tensors as edgerun's reader gives them, (values, safetensors dtype) with bfloat16 as
its 16-bit patterns. A file written here is byte for byte what torch's save_file writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

from edgerun.convert import floats
from edgerun.convert.hf_reader import NUMPY_DTYPES, Shard

Stored = tuple[np.ndarray, str]  # values and their safetensors dtype (F32, F16, BF16)
_SPEC_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_CASTS = {"f32": ("F32", lambda a: np.ascontiguousarray(a, dtype=np.float32)),
          "f16": ("F16", lambda a: floats.to_f16(a, "F32")),
          "bf16": ("BF16", lambda a: floats.to_bf16(a, "F32"))}


def stored(values: np.ndarray, dtype: str) -> Stored:
    """float32 VALUES stored as DTYPE ("f32", "f16" or "bf16"), rounded as torch rounds."""
    name, cast = _CASTS[dtype]
    return cast(np.asarray(values, dtype=np.float32)), name


def load(path: Path) -> dict[str, Stored]:
    """Every tensor of one file, copied out of the mapping (so the file may be rewritten)."""
    shard = Shard(Path(path))
    out = {}
    for name in shard.header:
        values, dtype = shard.tensor(name)
        out[name] = (np.array(values), dtype)
    return out


def save(path: Path, tensors: dict[str, Stored], metadata: dict[str, str] | None = None) -> None:
    arrays = {name: np.ascontiguousarray(values, dtype=NUMPY_DTYPES[dtype]) for name, (values, dtype) in tensors.items()}
    specs = {name: TensorSpec(dtype=_SPEC_NAMES[tensors[name][1]], shape=a.shape, data_ptr=a.ctypes.data,
                              data_len=a.nbytes) for name, a in arrays.items()}
    serialize_file(specs, str(path), metadata=metadata)  # `arrays` holds the buffers until it returns


def as_f32(tensor: Stored) -> np.ndarray:
    return floats.to_f32(*tensor)
