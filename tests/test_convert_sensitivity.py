"""Per-tensor quantization error with ggml's kernels, on the real 0.5B's tensors."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from edgerun import _native
from edgerun.convert.imatrix import Imatrix
from edgerun.convert.sensitivity import (
    block_size, measure, quantizable, read_rows, sample_rows, tensor_cost, type_nbytes,
)
from edgerun.errors import ConvertError

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reader(small_model):
    from edgerun.convert.tensors import open_gguf

    return open_gguf(small_model)


@pytest.fixture(scope="module")
def tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def reference_error(w: np.ndarray, qtype: Q, importance: np.ndarray | None = None) -> float:
    """gguf-py's own (NumPy) quantize and dequantize, weighted per column."""
    back = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    sq = (w.astype(np.float64) - back) ** 2
    return float((sq * (1.0 if importance is None else importance[None, :])).sum())


def test_error_falls_as_bits_rise(reader, tensors):
    # output.weight is stored as Q8_0 (the finest grid in this file); pairs of its 896-long rows
    # make 1792-long rows (7 super-blocks) for the 256-blocks of the k-quants
    w = read_rows(reader, tensors["output.weight"], sample_rows(151936, 256)).reshape(-1, 1792)
    errors = [_native.quant_error(int(Q[t]), w, None, 2) for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] == 0.0  # Q8_0 values back into Q8_0 blocks (32-aligned): exact


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_1"])
def test_error_equals_gguf_py_reference(reader, tensors, type_name):
    w = read_rows(reader, tensors["blk.0.attn_q.weight"], sample_rows(896, 128))
    assert _native.quant_error(int(Q[type_name]), w, None, 2) == pytest.approx(reference_error(w, Q[type_name]),
                                                                               rel=1e-9)


def test_importance_weighs_columns(reader, tensors):
    # square (896 x 896), so weights applied along rows instead of columns would still run
    w = read_rows(reader, tensors["blk.0.attn_q.weight"], np.arange(896))
    rng = np.random.default_rng(0)
    importance = rng.uniform(0.0, 10.0, 896).astype(np.float32)
    # Q8_0 ignores the importance when quantizing, so only the weighting of the error differs
    got = _native.quant_error(int(Q.Q8_0), w, importance, 2)
    assert got == pytest.approx(reference_error(w, Q.Q8_0, importance), rel=1e-6)
    wrong_axis = float((((w.astype(np.float64) - gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0))
                         ** 2) * importance[:, None]).sum())
    assert abs(got - wrong_axis) > 1e-3 * got


def test_quantizer_uses_the_importance(reader, tensors):
    w = read_rows(reader, tensors["blk.0.attn_q.weight"], sample_rows(896, 256))
    importance = np.where(np.arange(896) < 448, 100.0, 0.01).astype(np.float32)
    # Q4_0 with an imatrix searches scales that favour the important columns; gguf-py's reference
    # quantizer does not, so measured by the same weighted error it must do clearly worse
    aware = _native.quant_error(int(Q.Q4_0), w, importance, 2)
    assert aware < 0.9 * reference_error(w, Q.Q4_0, importance)


def test_measure_covers_every_quantizable_weight(small_model, tensors):
    steps = []
    costs = measure(small_model, None, ["Q4_0", "Q4_K", "Q8_0"], max_rows=8, progress=lambda *a: steps.append(a))
    expected = {n for n, t in tensors.items() if quantizable(t)}
    assert {c.name for c in costs} == expected
    assert all(len(tensors[n].shape) == 2 and not n.endswith("_norm.weight") for n in expected)
    assert "token_embd.weight" in expected and "blk.0.attn_q.bias" not in expected
    for c in costs:
        assert c.shape == tuple(int(d) for d in tensors[c.name].shape) and c.row_len == c.shape[0]
        assert c.n_elements == c.shape[0] * c.shape[1]
        # k-quants only where rows are whole 256-blocks (ffn_down here; 896 is not)
        assert set(c.errors) == ({"Q4_0", "Q4_K", "Q8_0"} if c.row_len % 256 == 0 else {"Q4_0", "Q8_0"})
        assert all(np.isfinite(v) and v >= 0 for v in c.errors.values())
    assert steps[-1] == ("sensitivity", len(costs), len(costs))


