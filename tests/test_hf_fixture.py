"""The fixture maker (GGUF -> HF directory) and the tiny checkpoints: both directions of the
conversion must be exact inverses, with gguf-py's own name maps."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from testkit import weights
from testkit.fixture import hf_names, make_hf_fixture
from testkit.fixture_vocab import field
from edgerun.convert.hf_reader import SUPPORTED_ARCHS, open_checkpoint
from edgerun.convert.hf_vocab import load_vocab
from edgerun.convert.source import prepare_f16
from testkit.tiny import write_tiny_checkpoint
from edgerun.errors import ConvertError

ARCHS = SUPPORTED_ARCHS
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
               "vocab_size", "tie_word_embeddings")


def real_fixture(tmp_path_factory, gguf_path: Path, name: str, dtype: str = "f16") -> Path:
    """An HF fixture of a real GGUF, made once per test session (shared by the test modules
    through the session's base temp dir; the fixture appears complete or not at all)."""
    out = tmp_path_factory.getbasetemp() / f"hf-fixture-{name}-{dtype}"
    if not out.exists():
        make_hf_fixture(gguf_path, out, dtype=dtype)
    return out


def hf_tensors(root: Path) -> dict[str, weights.Stored]:
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        out.update(weights.load(path))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_names_invert_gguf_py_name_map(arch):
    n_blocks = 3
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_blocks)
    names = hf_names(arch, n_blocks)
    assert {"token_embd", "output_norm", "output", "blk.2.attn_q", "blk.2.ffn_down"} <= set(names)
    for gguf_name, hf in names.items():
        assert name_map.get_name(hf) == gguf_name
    if arch == "gemma3":  # Gemma's four norms per block each get their own GGUF tensor
        assert names["blk.0.post_attention_norm"] == "model.layers.0.post_attention_layernorm"
        assert names["blk.0.ffn_norm"] == "model.layers.0.pre_feedforward_layernorm"
    else:
        assert names["blk.0.ffn_norm"] == "model.layers.0.post_attention_layernorm"


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoint_survives_hf_gguf_hf(tmp_path, arch):
    """HF -> GGUF F16 -> HF gives back every tensor (f16 weights round exactly; Gemma's norms
    pass through +1 and -1 in float32), the config and the tokenizer."""
    src = write_tiny_checkpoint(tmp_path / "src", arch, dtype="f16", n_layers=2)
    f16 = prepare_f16(str(src), tmp_path / "work")
    back = make_hf_fixture(f16, tmp_path / "back", dtype="f16")

    a, b = hf_tensors(src), hf_tensors(back)
    assert set(a) == set(b)
    for name, x in a.items():
        atol = 1e-6 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        assert b[name][1] == x[1], name  # the same dtype
        np.testing.assert_allclose(weights.as_f32(b[name]), weights.as_f32(x), rtol=0, atol=atol, err_msg=name)

    ca, cb = (json.loads((d / "config.json").read_text()) for d in (src, back))
    assert {k: ca[k] for k in CONFIG_KEYS} == {k: cb[k] for k in CONFIG_KEYS}
    assert ca["architectures"] == cb["architectures"]

    with open_checkpoint(src) as ck:
        va = load_vocab(src, arch, ck.config["vocab_size"])
    vb = load_vocab(back, arch, cb["vocab_size"])
    assert (va.model, va.pre, va.tokens, va.types) == (vb.model, vb.pre, vb.tokens, vb.types)
    if va.scores is not None:  # GGUF keeps scores as float32
        np.testing.assert_array_equal(np.float32(va.scores), np.float32(vb.scores))
    assert va.special.merges == vb.special.merges
    assert va.special.special_token_ids == vb.special.special_token_ids
    assert va.special.chat_template == vb.special.chat_template


def test_fixture_refuses_an_existing_directory(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", "qwen2")
    f16 = prepare_f16(str(src), tmp_path / "work")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConvertError, match="already exists"):
        make_hf_fixture(f16, tmp_path / "taken")


@pytest.mark.slow
def test_fixture_of_real_qwen_matches_its_gguf(tmp_path_factory, small_model):
    """The 0.5B fixture: HF names and layout, shards with an index, config from the GGUF's
    hyperparameters, every 2-D weight the bf16/f16 rounding of gguf-py's dequantization."""
    root = real_fixture(tmp_path_factory, small_model, "qwen05")
    reader = gguf.GGUFReader(small_model)
    config = json.loads((root / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["num_hidden_layers"] == field(reader, "qwen2.block_count") == 24
    assert config["num_key_value_heads"] == field(reader, "qwen2.attention.head_count_kv")
    assert config["rms_norm_eps"] == 1e-6 and config["vocab_size"] == 151936
    assert (root / "model.safetensors.index.json").is_file() and len(list(root.glob("*.safetensors"))) > 1
    tok_config = json.loads((root / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["chat_template"] == field(reader, "tokenizer.chat_template")

    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    source = {t.name: t for t in reader.tensors}
    for hf, gguf_name in (("model.layers.3.self_attn.q_proj.weight", "blk.3.attn_q.weight"),
                          ("model.layers.3.mlp.down_proj.weight", "blk.3.ffn_down.weight"),
                          ("model.layers.3.self_attn.k_proj.bias", "blk.3.attn_k.bias")):
        t = source[gguf_name]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        got, _ = weights.load(root / index[hf])[hf]
        if got.ndim == 2:
            want = want.astype(np.float16)
        np.testing.assert_array_equal(got, want)
