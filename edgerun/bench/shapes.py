"""Random-weight GGUFs with the real shapes of the Qwen2.5 family, for the GPU scenarios.

Decode speed depends on a model's shapes, its quantization and its vocabulary size, never on its
weight values, so a Q4_K_M file of random weights measures what the real model would: the 1.5B
shape decodes at the same tok/s as Qwen2.5-Coder-1.5B's Q4_K_M. That keeps the 7B (4.7 GB)
reproducible anywhere: it is written where it runs (F16 from gguf-py, quantized by llama.cpp's
own quantizer) instead of being downloaded or carried. Acceptance does depend on the values, so
speculation needs the real models.

Writing one costs its F16 size on disk for a moment (15 GB for the 7B) and about a minute on 16
cores; a shape already written is reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import ConfigError


N_VOCAB = 151936  # Qwen2.5's vocabulary
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    tied: bool  # the output head shares the token embedding (no output.weight)
    n_vocab: int = N_VOCAB  # the benchmarked shapes keep the real one; a test's shape may be smaller


SHAPES = {  # Qwen2.5: the models' config.json
    "0.5b": Shape(896, 4864, 24, 14, 2, True),
    "1.5b": Shape(1536, 8960, 28, 12, 2, False),
    "7b": Shape(3584, 18944, 28, 28, 4, False),
}


def names(text: str) -> list[str]:
    """A comma-separated list of shape names, each checked."""
    out = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in out if n not in SHAPES]
    if unknown or not out:
        raise ConfigError(f"unknown shape '{', '.join(unknown) or text}'; there are: {', '.join(SHAPES)}")
    return out


def path_of(name: str, folder: Path) -> Path:
    return folder / f"shape-{name}-q4_k_m.gguf"


def ensure(name: str, folder: Path) -> Path:
    """The Q4_K_M file of a named shape in folder, written first if it is not there."""
    final = path_of(name, folder)
    if not final.exists():
        write(SHAPES[name], final, f"shape-{name}")
    return final


def write(shape: Shape, final: Path, name: str) -> Path:
    """A Q4_K_M GGUF of random weights in this shape at final (its F16 only for the moment)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    f16 = final.with_name(f".{final.stem}-f16.gguf")
    try:
        _write_f16(shape, name, f16)
        _quantize(f16, final)
    finally:
        f16.unlink(missing_ok=True)
    return final


def _vocab(writer, n_vocab: int) -> None:
    """A byte-level BPE vocabulary of n_vocab tokens (the real size for the benchmarked shapes):
    llama.cpp needs one to load and tokenize, and the output head's 151,936 rows are a large part
    of a small model's decode step."""
    from gguf import TokenType

    printable = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    shifted = [chr(256 + i) for i in range(256 - len(printable))]  # GPT-2's byte-to-unicode map
    tokens = printable + shifted
    tokens += [f"tok{i}" for i in range(n_vocab - len(tokens) - len(SPECIALS))] + SPECIALS
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.NORMAL] * (n_vocab - len(SPECIALS)) + [TokenType.CONTROL] * len(SPECIALS))
    writer.add_token_merges(["t o"])
    writer.add_eos_token_id(n_vocab - 1)
    writer.add_bos_token_id(n_vocab - 3)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                             "{% endfor %}<|im_start|>assistant\n")


def _write_f16(s: Shape, name: str, out: Path) -> None:
    """One random block tiled over every weight: 1 MiB of randomness makes files of any size in
    seconds, and the values never change the speed."""
    import gguf
    import numpy as np

    block = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(np.float16)

    def weight(rows: int, cols: int):
        return np.resize(block, rows * cols).reshape(rows, cols)

    def vector(n: int, value: float):
        return np.full(n, value, dtype=np.float32)

    kv = s.n_head_kv * (s.n_embd // s.n_head)
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name(name)
    w.add_context_length(32768)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _vocab(w, s.n_vocab)
    w.add_tensor("token_embd.weight", weight(s.n_vocab, s.n_embd))
    w.add_tensor("output_norm.weight", vector(s.n_embd, 1.0))
    if not s.tied:
        w.add_tensor("output.weight", weight(s.n_vocab, s.n_embd))
    for i in range(s.n_layer):
        b = f"blk.{i}."
        for role, rows, cols in (("attn_q", s.n_embd, s.n_embd), ("attn_k", kv, s.n_embd), ("attn_v", kv, s.n_embd)):
            w.add_tensor(b + role + ".weight", weight(rows, cols))
            w.add_tensor(b + role + ".bias", vector(rows, 0.0))
        w.add_tensor(b + "attn_norm.weight", vector(s.n_embd, 1.0))
        w.add_tensor(b + "attn_output.weight", weight(s.n_embd, s.n_embd))
        w.add_tensor(b + "ffn_norm.weight", vector(s.n_embd, 1.0))
        w.add_tensor(b + "ffn_gate.weight", weight(s.n_ff, s.n_embd))
        w.add_tensor(b + "ffn_up.weight", weight(s.n_ff, s.n_embd))
        w.add_tensor(b + "ffn_down.weight", weight(s.n_embd, s.n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quantize(f16: Path, final: Path) -> None:
    """llama.cpp's own Q4_K_M recipe, through convert's quantizer: a child process on every core
    whose log stays out of the terminal, and a file that exists only once it is complete."""
    from edgerun.convert.quantize import quantize

    quantize(f16, final, ftype="Q4_K_M", overrides={}, imatrix=None)
