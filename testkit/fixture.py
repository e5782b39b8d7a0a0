"""Turn a GGUF back into an HF checkpoint directory (the test fixture: no F16 checkpoint exists on
these machines, quantized GGUFs do).

Each tensor is dequantized with gguf-py (`gguf.quants.dequantize`), given its HF name (the inverse
of gguf-py's TensorNameMap over the HF module names of these architectures) and HF layout (llama's
q/k rows un-permuted, Gemma's norms stored as w - 1), and written to safetensors shards in bf16 or
f16; only one shard's tensors are held at a time. config.json, tokenizer files and
generation_config.json come from the GGUF's metadata."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFReader

from edgerun.convert.atomic import publish, temp_name
from edgerun.convert.hf_reader import HF_CLASS, HF_MODEL_TYPE, SUPPORTED_ARCHS
from edgerun.errors import ConvertError
from testkit import weights
from testkit.fixture_vocab import field, tokenizer_files
from testkit.weights import Stored

Progress = Callable[[str, int, int], None]
DTYPES = ("bf16", "f16")
SHARD_BYTES = 512 << 20
_DEQUANT_ROWS = 8192  # rows dequantized at once: bounds gguf-py's temporaries
# The HF module names of LlamaForCausalLM / Qwen2ForCausalLM / Gemma3ForCausalLM.
_HF_TOP = ("model.embed_tokens", "model.norm", "lm_head")
_HF_BLOCK = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


def hf_names(arch: str, n_blocks: int) -> dict[str, str]:
    """GGUF base name -> HF base name, by running gguf-py's own forward map over the HF names."""
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_blocks)
    candidates = [*_HF_TOP, *(f"model.layers.{b}.{m}" for b in range(n_blocks) for m in _HF_BLOCK)]
    out: dict[str, str] = {}
    for hf in candidates:
        if (name := name_map.get_name(hf)) is not None:
            out.setdefault(name, hf)
    return out


