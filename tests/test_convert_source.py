"""prepare_f16: HF checkpoints (tiny random ones, and the fixture of the real 0.5B) into F16/BF16
GGUFs that real llama.cpp loads and runs; GGUF sources passed through or refused; bad input
refused with a ConvertError."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from testkit import weights
from testkit.fixture_vocab import field
from edgerun.convert.source import SUPPORTED_ARCHS, prepare_f16
from testkit.tiny import write_tiny_checkpoint
from edgerun.errors import ConvertError
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings
from test_hf_fixture import real_fixture

CODE = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nfor i in range(10):\n    print(i, fibonacci(i))\n")


def run_logits(path: Path, text: str) -> tuple[list[int], np.ndarray]:
    """llama.cpp's logits at every position of TEXT (one batch, one thread, CPU)."""
    settings = EngineSettings(n_ctx=256, n_batch=256, n_ubatch=256, n_threads=1)
    with Model(path) as model, Context(model, settings) as ctx:
        tokens = model.tokenize(text, add_special=True)
        ctx.eval(tokens, all_logits=True)
        return tokens, np.stack([ctx.logits(i).copy() for i in range(len(tokens))])


def gguf_tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_tiny_checkpoint_becomes_a_gguf_llama_cpp_runs(tmp_path, arch):
    src = write_tiny_checkpoint(tmp_path / "src", arch)
    out = prepare_f16(str(src), tmp_path / "work")
    reader = gguf.GGUFReader(out)
    assert field(reader, "general.architecture") == arch
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.attn_q.weight"] == "F16" and types["blk.1.attn_norm.weight"] == "F32"
    assert ("output.weight" in types) == (arch == "llama")  # the tiny llama has an untied head
    assert field(reader, "tokenizer.ggml.model") == ("llama" if arch == "gemma3" else "gpt2")
    assert field(reader, "tokenizer.chat_template")
    tokens, logits = run_logits(out, "def the print return and class self")
    assert len(tokens) > 3 and np.isfinite(logits).all() and logits.std() > 0.1


