"""The importance matrix, gathered by the native eval callback while llama.cpp runs the real 0.5B."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgerun import _native
from edgerun.convert.calibrate import chunk_tokens, collect_imatrix
from edgerun.convert.imatrix import Imatrix
from edgerun.errors import ConvertError

TEXT = (Path(__file__).resolve().parents[1] / "edgerun" / "runtime" / "engine.py").read_text()
N_CTX = 128
CHUNKS = 3
MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_gate", "ffn_down")


@pytest.fixture(scope="module")
def collected(small_model):
    """One calibration run that also keeps the raw rows of blk.0's attention norm output: the
    input of blk.0.attn_q, read from another node of the graph."""
    collector = _native.ImatrixCollector()
    collector.set_capture("attn_norm-0")
    steps = []
    imatrix = collect_imatrix(small_model, TEXT, n_ctx=N_CTX, max_chunks=CHUNKS, n_threads=2,
                              progress=lambda *a: steps.append(a), collector=collector)
    return imatrix, collector, steps


@pytest.fixture(scope="module")
def weights(small_model) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(small_model).tensors}


@pytest.mark.slow
def test_every_matmul_weight_has_a_finite_entry_of_its_input_size(collected, weights):
    imatrix, _, steps = collected
    n_layer = 1 + max(int(n.split(".")[1]) for n in weights if n.startswith("blk."))
    expected = {f"blk.{i}.{m}.weight" for i in range(n_layer) for m in MATMULS}
    # the output projection is a matmul too; with tied embeddings its weight is token_embd's
    expected.add("output.weight" if "output.weight" in weights else "token_embd.weight")
    assert set(imatrix.values) == expected
    for name, v in imatrix.values.items():
        assert v.dtype == np.float32
        assert v.shape == (int(weights[name].shape[0]),), name  # one value per input column
        assert np.all(np.isfinite(v)) and np.all(v >= 0), name
        assert v.max() > 0, name
    # the chunks are spread over the text, its last (shorter) chunk among them
    assert imatrix.chunks == CHUNKS and (CHUNKS - 1) * N_CTX < imatrix.tokens <= CHUNKS * N_CTX
    assert steps == [("calibrate", i + 1, CHUNKS) for i in range(CHUNKS)]


@pytest.mark.slow
def test_attn_q_importance_is_the_column_mean_square_of_its_input(collected):
    imatrix, collector, _ = collected
    rows = collector.captured()  # (tokens, n_embd): every row attn_q multiplied
    assert rows.shape == (imatrix.tokens, imatrix.values["blk.0.attn_q.weight"].size)
    expected = (rows.astype(np.float64) ** 2).mean(axis=0)
    np.testing.assert_allclose(imatrix.values["blk.0.attn_q.weight"], expected, rtol=1e-5)
    # q, k and v read the same input, so they must agree as well
    np.testing.assert_allclose(imatrix.values["blk.0.attn_k.weight"], expected, rtol=1e-5)
    sums, counts = collector.results()["blk.0.attn_q.weight"]
    assert counts.tolist() == [imatrix.tokens] and sums.shape == (1, rows.shape[1])


@pytest.mark.slow
def test_save_and_load_round_trip_without_pickle(collected, tmp_path):
    imatrix, _, _ = collected
    path = imatrix.save(tmp_path / "calib.imatrix.npz")
    back = Imatrix.load(path)
    assert (back.tokens, back.chunks) == (imatrix.tokens, imatrix.chunks)
    assert back.values.keys() == imatrix.values.keys()
    for name, v in imatrix.values.items():
        np.testing.assert_array_equal(back.values[name], v)
    assert [p.name for p in tmp_path.iterdir()] == ["calib.imatrix.npz"]  # no temp left behind


def test_load_refuses_pickled_or_foreign_files(tmp_path):
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **{"w:x": np.array([{"a": 1}], dtype=object), "__tokens__": 1, "__chunks__": 1})
    with pytest.raises(ConvertError, match="not an edgerun imatrix"):
        Imatrix.load(pickled)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ConvertError, match="not an edgerun imatrix"):
        Imatrix.load(junk)


def test_chunks_start_with_bos_and_drop_only_a_short_tail():
    tokens = list(range(100, 100 + 2 * 31 + 5))
    chunks = chunk_tokens(tokens, 32, bos=1)
    assert [len(c) for c in chunks] == [32, 32]  # the 5-token tail is too short to count
    assert all(c[0] == 1 for c in chunks) and chunks[1][1] == 131
    assert chunk_tokens(list(range(20)), 32, bos=None) == [list(range(20))]


@pytest.mark.slow
def test_too_little_text_is_refused(small_model):
    with pytest.raises(ConvertError, match="at least"):
        collect_imatrix(small_model, "hi", n_ctx=N_CTX)


def test_calibration_chunks_are_spread_over_the_whole_text():
    from edgerun.convert.calibrate import spread

    chunks = list(range(27))
    assert spread(chunks, 8) == [0, 4, 7, 11, 15, 19, 22, 26]  # first and last, evenly between
    assert spread(chunks, None) == chunks and spread(chunks, 40) == chunks
    assert spread(chunks, 1) == [0]