def _arch(reader: GGUFReader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ConvertError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    return arch


def _f32(value: Any) -> float:
    """A float32 metadata value as the short decimal that rounds back to it (1e-06, not
    9.999999974752427e-07)."""
    return float(str(np.float32(value)))


def _rope_scaling(reader: GGUFReader, arch: str) -> dict | None:
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": _f32(field(reader, f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(field(reader, f"{arch}.rope.scaling.original_context_length"))
    return scaling


def make_config(reader: GGUFReader, *, dtype: str, special_ids: dict[str, int]) -> dict[str, Any]:
    """config.json for the GGUF in READER."""
    arch = _arch(reader)

    def hp(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    n_head = int(hp("attention.head_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config: dict[str, Any] = {
        "architectures": [HF_CLASS[arch]],
        "model_type": HF_MODEL_TYPE[arch],
        "hidden_size": int(hp("embedding_length")),
        "intermediate_size": int(hp("feed_forward_length")),
        "num_hidden_layers": int(hp("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(hp("attention.head_count_kv", n_head)),
        "rms_norm_eps": _f32(hp("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(hp("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(hp("context_length")),
        "vocab_size": int(embd.shape[-1]),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": {"bf16": "bfloat16", "f16": "float16"}[dtype],
        "hidden_act": "gelu_pytorch_tanh" if arch == "gemma3" else "silu",
        **{f"{typ}_token_id": i for typ, i in special_ids.items()},
    }
    if hp("attention.key_length") is not None:
        config["head_dim"] = int(hp("attention.key_length"))
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        config["head_dim"] = int(hp("attention.key_length", 256))
        config["query_pre_attn_scalar"] = config["head_dim"]
        config["sliding_window"] = int(hp("attention.sliding_window", 4096))
        config["sliding_window_pattern"] = 6  # llama.cpp's gemma3 loader uses this pattern
        config["rope_local_base_freq"] = _f32(hp("rope.freq_base_swa", 10000.0))
        config["final_logit_softcapping"] = hp("final_logit_softcapping")
        config["attn_logit_softcapping"] = None
    if (scaling := _rope_scaling(reader, arch)) is not None:
        config["rope_scaling"] = scaling
    return config


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (see gguf_writer._permute_rotary)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t: gguf.ReaderTensor) -> np.ndarray:
    """One tensor as float32 in numpy order, dequantized a slab of rows at a time."""
    data = t.data
    shape = tuple(int(d) for d in reversed(t.shape))
    if data.ndim == 1:
        return gguf.quants.dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)
    rows = data.shape[0]
    out = np.empty((rows, shape[-1]), dtype=np.float32)
    for start in range(0, rows, _DEQUANT_ROWS):
        stop = min(rows, start + _DEQUANT_ROWS)
        out[start:stop] = gguf.quants.dequantize(np.asarray(data[start:stop]), t.tensor_type).reshape(stop - start, -1)
    return out.reshape(shape)


def hf_tensor(reader: GGUFReader, arch: str, t: gguf.ReaderTensor) -> np.ndarray:
    """The HF layout of one GGUF tensor, float32."""
    w = _dequantize(t)
    n_head = int(field(reader, f"{arch}.attention.head_count"))
    if arch == "llama" and t.name.startswith("blk.") and ".attn_q." in t.name:
        w = _unpermute_rotary(w, n_head)
    elif arch == "llama" and t.name.startswith("blk.") and ".attn_k." in t.name:
        w = _unpermute_rotary(w, int(field(reader, f"{arch}.attention.head_count_kv", n_head)))
    if arch == "gemma3" and t.name.endswith("norm.weight"):
        w = w - 1.0
    return w


def _tensors(reader: GGUFReader, arch: str, dtype: str, progress: Progress | None) -> Iterator[tuple[str, Stored]]:
    n_blocks = int(field(reader, f"{arch}.block_count"))
    names = hf_names(arch, n_blocks)
    for i, t in enumerate(reader.tensors):
        base, _, suffix = t.name.rpartition(".")
        if base not in names:
            raise ConvertError(f"GGUF tensor {t.name!r} has no HF name for {arch}; the fixture cannot write it")
        w = hf_tensor(reader, arch, t)
        # norms and biases stay float32 in HF checkpoints; matrices take the checkpoint dtype
        yield f"{names[base]}.{suffix}", weights.stored(w, "f32" if w.ndim == 1 else dtype)
        if progress:
            progress("dequantize", i + 1, len(reader.tensors))


def _write_shards(root: Path, tensors: Iterator[tuple[str, Stored]], shard_bytes: int) -> None:
    current: dict[str, Stored] = {}
    size = 0
    names: list[list[str]] = []

    def flush() -> None:
        nonlocal current, size
        if current:
            path = root / f"part-{len(names):05d}.safetensors"
            weights.save(path, current, metadata={"format": "pt"})
            names.append(list(current))
            current, size = {}, 0

    for name, value in tensors:
        nbytes = value[0].nbytes
        if current and size + nbytes > shard_bytes:
            flush()
        current[name] = value
        size += nbytes
    flush()
    if len(names) == 1:
        (root / "part-00000.safetensors").rename(root / "model.safetensors")
        return
    weight_map = {}
    for i, group in enumerate(names):
        final = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        (root / f"part-{i:05d}.safetensors").rename(root / final)
        weight_map.update({n: final for n in group})
    _dump(root / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def _dump(path: Path, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)


def make_hf_fixture(gguf_path: Path, out_dir: Path, *, dtype: str = "bf16", shard_bytes: int = SHARD_BYTES,
                    progress: Progress | None = None) -> Path:
    """Write the GGUF at GGUF_PATH as an HF checkpoint directory OUT_DIR (which must not exist
    yet; it appears complete or not at all)."""
    if dtype not in DTYPES:
        raise ConvertError(f"fixture dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ConvertError(f"{out_dir}: already exists; give a new directory")
    reader = GGUFReader(gguf_path)
    arch = _arch(reader)
    tok_json, tok_config, ids = tokenizer_files(reader)
    config = make_config(reader, dtype=dtype, special_ids=ids)
    tmp = temp_name(out_dir)
    tmp.mkdir(parents=True)
    try:
        _write_shards(tmp, _tensors(reader, arch, dtype, progress), shard_bytes)
        _dump(tmp / "config.json", config)
        _dump(tmp / "tokenizer.json", tok_json)
        _dump(tmp / "tokenizer_config.json", tok_config)
        generation = {k: v for k, v in config.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        _dump(tmp / "generation_config.json", {**generation, "do_sample": False})
        publish(tmp, out_dir)  # every file fsynced, then the directory renamed into place
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
