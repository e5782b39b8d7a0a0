"""Checkpoint weights as numpy arrays: bfloat16, which numpy lacks, is carried as its 16-bit
patterns (a bfloat16 is the upper half of a float32), and each conversion rounds as torch's does,
to nearest with ties to even, so the converter writes what it wrote when it read through torch.

Values are converted a block at a time, so a conversion holds its output and one block as float32,
not a float32 copy of the whole tensor (the embedding of a 1.5B is 0.9 GB as float32)."""

from __future__ import annotations

import gguf
import numpy as np

_BLOCK = 1 << 22  # values converted at a time


def to_f32(values: np.ndarray, dtype: str) -> np.ndarray:
    """VALUES (stored as safetensors DTYPE) as float32; bfloat16 widens exactly."""
    if dtype == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    # gguf-py's BF16 quantizer is ggml's own rounding (to nearest, ties to even; NaN stays NaN)
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), gguf.GGMLQuantizationType.BF16).view(np.uint16)


def _convert(values: np.ndarray, dtype: str, out_dtype, convert) -> np.ndarray:
    flat = values.reshape(-1)  # a view: the reader's arrays and the transforms' results are contiguous
    out = np.empty(flat.shape, dtype=out_dtype)
    with np.errstate(over="ignore"):  # past float16's range is inf, which the writer checks for
        for i in range(0, flat.size, _BLOCK):
            out[i:i + _BLOCK] = convert(to_f32(flat[i:i + _BLOCK], dtype))
    return out.reshape(values.shape)


def to_f16(values: np.ndarray, dtype: str) -> np.ndarray:
    """VALUES as float16 (contiguous), rounded to nearest even; beyond its range they become inf."""
    if dtype == "F16":
        return np.ascontiguousarray(values)
    return _convert(values, dtype, np.float16, lambda x: x)


def to_bf16(values: np.ndarray, dtype: str) -> np.ndarray:
    """VALUES as bfloat16 bit patterns (uint16, contiguous), rounded to nearest even; NaN stays NaN."""
    if dtype == "BF16":
        return np.ascontiguousarray(values)
    return _convert(values, dtype, np.uint16, _bf16_bits)
