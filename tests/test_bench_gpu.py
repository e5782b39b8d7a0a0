"""The GPU scenarios' parts that run anywhere: the random-weight shape writer (a small shape with a
small vocabulary; with the real one in the model tier), the `edgerun run` and llama-bench sides on
it, and one-line refusals."""
import dataclasses
import shutil

import pytest

from edgerun.bench import gpu, shapes
from edgerun.errors import ConfigError, EngineError
from edgerun.models.gguf_check import inspect
from testkit.cli import run_cli

# k-quants need rows of 256: the smallest shape Q4_K_M takes. Its vocabulary holds the 256 byte
# tokens, filler and the control tokens; a Q4_K_M of the real 151,936 rows takes seconds of every
# core, so the shape with the real vocabulary is written in the model tier.
SMALL = shapes.Shape(n_embd=256, n_ff=512, n_layer=2, n_head=4, n_head_kv=2, tied=False, n_vocab=512)
REAL_VOCAB = dataclasses.replace(SMALL, n_vocab=shapes.N_VOCAB)


def n_weights(s: shapes.Shape) -> int:
    kv = s.n_head_kv * (s.n_embd // s.n_head)
    block = 2 * s.n_embd * s.n_embd + 2 * kv * s.n_embd + 3 * s.n_ff * s.n_embd  # q, output; k, v; ffn
    return s.n_layer * block + s.n_vocab * s.n_embd * (1 if s.tied else 2)


@pytest.fixture(scope="module")
def small_shape(tmp_path_factory):
    return shapes.write(SMALL, tmp_path_factory.mktemp("shapes") / "shape-small-q4_k_m.gguf", "shape-small")


@pytest.mark.slow
def test_a_shape_is_a_q4_k_m_qwen2_of_its_dimensions(small_shape):
    info = inspect(small_shape)
    assert info.arch == "qwen2"
    assert (info.n_embd, info.n_layers, info.n_vocab) == (256, 2, SMALL.n_vocab)
    assert not list(small_shape.parent.glob(".*")), "the F16 and partial files are removed"
    # quantized: under half the F16's two bytes a weight
    assert small_shape.stat().st_size < n_weights(SMALL) * 2 / 2


def test_the_benchmarked_shapes_have_the_real_vocabulary():
    assert {s.n_vocab for s in shapes.SHAPES.values()} == {shapes.N_VOCAB}


@pytest.mark.model  # no catalog model, but a real one's vocabulary: its Q4_K_M takes seconds
@pytest.mark.slow
def test_a_shape_with_the_real_vocabulary_is_written_and_decodes(tmp_path):
    shape = shapes.write(REAL_VOCAB, tmp_path / "shape-real-vocab-q4_k_m.gguf", "shape-real-vocab")
    info = inspect(shape)
    assert (info.arch, info.n_embd, info.n_layers, info.n_vocab) == ("qwen2", 256, 2, shapes.N_VOCAB)
    assert not list(tmp_path.glob(".*")), "the F16 and partial files are removed"
    # quantized: under half the F16's two bytes a weight for the embedding and the head alone
    assert shape.stat().st_size < (2 * shapes.N_VOCAB * 256) * 2 / 2
    stats = gpu.edgerun_run(shape, "--gpu-layers", "0", "--threads", "1", tokens=8)
    assert stats["generated_tokens"] >= 1 and stats["prompt_tokens"] == len(gpu.PROMPT.encode())


@pytest.mark.slow
def test_edgerun_run_decodes_a_shape_and_reports_its_prompt(small_shape):
    stats = gpu.edgerun_run(small_shape, "--gpu-layers", "0", "--threads", "1", tokens=8)
    assert stats["generated_tokens"] >= 1 and stats["decode_tok_s"] > 0
    # the byte-level vocabulary has one merge that this prompt lacks: one token per byte (the
    # 83-token prompt of the decode figures)
    assert stats["prompt_tokens"] == len(gpu.PROMPT.encode()) == 83


def test_a_failed_run_is_one_engine_error_naming_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(EngineError, match="broken.gguf"):
        gpu.edgerun_run(bad, tokens=4)


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which(str(gpu._CHECKOUT_BENCH)) or shutil.which("llama-bench")),
                    reason="llama-bench is built by EDGERUN_LLAMA_BENCH=1 scripts/setup.sh")
def test_llama_bench_measures_a_shape(small_shape):
    binary = gpu._llama_bench_binary(None)
    assert gpu.llama_bench(binary, small_shape, ngl=0, tokens=8, reps=1, threads=1) > 0
    assert gpu.llama_bench(binary, small_shape, ngl=0, tokens=8, reps=1, depth=16, threads=1) > 0


def test_unknown_shapes_and_a_missing_llama_bench_are_refused():
    assert shapes.names("0.5b, 7b") == ["0.5b", "7b"]
    with pytest.raises(ConfigError, match="unknown shape '3b'; there are: 0.5b, 1.5b, 7b"):
        shapes.names("0.5b,3b")
    with pytest.raises(ConfigError, match="EDGERUN_LLAMA_BENCH=1 scripts/setup.sh"):
        gpu._llama_bench_binary("/nonexistent/llama-bench")


@pytest.mark.parametrize("argv, words", [
    (["gpu-decode", "--shapes", "3b"], ["unknown shape '3b'"]),
    (["gpu-offload", "--cases", "7b-half,nope"], ["unknown offload case"]),
    (["gpu-decode", "--llama-bench", "/nonexistent/lb"], ["no llama-bench at /nonexistent/lb"]),
])
def test_the_cli_refuses_in_one_line_before_writing_a_shape(tmp_path, argv, words, monkeypatch, capsys):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path))
    proc = run_cli(capsys, "bench", *argv, "--shapes-dir", str(tmp_path))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in last
    assert not list(tmp_path.glob("shape-*"))
