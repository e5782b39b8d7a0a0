"""An HF checkpoint as an F16/BF16 GGUF, written with gguf-py's GGUFWriter, tensors streamed.

The header, metadata and tensor table are written first (shapes come from the safetensors
headers, no data is read), then each tensor is read, transformed and written in table order, so
peak memory is about one tensor, not the model. Tensor names come from gguf-py's
per-architecture TensorNameMap. Transforms undo what HF does differently from llama.cpp:
llama's q/k rows are permuted to llama.cpp's rotary layout, and Gemma's RMSNorm weights are
stored as w where the model multiplies by (1 + w), llama.cpp by the weight itself."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from edgerun.convert import floats
from edgerun.convert.atomic import atomic_path
from edgerun.convert.hf_reader import HFCheckpoint
from edgerun.convert.hf_vocab import Vocab, load_vocab
from edgerun.errors import ConvertError

Progress = Callable[[str, int, int], None]
OUT_TYPES = {
    "F16": (QType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (QType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
}
# HF tensors llama.cpp computes itself (rotary frequencies) rather than reading.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
_ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor: where it comes from and how it is stored."""

    name: str  # GGUF name
    source: str | None  # HF name; None for a tensor generated from the config (rope_freqs)
    shape: tuple[int, ...]  # numpy order, rows first
    qtype: QType


def _rope_params(config: dict) -> dict:
    """The full-attention rope settings, from either config style: transformers 5's
    rope_parameters (per attention type for Gemma) or rope_theta + rope_scaling."""
    params = config.get("rope_parameters") or {}
    params = dict(params.get("full_attention", params))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault("rope_type" if key == "type" else key, value)
    return params


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _add_rope_scaling(w: gguf.GGUFWriter, rope: dict) -> None:
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind in (None, "default", "llama3"):  # llama3's scaling travels as the rope_freqs tensor
        return
    if kind == "linear" and factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    else:
        raise ConvertError(f"rope scaling {kind!r} is not supported by edgerun convert (linear, yarn, llama3 are)")


def add_hparams(w: gguf.GGUFWriter, config: dict, arch: str, n_vocab: int) -> None:
    """The hyperparameters llama.cpp's loader reads for ARCH."""
    c = config
    n_head = c["num_attention_heads"]
    rope = _rope_params(c)
    w.add_context_length(c.get("max_position_embeddings", 32768 if arch == "gemma3" else 4096))
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(c.get("num_key_value_heads", n_head))
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if "head_dim" in c or arch == "gemma3":
        w.add_key_length(head_dim(c))
        w.add_value_length(head_dim(c))
    if arch == "llama":
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim(c))
    if arch == "gemma3":
        if c.get("sliding_window") and c.get("sliding_window_pattern") != 1:
            w.add_sliding_window(c["sliding_window"])
        local = (c.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        local = local or c.get("rope_local_base_freq")
        if local:
            w.add_rope_freq_base_swa(float(local))
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
    _add_rope_scaling(w, rope)


def _llama3_rope_factors(config: dict) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1's rope scaling: long wavelengths are stretched by
    `factor`, short ones kept, and the band between is interpolated smoothly."""
    rope = _rope_params(config)
    dim = head_dim(config)
    freqs = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def plan_tensors(ckpt: HFCheckpoint, n_vocab: int, qtype: QType) -> list[PlannedTensor]:
    """Every GGUF tensor, in file order, from the safetensors headers alone."""
    config = ckpt.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[ckpt.arch.upper()], config["num_hidden_layers"])
    tied = config.get("tie_word_embeddings", ckpt.arch == "gemma3")
    planned = []
    for hf_name in ckpt.names():
        if hf_name.endswith(_SKIPPED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConvertError(f"{ckpt.root}: tensor {hf_name!r} has no {ckpt.arch} GGUF name; "
                               "the checkpoint is not a plain causal LM of this architecture")
        shape = ckpt.shape(hf_name)
        if name in ("token_embd.weight", "output.weight") and shape[0] != n_vocab:
            if shape[0] < n_vocab:
                raise ConvertError(f"{ckpt.root}: the tokenizer has {n_vocab} tokens but {hf_name} only "
                                   f"{shape[0]} rows; the tokenizer files do not belong to these weights")
            shape = (n_vocab, *shape[1:])  # rows past the tokenizer's last token are never used
        planned.append(PlannedTensor(name, hf_name, shape, qtype if len(shape) >= 2 else QType.F32))
    if ckpt.arch == "llama" and _rope_params(config).get("rope_type") == "llama3":
        planned.append(PlannedTensor(_ROPE_FREQS, None, (head_dim(config) // 2,), QType.F32))
    return sorted(planned, key=lambda t: _order(t.name))


def _order(name: str) -> tuple[int, int, str]:
    """Embeddings first, then blocks in order, then the head: llama.cpp's own files look like
    this, and it keeps one block's tensors together on disk."""
    parts = name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), name)
    return (0 if name.startswith(("token_embd", "rope_freqs")) else 2, 0, name)


