"""gguf-py's GGUF reader under hard bounds: no read past the end of the file, no absurd counts,
and time and memory in proportion to the file's size, however hostile its metadata.

gguf-py reads through numpy slices of a memmap, which silently come back short at the end of the
file: a truncated file then parses on into garbage, and an array that claims 2**64 items loops on
empty reads forever. It also builds numpy views item by item: ~20 us and ~1 KB per array item,
~100 us and ~5 KB per tensor, so a 4 MB file of tiny items would take a minute and gigabytes.
Here a short read is an error, counts are capped, an array is one part (a numpy view of its
values, or for strings an (n, 2) array of each string's (start, length) in the file) and tensor
infos are read with struct. Hooks gguf-py's private _get, _get_field_parts, _build_tensor_info
and _build_tensors, so gguf stays pinned in pyproject."""

from __future__ import annotations

import array
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

# Caps far above any real model (~50 keys, ~2000 tensors; the largest vocabularies carry ~1M
# array items across tokens, scores, types and merges), so a hostile count is refused up front.
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 12
MAX_ARRAY_ITEMS = 1 << 22
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class PastEnd(ValueError):
    """A read that would run past the end of the file."""


class Tensor(NamedTuple):
    """One tensor-info entry: what the validator reads of it (no view of its data)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int  # absolute, in the file


class BoundedReader(GGUFReader):
    """GGUFReader whose every read is bounded; arrays and tensor infos parsed in bulk."""

    def __init__(self, path: Path):
        self._array_items = 0
        super().__init__(path, "r")

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # gguf-py maps the file as an np.memmap; each of its thousands of small slices and views then
        # runs memmap's Python-level __array_finalize__ (a third of a small file's parse). A plain
        # ndarray view of the same mapping reads the same bytes without it.
        self._data = value.view(np.ndarray)

    def _get(self, offset, dtype, count=1, override_order=None):
        """gguf-py's _get with the end checked (its slice would come back short), read the same way."""
        dtype, offset = np.dtype(dtype), int(offset)
        end = offset + dtype.itemsize * int(count)
        if end > len(self.data):
            raise PastEnd(f"needs bytes up to {end}, the file has {len(self.data)}")
        arr = self.data[offset:end].view(dtype)
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        item_type, count, start = int(raw_itype[0]), int(alen[0]), orig_offs + 12
        left = len(self.data) - start
        self._array_items += count
        if count * _min_item_bytes(item_type) > left:
            raise ValueError(f"metadata array at byte {orig_offs} claims {count} items; {left} bytes are left")
        if self._array_items > MAX_ARRAY_ITEMS:
            raise ValueError(f"metadata arrays claim over {MAX_ARRAY_ITEMS} items, more than any real model")
        vtype = GGUFValueType(item_type)
        if vtype == GGUFValueType.STRING:
            values, end = _string_spans(self.data, start, count)
        else:
            values = self._get(start, self.gguf_scalar_to_np[vtype], count)
            end = start + values.nbytes
        return end - orig_offs, [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, vtype]

    def _build_tensor_info(self, offs, count):
        buf, size = memoryview(self.data), len(self.data)
        infos = []
        for _ in range(count):
            (name_len,) = _U64.unpack_from(buf, _need(offs + 8, size) - 8)
            name_at = offs + 8
            offs = _need(name_at + name_len + 4, size)
            (n_dims,) = _U32.unpack_from(buf, offs - 4)
            dims_at = offs
            offs = _need(offs + 8 * n_dims + 12, size)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, dims_at)
            ggml_type, rel = struct.unpack_from("<IQ", buf, offs - 12)
            infos.append((str(bytes(buf[name_at:name_at + name_len]), "utf-8"), dims, ggml_type, rel))
        return offs, infos

    def _build_tensors(self, start_offs, fields):
        names: set[str] = set()
        for name, *_ in fields:
            if name in names:
                raise ValueError(f"duplicated tensor name {name[:64]!r}")
            names.add(name)
        base = int(start_offs)  # gguf-py computes it with numpy integers, which overflow
        self.tensors = [Tensor(name, GGMLQuantizationType(t), dims, base + rel) for name, dims, t, rel in fields]


def _need(end: int, size: int) -> int:
    if end > size:
        raise PastEnd(f"needs bytes up to {end}, the file has {size}")
    return end


def _string_spans(data: np.ndarray, offs: int, count: int) -> tuple[np.ndarray, int]:
    """Each of COUNT length-prefixed strings from OFFS: (start, length) rows, and where they end."""
    spans = array.array("q")
    size = len(data)
    buf = memoryview(data)
    unpack, append = _U64.unpack_from, spans.append  # bound once: this loop runs once a token
    for _ in range(count):
        (n,) = unpack(buf, _need(offs + 8, size) - 8)
        offs += 8
        if n > size - offs:
            raise PastEnd(f"a string of {n} bytes at {offs} runs past the end ({size})")
        append(offs)
        append(n)
        offs += n
    return np.frombuffer(spans, dtype=np.int64).reshape(-1, 2), offs


def _min_item_bytes(item_type: int) -> int:
    """The fewest bytes one array item of this type takes (a string: its length field)."""
    try:
        vtype = GGUFValueType(item_type)
    except ValueError:
        raise ValueError(f"unknown metadata array item type {item_type}") from None
    if vtype == GGUFValueType.ARRAY:
        raise ValueError("a metadata array of arrays (llama.cpp reads none)")
    if vtype == GGUFValueType.STRING:
        return 8
    return np.dtype(GGUFReader.gguf_scalar_to_np[vtype]).itemsize
