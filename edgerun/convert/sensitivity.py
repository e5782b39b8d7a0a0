"""Sensitivity: what each candidate type would cost each tensor, measured with ggml's own kernels.

For a weight W (rows x cols) and type T the cost is sum_rc imp_c (W_rc - deq(q_T(W))_rc)^2, with
imp the importance matrix (mean x_c^2 of the inputs): the expected squared error the quantized
matmul adds to its outputs per token. The quantizer is handed the same importance, as llama.cpp's
is, so the error measured is the error the real quantize will make."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import gguf
import numpy as np

from edgerun import _native
from edgerun.convert import tensors
from edgerun.convert.imatrix import Imatrix
from edgerun.convert.tensors import Tensor
from edgerun.errors import ConvertError
from edgerun.settings import threads_from_env

Progress = Callable[[str, int, int], None]

# Same rule as llama.cpp's quantizer (src/llama-quant.cpp): 2-D weights, never norms, routers,
# positional or token-type embeddings.
_NEVER = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj", "ssm_conv1d")
_NEVER_EXACT = ("position_embd.weight", "token_types.weight")
# Types llama.cpp refuses to make without a tensor's importance (its quantizer bails out: "the
# result will be garbage"; ggml asserts for the 2-bit ones): a candidate only where the imatrix
# has the tensor.
NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"})


@dataclass(frozen=True)
class TensorCost:
    name: str
    shape: tuple[int, ...]  # ggml order: (row_len, n_rows)
    n_elements: int
    row_len: int
    errors: dict[str, float]  # type name -> importance-weighted squared error (types that fit the rows)
    signal: float = 1.0  # sum of imp_c W_rc^2, scaled like the errors: what the errors are relative to


def _qtype(type_name: str) -> gguf.GGMLQuantizationType:
    try:
        return gguf.GGMLQuantizationType[type_name]
    except KeyError:
        raise ConvertError(f"unknown tensor type {type_name!r}; use a ggml type name such as Q4_K or Q8_0") from None


def block_size(type_name: str) -> int:
    """Values per block of a ggml type (a row length must be a multiple of it)."""
    return gguf.GGML_QUANT_SIZES[_qtype(type_name)][0]


def type_bpw(type_name: str) -> float:
    """Bits per weight of a ggml type."""
    block, nbytes = gguf.GGML_QUANT_SIZES[_qtype(type_name)]
    return 8 * nbytes / block


def type_nbytes(type_name: str, n_elements: int) -> int:
    """Bytes n_elements take in a ggml type."""
    block, nbytes = gguf.GGML_QUANT_SIZES[_qtype(type_name)]
    if n_elements % block:
        raise ConvertError(f"{n_elements} values do not fill whole {type_name} blocks of {block}")
    return n_elements // block * nbytes


def quantizable(tensor) -> bool:
    """Whether llama.cpp's quantizer would quantize this tensor."""
    name = tensor.name
    if len(tensor.shape) != 2 or not name.endswith("weight"):
        return False
    return not any(part in name for part in _NEVER) and name not in _NEVER_EXACT


def sample_rows(n_rows: int, max_rows: int | None) -> np.ndarray:
    """Evenly spaced row indices (all rows when max_rows is None or not smaller): deterministic,
    and spread over the whole matrix (rows of one block of a layer differ from another's)."""
    if max_rows is None or max_rows >= n_rows:
        return np.arange(n_rows)
    return np.unique(np.linspace(0, n_rows - 1, max_rows).round().astype(np.int64))


def read_rows(reader: tensors.Reader, tensor: Tensor, rows: np.ndarray) -> np.ndarray:
    """The chosen rows of a GGUF tensor as float32 (rows, row_len), whatever its storage type.
    The reader maps the file, so only these rows are read."""
    data = np.asarray(tensors.data(reader, tensor))[rows]
    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32)


def importance_for(imatrix: Imatrix | None, name: str, row_len: int) -> np.ndarray | None:
    if imatrix is None or name not in imatrix.values:
        return None
    imp = imatrix.values[name]
    if imp.shape != (row_len,):
        raise ConvertError(f"the imatrix has {imp.size} values for {name}, which has rows of {row_len};"
                           " it was made for another model: recalibrate")
    return imp


def tensor_cost(reader: tensors.Reader, tensor: Tensor, imatrix: Imatrix | None, types: Sequence[str], *,
                max_rows: int | None, n_threads: int) -> TensorCost:
    row_len, n_rows = int(tensor.shape[0]), int(tensor.shape[1])
    if row_len == 0 or n_rows == 0:  # ggml's quantizer divides by the row length (SIGFPE at 0)
        raise ConvertError(f"{tensor.name}: an empty tensor ({row_len} x {n_rows} values) cannot be quantized; "
                           "the GGUF is malformed, convert it again from its source")
    rows = sample_rows(n_rows, max_rows)
    w = np.ascontiguousarray(read_rows(reader, tensor, rows))
    imp = importance_for(imatrix, tensor.name, row_len)
    # The sampled rows stand for all of them. An embedding table the imatrix never saw in a
    # matmul (untied from the output) is a lookup: per token it adds the error of the one row
    # looked up, so its mean row error is what compares with the matmuls' per-token error.
    lookup = imatrix is not None and imp is None and tensor.name == "token_embd.weight"
    scale = 1.0 / len(rows) if lookup else n_rows / len(rows)
    errors = {}
    for t in types:
        if row_len % block_size(t) == 0 and (imp is not None or t not in NEEDS_IMATRIX):
            try:
                errors[t] = _native.quant_error(int(_qtype(t)), w, imp, n_threads) * scale
            except ValueError as e:  # a type ggml cannot make (here): say which
                raise ConvertError(f"{tensor.name}: {e}; leave {t} out of the candidate types") from e
    w64 = w.astype(np.float64)
    signal = float(((w64 * w64) * (imp[None, :] if imp is not None else 1.0)).sum()) * scale
    return TensorCost(name=tensor.name, shape=(row_len, n_rows), n_elements=row_len * n_rows,
                      row_len=row_len, errors=errors, signal=signal if signal > 0 else 1.0)


def measure(gguf_f16: Path, imatrix: Imatrix | None, types: Sequence[str], *, max_rows: int | None = 256,
            n_threads: int | None = None, progress: Progress | None = None) -> list[TensorCost]:
    """The cost of every candidate type for every quantizable tensor of the GGUF, one tensor in
    memory at a time. max_rows: measure on that many evenly spaced rows and scale to the tensor."""
    for t in types:
        _qtype(t)
    reader = tensors.open_gguf(gguf_f16)
    chosen = [t for t in reader.tensors if quantizable(t)]
    n_threads = n_threads or threads_from_env() or max(1, min(8, os.cpu_count() or 1))
    costs = []
    for i, tensor in enumerate(chosen):
        costs.append(tensor_cost(reader, tensor, imatrix, types, max_rows=max_rows, n_threads=n_threads))
        if progress:
            progress("sensitivity", i + 1, len(chosen))
    return costs