def test_llama_rotary_permutation_matches_hf(tmp_path):
    """HF's Llama and Qwen2 (without biases) are the same function; llama.cpp runs llama with
    interleaved rope, qwen2 with neox rope. The same weights converted as each must give the same
    logits, which holds only if the q/k rows are permuted exactly as llama.cpp expects."""
    qwen = write_tiny_checkpoint(tmp_path / "qwen", "qwen2", bias=False, seed=3)
    llama = Path(shutil.copytree(qwen, tmp_path / "llama"))
    config = json.loads((llama / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (llama / "config.json").write_text(json.dumps(config))
    _, a = run_logits(prepare_f16(str(qwen), tmp_path / "work"), "def the print return and class self in of")
    _, b = run_logits(prepare_f16(str(llama), tmp_path / "work"), "def the print return and class self in of")
    assert np.abs(a - b).max() < 1e-3


def test_sentencepiece_tokenizer_model_tokenizes_as_sentencepiece_does(tmp_path):
    """A checkpoint with only tokenizer.model (Llama 2 / Gemma style): llama.cpp's tokenization
    of the converted GGUF equals sentencepiece's own."""
    spm = pytest.importorskip("sentencepiece")
    text = ("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
            "the quick brown fox jumps over the lazy dog. print the result and return it.\n") * 50
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=proto, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    src = write_tiny_checkpoint(tmp_path / "src", "llama")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.model").write_bytes(proto.getvalue())
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    config = json.loads((src / "config.json").read_text())
    config["vocab_size"] = sp.vocab_size()
    (src / "config.json").write_text(json.dumps(config))
    tensors = weights.load(src / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        values, dtype = tensors[name]
        tensors[name] = values[: sp.vocab_size()], dtype
    weights.save(src / "model.safetensors", tensors)

    out = prepare_f16(str(src), tmp_path / "work")
    sample = "def the fibonacci(n): print it, lazy dog!"
    with Model(out) as model:
        assert model.tokenize(sample, add_special=True) == [sp.bos_id(), *sp.encode(sample)]


def test_llama3_rope_scaling_becomes_the_rope_freqs_tensor(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "llama")
    config = json.loads((src / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (src / "config.json").write_text(json.dumps(config))
    out = prepare_f16(str(src), tmp_path / "work")
    factors = gguf_tensor(gguf.GGUFReader(out), "rope_freqs.weight")
    # head_dim 16: 8 frequencies; the fastest keep factor 1, the slowest are stretched 8x
    assert factors.shape == (8,) and factors[0] == 1.0 and factors[-1] == 8.0
    assert np.all(np.diff(factors) >= 0)
    _, logits = run_logits(out, "the and")
    assert np.isfinite(logits).all()


def test_bf16_output_keeps_bf16_weights_exactly(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "gemma3")
    out = prepare_f16(str(src), tmp_path / "work", out_type="BF16")
    reader = gguf.GGUFReader(out)
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_BF16
    tensors = weights.load(src / "model.safetensors")
    want = weights.as_f32(tensors["model.layers.1.mlp.down_proj.weight"])
    np.testing.assert_array_equal(gguf_tensor(reader, "blk.1.ffn_down.weight"), want)
    norm, dtype = tensors["model.layers.1.input_layernorm.weight"]
    assert dtype == "F32"
    # HF's Gemma3RMSNorm scales by (1 + w); llama.cpp scales by the stored weight
    np.testing.assert_allclose(gguf_tensor(reader, "blk.1.attn_norm.weight"), 1.0 + norm, rtol=0, atol=1e-7)
    _, logits = run_logits(out, "the and")
    assert np.isfinite(logits).all()


def test_intermediate_is_reused_and_unquantized_gguf_passes_through(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "qwen2")
    first = prepare_f16(str(src), tmp_path / "work")
    stamp = first.stat().st_mtime_ns
    assert prepare_f16(str(src), tmp_path / "work") == first and first.stat().st_mtime_ns == stamp
    assert prepare_f16(str(first), tmp_path / "other") == first
    assert not (tmp_path / "other").exists()


def test_interrupted_conversion_leaves_nothing(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "llama")

    def interrupt(label, done, total):
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_f16(str(src), tmp_path / "work", progress=interrupt)
    assert list((tmp_path / "work").iterdir()) == []


# -- refusals -------------------------------------------------------------------------------------

def test_pickled_weights_are_refused_unopened(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "llama")
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"not even a pickle: it must never be opened")
    with pytest.raises(ConvertError, match=r"pickle.*safetensors"):
        prepare_f16(str(src), tmp_path / "work")
    with pytest.raises(ConvertError, match="pickle"):
        prepare_f16(str(src / "pytorch_model.bin"), tmp_path / "work")


def test_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    src = tmp_path / "mamba"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    weights.save(src / "model.safetensors", {"x": weights.stored(np.zeros(2), "f32")})
    with pytest.raises(ConvertError, match=r"MambaForCausalLM.*llama.*qwen2.*gemma3"):
        prepare_f16(str(src), tmp_path / "work")


def test_missing_config_and_missing_paths_are_refused(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "qwen2")
    (src / "config.json").unlink()
    with pytest.raises(ConvertError, match="no config.json"):
        prepare_f16(str(src), tmp_path / "work")
    with pytest.raises(ConvertError, match="no such file"):
        prepare_f16(str(tmp_path / "nowhere"), tmp_path / "work")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConvertError, match="not a GGUF"):
        prepare_f16(str(tmp_path / "notes.txt"), tmp_path / "work")
    with pytest.raises(ConvertError, match="hf://org/repo"):
        prepare_f16("hf://just-a-name", tmp_path / "work")


def test_hf_uri_that_cannot_be_fetched_is_a_convert_error(tmp_path, monkeypatch):
    """Offline, with an empty cache: a one-line ConvertError, not a huggingface_hub traceback.
    huggingface_hub reads HF_HUB_OFFLINE once, at import, into the constant it asks before each
    request: the test sets that constant as the variable would have."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    with pytest.raises(ConvertError) as caught:
        prepare_f16("hf://edgerun-test/absent@main", tmp_path / "work")
    assert str(caught.value).startswith("hf://edgerun-test/absent@main: download failed")


def test_quantized_gguf_is_refused(tmp_path, small_model):
    with pytest.raises(ConvertError, match=r"already quantized \(file type Q4_K_M\).*F16/BF16/F32 GGUF or the original HF"):
        prepare_f16(str(small_model), tmp_path / "work")


def test_f16_gguf_with_a_quantized_tensor_is_refused(tmp_path):
    """An F16-labelled file holding a Q8_0 tensor (a hand-made mix) is caught by the table check."""
    f16 = gguf.GGUFReader(prepare_f16(str(write_tiny_checkpoint(tmp_path / "src", "qwen2")), tmp_path / "work"))
    mixed = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(mixed, "qwen2")
    for key, f in f16.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            vtype = f.types[0]
            w.add_key_value(key, f.contents(), vtype, sub_type=f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in f16.tensors:
        data = gguf_tensor(f16, t.name)
        if t.name == "blk.0.ffn_down.weight":
            w.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data.astype(np.float16) if data.ndim == 2 else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match=r"already quantized \(Q8_0 tensors\)"):
        prepare_f16(str(mixed), tmp_path / "work")


# -- the real 0.5B round trip ----------------------------------------------------------------------

@pytest.mark.slow
def test_real_qwen_round_trip(tmp_path_factory, small_model):
    """Q5_0 GGUF -> f16 HF fixture -> prepare_f16 -> F16 GGUF: every tensor equals gguf-py's
    dequantization of the source rounded to f16, the tokenizer and hyperparameter metadata are the
    source's, and llama.cpp's predictions agree with the quantized source's."""
    root = real_fixture(tmp_path_factory, small_model, "qwen05")
    out = prepare_f16(str(root), tmp_path_factory.mktemp("work"))
    src, f16 = gguf.GGUFReader(small_model), gguf.GGUFReader(out)

    assert {t.name for t in src.tensors} == {t.name for t in f16.tensors}
    for t in src.tensors:
        want = gguf_tensor(src, t.name)
        got = gguf_tensor(f16, t.name)
        np.testing.assert_array_equal(got, want if want.ndim == 1 else want.astype(np.float16), err_msg=t.name)

    keys = [k for k in src.fields if k.startswith(("tokenizer.", "qwen2."))]
    assert len(keys) > 15
    for key in keys:
        assert field(f16, key) == field(src, key), key

    tokens_q, logits_q = run_logits(small_model, CODE)
    tokens_f, logits_f = run_logits(out, CODE)
    assert tokens_q == tokens_f and len(tokens_q) > 40
    # The weights are now exactly the dequantized source's (checked above), so what is left is
    # the kernels: llama.cpp's Q5_0/Q6_K/Q8_0 matmuls quantize the activations to 8 bits, the F16
    # one rounds them to f16. Measured on this prompt (54 positions): the same argmax at every
    # position, max |diff| 0.59 and mean 0.06 on logits spanning -32..30. (An F16 GGUF written
    # straight from gguf-py's dequantization gives logits identical to this one, diff 0.0.)
    assert (logits_q.argmax(1) == logits_f.argmax(1)).mean() >= 0.95
    assert np.abs(logits_q - logits_f).max() < 1.5

