"""The quality report on real GGUFs: a model against itself and against a smaller quantization."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import llama_cpp
import pytest

from edgerun.convert import report
from edgerun.errors import ConvertError

EVAL_TEXT = (Path(__file__).parents[1] / "edgerun" / "data" / "calib" / "eval_code.txt").read_text()
N_CTX = 128  # short chunks keep these tests quick; the math is the same at 512


@pytest.fixture(scope="module")
def q2_model(small_model, tmp_path_factory) -> Path:
    """The 0.5B requantized to Q2_K by llama.cpp's own quantizer: measurably worse."""
    dst = tmp_path_factory.mktemp("quant") / "q2_k.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(small_model).encode(), str(dst).encode(), ctypes.byref(params)) == 0
    return dst


@pytest.mark.slow
def test_model_against_itself_is_identical(small_model):
    q = report.evaluate(small_model, small_model, EVAL_TEXT, n_ctx=N_CTX, max_chunks=3)
    assert q.n_chunks == 3 and q.n_positions == 3 * (N_CTX - 1 - N_CTX // 2)
    assert q.kld_mean == 0.0 and q.kld_max == 0.0
    assert q.top1_agreement == 1.0
    assert q.ppl == q.ppl_ref
    assert 1.0 < q.ppl < 50.0  # code is predictable, but not trivially


@pytest.mark.slow
def test_smaller_quantization_diverges(small_model, q2_model):
    q = report.evaluate(small_model, q2_model, EVAL_TEXT, n_ctx=N_CTX, max_chunks=3)
    assert q.kld_mean > 0.01 and q.kld_p99 >= q.kld_mean and q.kld_max >= q.kld_p99
    assert 0.3 < q.top1_agreement < 1.0
    assert q.ppl > q.ppl_ref

    r = report.build(q2_model, q, budget_bytes=123)
    assert r.size_bytes == q2_model.stat().st_size
    assert r.tensor_bytes < r.size_bytes < small_model.stat().st_size and 2.0 < r.bpw < 6.0  # 896-wide rows fall back to Q4_0
    assert r.tensors["blk.0.ffn_down.weight"].type in ("Q2_K", "Q3_K", "Q4_K", "Q4_0", "Q5_0", "Q8_0")
    doc = r.to_json()
    for key in ("size_bytes", "bpw", "kld_mean", "top1_agreement", "ppl", "ppl_ref", "tensors"):
        assert key in doc
    assert doc["budget_bytes"] == 123
    assert doc["tensors"]["output_norm.weight"] == {"type": "F32", "bytes": r.tensors["output_norm.weight"].bytes}
    table = r.table()
    assert "mean KLD" in table and "ffn_down" in table and "output_norm" not in table


def test_report_json_is_written_atomically(small_model, tmp_path):
    r = report.build(small_model)
    path = tmp_path / "r.json"
    r.write(path)
    doc = json.loads(path.read_text())
    assert doc["kld_mean"] is None and doc["size_bytes"] == small_model.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left


@pytest.mark.slow
def test_too_short_text_and_foreign_vocab_are_errors(small_model, other_vocab_model):
    with pytest.raises(ConvertError, match="fewer than one chunk"):
        report.evaluate(small_model, small_model, "def f(): pass", n_ctx=N_CTX)
    with pytest.raises(ConvertError, match="tokens but the reference"):
        report.evaluate(small_model, other_vocab_model, EVAL_TEXT, n_ctx=N_CTX, max_chunks=1)
