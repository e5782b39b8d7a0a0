"""A GGUF's tensor table, read fast: names, types, shapes, sizes and numpy views of the data.

gguf-py's GGUFReader builds a numpy view per metadata array item: 5-17 s for a 150K-token
vocabulary on two cores, and a convert opened its F16 and outputs seven times. The bounded
reader (models/gguf_bounded.py) parses those arrays in bulk (0.2 s), and this one also keeps
where the tensor infos start, which splicing files needs."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from edgerun.errors import ConvertError
from edgerun.models.gguf_bounded import BoundedReader, Tensor


class Reader(BoundedReader):
    """BoundedReader that records the byte offset of its tensor-info section."""

    tensor_info_offset: int = 0

    def _build_tensor_info(self, offs, count):
        self.tensor_info_offset = int(offs)
        return super()._build_tensor_info(offs, count)


def open_gguf(path: str | Path) -> Reader:
    """The file's tensor table (the file is mapped, not read). ConvertError if it is no GGUF."""
    try:
        return Reader(Path(path))
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read the GGUF ({e})") from e


def n_elements(t: Tensor) -> int:
    return int(np.prod(t.shape, dtype=np.int64))


def n_bytes(t: Tensor) -> int:
    block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    return n_elements(t) // block * size


def data(reader: Reader, t: Tensor) -> np.ndarray:
    """The tensor's data as GGUFReader gives it: F32/F16 values shaped (rows, row length) (ggml's
    dims reversed), other types uint8 rows of blocks."""
    raw = reader.data[t.data_offset:t.data_offset + n_bytes(t)]
    dims = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(dims)
    if t.tensor_type == gguf.GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(dims)
    return raw.reshape(*dims[:-1], -1)
