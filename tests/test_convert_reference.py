"""The converter checked against transformers' own forward pass.

For each architecture edgerun converts (and the config variants a user's checkpoint brings: tied
or untied heads, Llama 3.x's and linear rope scaling, a Mistral config, Qwen2's q/k/v biases,
Qwen3's q/k norms, Gemma 3's sliding window), a tiny random checkpoint is written in HF format,
converted to an F16 GGUF as `edgerun convert` does, loaded in llama.cpp, and its logits at every
position of a few token sequences are compared with transformers' float32 forward pass of the
same checkpoint. A wrong tensor name, a missing permutation, a norm stored the wrong way or a rope
setting lost in translation moves the logits by whole units; what F16 itself costs (llama.cpp
rounds activations to F16 for its matrix products) stays within a few thousandths of the logits'
scale."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgerun.convert.source import prepare_f16
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings
from testkit.tiny import write_tiny_checkpoint

TOLERANCE = 0.01  # max |llama.cpp - transformers| over the logits' largest magnitude
SEQ_LEN = 48  # past the gemma fixture's 16-token window, and far enough for rope scaling to matter
N_SEQUENCES = 3


def _llama3_rope(config: dict) -> None:
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _linear_rope(config: dict) -> None:
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}


def _mistral(config: dict) -> None:
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)


# name -> (architecture, checkpoint options, config edit)
CASES = {
    "llama": ("llama", {}, None),
    "llama-tied-head": ("llama", {"tie": True}, None),
    "llama3-rope-scaling": ("llama", {}, _llama3_rope),
    "llama-linear-rope": ("llama", {}, _linear_rope),
    "mistral": ("llama", {}, _mistral),
    "qwen2": ("qwen2", {}, None),
    "qwen2-untied-no-bias": ("qwen2", {"tie": False, "bias": False}, None),
    "qwen3": ("qwen3", {}, None),
    "qwen3-untied": ("qwen3", {"tie": False}, None),
    "gemma3": ("gemma3", {}, None),
}


def _checkpoint(root: Path, name: str) -> Path:
    arch, options, edit = CASES[name]
    ckpt = write_tiny_checkpoint(root / "hf", arch, n_ctx=256, head_scale=4.0, **options)
    if edit is not None:
        path = ckpt / "config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config, indent=1))
    return ckpt


def _sequences(n_tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, n_tokens, SEQ_LEN).tolist() for _ in range(N_SEQUENCES)]


def _llama_cpp_logits(gguf: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    out = []
    with Model(gguf) as model:
        for tokens in seqs:
            settings = EngineSettings(n_ctx=256, n_batch=64, n_threads=1, gpu_layers="0")
            with Context(model, settings) as ctx:
                ctx.eval(tokens, all_logits=True)
                out.append(np.stack([ctx.logits(i).copy() for i in range(len(tokens))]))
    return out


def _transformers_logits(ckpt: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    # imported here, not at collection: torch and transformers take seconds to import, and every
    # pytest-xdist worker collects this module
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                              attn_implementation="eager")
    model.eval()
    # one thread: on matrices this small torch's worker threads spin at each barrier for 15-40x
    # the work itself (0.15-0.5 s of CPU per checkpoint on two cores, 0.01 s on one)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return [model(torch.tensor([tokens])).logits[0].numpy() for tokens in seqs]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(CASES))
def test_llama_cpp_logits_match_transformers(tmp_path, name):
    ckpt = _checkpoint(tmp_path, name)
    gguf = prepare_f16(str(ckpt), tmp_path / "work")
    n_tokens = len(json.loads((ckpt / "tokenizer.json").read_text())["model"]["vocab"])
    seqs = _sequences(n_tokens)
    ours, theirs = _llama_cpp_logits(gguf, seqs), _transformers_logits(ckpt, seqs)
    for a, b in zip(ours, theirs):
        n = min(a.shape[1], b.shape[1])  # rows past the tokenizer's last token are dropped or padded
        scale = float(np.abs(b[:, :n]).max())
        diff = float(np.abs(a[:, :n] - b[:, :n]).max())
        assert diff <= TOLERANCE * scale, f"{name}: max |diff| {diff:.4f} against logits up to {scale:.2f}"
        assert (a[:, :n].argmax(1) == b[:, :n].argmax(1)).mean() >= 0.95


def test_a_wrong_conversion_is_caught(tmp_path, monkeypatch):
    """The comparison can fail: the same llama checkpoint written with its q/k rows left in HF's
    layout (the permutation llama.cpp's rope needs, skipped) is far outside the tolerance."""
    from edgerun.convert import gguf_writer
    from edgerun.convert.hf_reader import open_checkpoint

    ckpt = _checkpoint(tmp_path, "llama")
    seqs = _sequences(200)[:1]
    reference = _transformers_logits(ckpt, seqs)[0]
    monkeypatch.setattr(gguf_writer, "_permute_rotary", lambda w, n_head: w)
    with open_checkpoint(ckpt) as c:
        broken = gguf_writer.write_gguf(c, tmp_path / "broken.gguf")
    ours = _llama_cpp_logits(broken, seqs)[0]
    n = min(ours.shape[1], reference.shape[1])
    assert np.abs(ours[:, :n] - reference[:, :n]).max() > 10 * TOLERANCE * np.abs(reference[:, :n]).max()