def _permute_rotary(w, n_head: int):
    """HF stores each head's q/k rows as [real halves | imaginary halves]; llama.cpp's rope for
    llama wants them interleaved pairwise."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_data(ckpt: HFCheckpoint, t: PlannedTensor) -> np.ndarray:
    """The bytes to write for one planned tensor (numpy, in the dtype of t.qtype)."""
    if t.source is None:
        return _llama3_rope_factors(ckpt.config)
    # a view of the mapped file: the one copy made is the converted output (floats.py)
    x, dtype = ckpt.tensor(t.source)
    if x.shape[0] > t.shape[0]:
        x = x[: t.shape[0]]
    c = ckpt.config
    if ckpt.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
        x = _permute_rotary(x, c["num_attention_heads"])
    elif ckpt.arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
        x = _permute_rotary(x, c.get("num_key_value_heads", c["num_attention_heads"]))
    if ckpt.arch == "gemma3" and t.source.endswith("norm.weight"):
        x, dtype = floats.to_f32(x, dtype) + np.float32(1.0), "F32"
    if tuple(x.shape) != t.shape:
        raise ConvertError(f"{ckpt.root}: tensor {t.source!r} has shape {tuple(x.shape)}, expected {t.shape}")
    if t.qtype == QType.BF16:
        return floats.to_bf16(x, dtype)
    if t.qtype == QType.F32:
        return np.ascontiguousarray(floats.to_f32(x, dtype))
    y = floats.to_f16(x, dtype)
    if dtype != "F16" and np.isinf(y).any() and not np.isinf(floats.to_f32(x, dtype)).any():
        raise ConvertError(f"{ckpt.root}: tensor {t.source!r} has values beyond the F16 range; "
                           "convert to BF16 instead")
    return y


def _nbytes(t: PlannedTensor) -> int:
    return math.prod(t.shape) * (4 if t.qtype == QType.F32 else 2)


def _np_dtype(qtype: QType):
    return {QType.F32: np.float32, QType.F16: np.float16, QType.BF16: np.uint16}[qtype]


def _metadata(w: gguf.GGUFWriter, ckpt: HFCheckpoint, vocab: Vocab, ftype) -> None:
    name = ckpt.config.get("_name_or_path") or ckpt.root.name
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(str(name).rstrip("/").split("/")[-1])
    add_hparams(w, ckpt.config, ckpt.arch, len(vocab.tokens))
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.add_to(w)


def write_gguf(ckpt: HFCheckpoint, out: Path, *, out_type: str = "F16", progress: Progress | None = None) -> Path:
    """Write CKPT as a GGUF at OUT (atomically and durably: a temp file renamed into place at the end)."""
    if out_type not in OUT_TYPES:
        raise ConvertError(f"output type {out_type!r} is not supported; use one of {', '.join(OUT_TYPES)}")
    qtype, ftype = OUT_TYPES[out_type]
    vocab = load_vocab(ckpt.root, ckpt.arch, ckpt.config.get("vocab_size"))
    planned = plan_tensors(ckpt, len(vocab.tokens), qtype)
    out = Path(out)
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(tmp, ckpt.arch)
        try:
            _metadata(w, ckpt, vocab, ftype)
            for t in planned:
                w.add_tensor_info(t.name, t.shape, np.dtype(_np_dtype(t.qtype)), _nbytes(t),
                                  raw_dtype=t.qtype if t.qtype == QType.BF16 else None)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for i, t in enumerate(planned):
                w.write_tensor_data(tensor_data(ckpt, t))
                if progress:
                    progress("write GGUF", i + 1, len(planned))
        finally:
            w.close()
    return out
