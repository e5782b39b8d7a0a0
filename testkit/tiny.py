"""A tiny random-weight HF checkpoint (llama, qwen2, qwen3 or gemma3) with a small real tokenizer, for
fast tests of the conversion path and smoke runs of the later steps: a few hundred tokens, a few
layers, a hidden size of 64, written in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf.vocab import bytes_to_unicode

from edgerun.convert.hf_reader import HF_CLASS, HF_MODEL_TYPE
from edgerun.convert.hf_vocab import PRE_TOKENIZER_REGEX
from testkit.weights import save, stored

_WORDS = ("the", "and", "def", "return", "print", "import", "class", "self", "for", "in", "is", "of", "to")
SPM_SPACE = "\u2581"


def _added(i: int, text: str) -> dict[str, Any]:
    return {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def bpe_tokenizer() -> tuple[dict[str, Any], dict[str, Any]]:
    """A byte-level BPE tokenizer (the 256 byte symbols, merges spelling a few words, three
    ChatML control tokens): (tokenizer.json, tokenizer_config.json)."""
    alphabet = list(bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[list[str]] = []
    space = bytes_to_unicode()[ord(" ")]
    for word in _WORDS:
        cur = space
        for ch in word:
            if cur + ch not in vocab:
                merges.append([cur, ch])
                vocab[cur + ch] = len(vocab)
            cur += ch
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = [_added(len(vocab) + k, text) for k, text in enumerate(specials)]
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_TOKENIZER_REGEX["qwen2"]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "add_bos_token": False, "chat_template": template}
    return tok, config


def unigram_tokenizer() -> tuple[dict[str, Any], dict[str, Any]]:
    """A SentencePiece-style Unigram tokenizer (Gemma's special tokens, the 256 byte pieces, the
    letters and a few words with scores): (tokenizer.json, tokenizer_config.json)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = [[s, 0.0] for s in specials] + [[f"<0x{b:02X}>", 0.0] for b in range(256)]
    pieces += [[SPM_SPACE, -2.0]] + [[chr(c), -3.0] for c in range(ord("a"), ord("z") + 1)]
    pieces += [[SPM_SPACE + w, -1.0 - 0.1 * k] for k, w in enumerate(_WORDS)]
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(i, s) for i, s in enumerate(specials)],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "Unigram", "unk_id": 3, "byte_fallback": True, "vocab": pieces},
    }
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "add_bos_token": True, "add_eos_token": False, "chat_template": template}
    return tok, config


def _config(arch: str, n_vocab: int, n_layers: int, tie: bool, n_ctx: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [HF_CLASS[arch]], "model_type": HF_MODEL_TYPE[arch],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": n_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": n_ctx, "vocab_size": n_vocab,
        "tie_word_embeddings": tie, "torch_dtype": "bfloat16",
    }
    if arch == "qwen3":  # its own head size (not hidden / heads) and no q/k/v biases
        config.update(head_dim=32, attention_bias=False)
    if arch == "gemma3":
        config.update(head_dim=32, sliding_window=16, sliding_window_pattern=6, rope_local_base_freq=10000.0,
                      query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh",
                      final_logit_softcapping=None, attn_logit_softcapping=None,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return config


def _weights(config: dict[str, Any], arch: str, bias: bool, rng: np.random.Generator,
             head_scale: float = 1.0) -> dict[str, np.ndarray]:
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim", h // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 1.0 / np.sqrt(cols), (rows, cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # Gemma multiplies by (1 + w), the others by w
        return rng.normal(0.0 if arch == "gemma3" else 1.0, 0.1, n).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.normal(0.0, 1.0, (v, h)).astype(np.float32), "model.norm.weight": norm(h)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(v, h) * np.float32(head_scale)
    for b in range(config["num_hidden_layers"]):
        p = f"model.layers.{b}."
        w.update({p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
                  p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
                  p + "mlp.gate_proj.weight": mat(f, h), p + "mlp.up_proj.weight": mat(f, h),
                  p + "mlp.down_proj.weight": mat(h, f),
                  p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h)})
        if bias:
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{name}.bias"] = rng.normal(0.0, 0.1, n).astype(np.float32)
        if arch in ("qwen3", "gemma3"):  # RMS norms of each head's queries and keys
            w.update({p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})
        if arch == "gemma3":
            w.update({p + "pre_feedforward_layernorm.weight": norm(h), p + "post_feedforward_layernorm.weight": norm(h)})
    return w


def write_tiny_checkpoint(out_dir: Path, arch: str, *, seed: int = 0, n_layers: int = 2, bias: bool | None = None,
                          tie: bool | None = None, dtype: str = "bf16", n_ctx: int = 512,
                          head_scale: float = 1.0) -> Path:
    """Write a tiny random HF checkpoint of ARCH into OUT_DIR (created) and return it.
    bias: q/k/v biases (default: qwen2 only); tie: tied output head (default: all but llama);
    n_ctx: the context it declares (max_position_embeddings); head_scale: multiplies an untied
    head, so logits of that scale make the next-token distribution peaked rather than flat."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, tok_config = unigram_tokenizer() if arch == "gemma3" else bpe_tokenizer()
    n_tokens = max(len(tok["model"]["vocab"]), *(a["id"] + 1 for a in tok["added_tokens"]))
    n_vocab = n_tokens if arch == "gemma3" else (n_tokens + 31) // 32 * 32  # BPE: padded rows, as Qwen does
    config = _config(arch, n_vocab, n_layers, arch != "llama" if tie is None else tie, n_ctx)
    weights = _weights(config, arch, arch == "qwen2" if bias is None else bias, np.random.default_rng(seed), head_scale)
    tensors = {k: stored(a, dtype if a.ndim == 2 else "f32") for k, a in weights.items()}
    save(out_dir / "model.safetensors", tensors, metadata={"format": "pt"})
    for name, value in (("config.json", config), ("tokenizer.json", tok), ("tokenizer_config.json", tok_config)):
        (out_dir / name).write_text(json.dumps(value, ensure_ascii=False, indent=1), encoding="utf-8")
    return out_dir