def test_row_subset_estimates_the_whole_tensor(reader, tensors):
    tensor = tensors["blk.3.attn_k.weight"]  # 128 rows of 896
    full = tensor_cost(reader, tensor, None, ["Q4_0"], max_rows=None, n_threads=2).errors["Q4_0"]
    part = tensor_cost(reader, tensor, None, ["Q4_0"], max_rows=32, n_threads=2).errors["Q4_0"]
    assert part == pytest.approx(full, rel=0.25)


def test_imatrix_is_used_and_checked(reader, tensors):
    tensor = tensors["blk.0.attn_q.weight"]
    importance = np.linspace(0.0, 4.0, 896).astype(np.float32)
    imatrix = Imatrix(values={tensor.name: importance}, tokens=1, chunks=1)
    cost = tensor_cost(reader, tensor, imatrix, ["Q8_0"], max_rows=None, n_threads=2)
    w = read_rows(reader, tensor, np.arange(896))
    assert cost.errors["Q8_0"] == pytest.approx(reference_error(w, Q.Q8_0, importance), rel=1e-6)
    foreign = Imatrix(values={tensor.name: importance[:100]}, tokens=1, chunks=1)
    with pytest.raises(ConvertError, match="another model"):
        tensor_cost(reader, tensor, foreign, ["Q8_0"], max_rows=8, n_threads=2)


def test_types_ggml_cannot_make_are_refused_not_fatal(reader, tensors):
    w = read_rows(reader, tensors["blk.0.ffn_down.weight"], sample_rows(896, 4))
    with pytest.raises(ValueError, match="without an importance matrix"):
        _native.quant_error(int(Q.IQ2_XXS), w, None, 1)  # ggml itself would abort the process
    with pytest.raises(ValueError, match="cannot quantize to q8_K"):
        _native.quant_error(int(Q.Q8_K), w, None, 1)
    # without the tensor's importance, the i-quants llama.cpp refuses to make are no candidates
    assert tensor_cost(reader, tensors["blk.0.ffn_down.weight"], None, ["IQ2_XXS"], max_rows=4, n_threads=1).errors == {}


def test_sizes_come_from_ggml_block_layout():
    assert block_size("Q4_K") == 256 and block_size("Q8_0") == 32
    assert type_nbytes("Q4_K", 256 * 10) == 144 * 10
    assert type_nbytes("F16", 1000) == 2000
    with pytest.raises(ConvertError, match="whole Q4_K blocks"):
        type_nbytes("Q4_K", 100)
    with pytest.raises(ConvertError, match="unknown tensor type"):
        block_size("Q9_X")


_MEASURE_IN_CHILD = """
import sys
import gguf
import numpy as np
from edgerun import _native
from edgerun.convert.sensitivity import measure
from edgerun.errors import ConvertError
try:
    measure(sys.argv[1], None, ["Q8_0", "F16"], max_rows=8, n_threads=1)
except ConvertError as exc:
    print("ConvertError:", exc)
try:  # the native entry refuses it too, for callers other than measure
    _native.quant_error(int(gguf.GGMLQuantizationType.Q8_0), np.zeros((4, 0), np.float32), None, 1)
except ValueError as exc:
    print("ValueError:", exc)
"""


def test_zero_width_tensor_is_refused_not_a_sigfpe(tmp_path):
    """ggml's quantizer takes `start % n_per_row`: rows of 0 values divide by zero and the signal
    ends the process. A child process, so that such a crash fails this test instead of pytest."""
    path = tmp_path / "zero-width.gguf"
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_tensor("blk.0.attn_k.weight", np.ones((4, 32), np.float16))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 0), np.float16))  # 4 rows of no values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    proc = subprocess.run([sys.executable, "-c", _MEASURE_IN_CHILD, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert "ConvertError: blk.0.attn_q.weight: an empty tensor (0 x 4 values)" in proc.stdout
    assert "ValueError: rows of 0 values cannot be quantized" in proc.stdout
