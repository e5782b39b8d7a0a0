"""The metadata values llama.cpp asserts on, bounded before llama.cpp reads them.

llama.cpp's loader throws on a missing key or a wrong type (a clean load failure), but it checks
many values with GGML_ASSERT, which aborts the whole process: a block count of 0 or over
LLAMA_MAX_LAYERS, expert counts out of range, an unknown rope scaling type, a vocabulary with a
repeated token. Others pass the load and abort later, in the first graph (a rope dimension that is
not the head size) or the first tokenization (a BOS token that is not in the vocabulary). The
rules below follow llama-model.cpp's load_hparams, llama-vocab.cpp's load and the graphs of the
architectures edgerun converts (llama, qwen2, qwen3, gemma3); the generic ones hold for every arch."""

from __future__ import annotations

import math

import numpy as np
from gguf import GGUFReader
from gguf import GGUFValueType as VT

LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama-model.cpp LLAMA_ROPE_SCALING_TYPES
TOKEN_TYPES = np.arange(7)  # LLAMA_TOKEN_TYPE_UNDEFINED .. LLAMA_TOKEN_TYPE_BYTE
# head size == rope dimension == value head size, asserted by these graphs (llama's load throws first)
_ROPE_IS_HEAD = frozenset({"llama", "qwen2", "qwen3"})
_ATTENTION_ARCHS = frozenset({"llama", "qwen2", "qwen3", "gemma3"})
_NO_VOCAB = frozenset({"no_vocab", "none"})
# the special tokens generation relies on (others out of range llama.cpp drops harmlessly)
_SPECIAL_IDS = ("bos", "eos", "eot", "eom")
# llama-vocab.cpp's default BOS/EOS per tokenizer model, used when the file names none
_DEFAULT_BOS_EOS = {"llama": (1, 2), "bert": (101, None), "gpt2": (11, 11), "t5": (None, 1)}


class Refused(ValueError):
    """A value llama.cpp would abort on; the message names the key and what is wrong."""


class _Meta:
    """Typed reads of the fields gguf_check's reader parsed (arrays come as one numpy part)."""

    def __init__(self, reader: GGUFReader, arch: str):
        self.fields = reader.fields
        self.data = reader.data
        self.arch = arch

    def key(self, name: str) -> str:
        return name.replace("{arch}", self.arch)

    def types(self, key: str) -> list[VT] | None:
        f = self.fields.get(key)
        return None if f is None else list(f.types)

    def _scalar(self, key: str, vt: VT, as_what: str):
        """The field's one value part, None when absent; refused unless its type is exactly vt."""
        f = self.fields.get(key)
        if f is None:
            return None
        if f.types != [vt]:
            raise Refused(f"{key} is {'/'.join(t.name for t in f.types)}{as_what}")
        return f.parts[f.data[0]]

    def uint32(self, key: str, default: int | None = None) -> int | None:
        """A scalar llama.cpp reads with get_key<uint32_t>: any other type it refuses."""
        part = self._scalar(key, VT.UINT32, "; llama.cpp reads it as UINT32")
        return default if part is None else int(part[0])

    def string(self, key: str) -> str | None:
        part = self._scalar(key, VT.STRING, ", not a string")
        return None if part is None else bytes(part).decode("utf-8", errors="replace")

    def boolean(self, key: str) -> bool | None:
        part = self._scalar(key, VT.BOOL, "; llama.cpp reads it as BOOL")
        return None if part is None else bool(part[0])

    def array(self, key: str) -> tuple[VT, np.ndarray] | None:
        """(item type, values); string items come as (start, length) rows into the file."""
        f = self.fields.get(key)
        if f is None or f.types[0] != VT.ARRAY:
            return None
        return f.types[1], f.parts[f.data[0]]

    def per_layer(self, key: str, n_layer: int, default: int) -> list[int]:
        """llama.cpp's get_key_or_arr: one UINT32 for every layer, or an INT32/UINT32 array of
        exactly n_layer values."""
        arr = self.array(key)
        if arr is None:
            return [self.uint32(key, default)] * n_layer
        vtype, values = arr
        if vtype not in (VT.INT32, VT.UINT32, VT.BOOL):
            raise Refused(f"{key} is an array of {vtype.name}; llama.cpp reads INT32 or UINT32")
        if len(values) != n_layer:
            raise Refused(f"{key} has {len(values)} values for {n_layer} layers")
        out = values.astype(np.int64).tolist()
        if any(v < 0 for v in out):
            raise Refused(f"{key} holds a negative value")
        return out


def check(reader: GGUFReader, arch: str) -> None:
    """Raise Refused for the first value in the file llama.cpp would abort on."""
    meta = _Meta(reader, arch)
    n_layer = _layers(meta)
    _experts(meta, n_layer)
    _attention(meta, n_layer)
    _floats(meta)
    _sliding_window(meta, n_layer)
    _vocab(meta)


def _layers(meta: _Meta) -> int:
    key = meta.key("{arch}.block_count")
    n_layer = meta.uint32(key)
    if n_layer is None:
        raise Refused(f"no {key}; llama.cpp needs the block count")
    if not 0 < n_layer <= LLAMA_MAX_LAYERS:
        raise Refused(f"{key} is {n_layer}; llama.cpp takes 1 to {LLAMA_MAX_LAYERS} blocks")
    nextn = meta.uint32(meta.key("{arch}.nextn_predict_layers"), 0)
    if nextn > n_layer:
        raise Refused(f"{meta.key('{arch}.nextn_predict_layers')} is {nextn}, over the {n_layer} blocks")
    ctx = meta.uint32(meta.key("{arch}.context_length"))
    if ctx is not None and not 0 < ctx < 2**31:
        raise Refused(f"{meta.key('{arch}.context_length')} is {ctx}; it must be 1 to {2**31 - 1}")
    return n_layer


def _experts(meta: _Meta, n_layer: int) -> None:
    """load_hparams' expert asserts, in its order."""
    k_count, k_used = meta.key("{arch}.expert_count"), meta.key("{arch}.expert_used_count")
    k_groups, k_group_used = meta.key("{arch}.expert_group_count"), meta.key("{arch}.expert_group_used_count")
    n_expert = meta.uint32(k_count, 0)
    used = max(meta.per_layer(k_used, n_layer, 0), default=0) if meta.types(k_used) else 0
    groups, group_used = meta.uint32(k_groups, 0), meta.uint32(k_group_used, 0)
    if meta.arch in ("hunyuan-vl", "hunyuan-dense") and n_expert <= 1:
        return  # llama.cpp drops the experts of these dense models
    if n_expert > LLAMA_MAX_EXPERTS:
        raise Refused(f"{k_count} is {n_expert}; llama.cpp takes at most {LLAMA_MAX_EXPERTS}")
    if used > n_expert:
        raise Refused(f"{k_used} is {used}, more than the {n_expert} experts")
    if n_expert == 0:
        if groups:
            raise Refused(f"{k_groups} is {groups} in a model without experts")
        return
    if used == 0:
        raise Refused(f"{k_used} is 0 in a model of {n_expert} experts")
    if groups >= n_expert:
        raise Refused(f"{k_groups} is {groups}, not fewer than the {n_expert} experts")
    if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        raise Refused(f"{k_groups} ({groups}) and {k_group_used} ({group_used}) do not split {n_expert} experts")


def _attention(meta: _Meta, n_layer: int) -> None:
    rope = meta.string(meta.key("{arch}.rope.scaling.type"))
    if rope is not None and rope not in ROPE_SCALING_TYPES:
        raise Refused(f"{meta.key('{arch}.rope.scaling.type')} is {rope[:40]!r};"
                      f" llama.cpp knows {', '.join(ROPE_SCALING_TYPES)}")
    k_head, k_kv = meta.key("{arch}.attention.head_count"), meta.key("{arch}.attention.head_count_kv")
    heads = meta.per_layer(k_head, n_layer, 0)
    kv = meta.per_layer(k_kv, n_layer, 0) if meta.types(k_kv) else heads
    for h, g in zip(heads, kv):
        if g > h or (g and h % g):
            raise Refused(f"{k_kv} ({g}) does not divide {k_head} ({h})")
    n_embd = meta.uint32(meta.key("{arch}.embedding_length"), 0)
    n_head = heads[0]
    if meta.arch in _ATTENTION_ARCHS:
        for key, values in ((meta.key("{arch}.embedding_length"), [n_embd]), (k_head, heads), (k_kv, kv)):
            if min(values) == 0:
                raise Refused(f"{key} is 0 (or missing); llama.cpp's {meta.arch} needs it positive")
    if n_head == 0:
        return  # llama.cpp reads no head sizes for a model without attention
    k_key, k_value = meta.key("{arch}.attention.key_length"), meta.key("{arch}.attention.value_length")
    if meta.uint32(k_key) is None and n_embd % n_head:
        raise Refused(f"{k_head} ({n_head}) does not divide {meta.key('{arch}.embedding_length')} ({n_embd})")
    head_k = meta.uint32(k_key, n_embd // n_head)
    head_v = meta.uint32(k_value, n_embd // n_head)
    _rope_dims(meta, "{arch}.rope.dimension_count", head_k, head_v)
    swa_k = meta.uint32(meta.key("{arch}.attention.key_length_swa"), head_k)
    swa_v = meta.uint32(meta.key("{arch}.attention.value_length_swa"), head_v)
    if meta.types(meta.key("{arch}.rope.dimension_count_swa")) or swa_k != head_k:
        _rope_dims(meta, "{arch}.rope.dimension_count_swa", swa_k, swa_v)


def _rope_dims(meta: _Meta, key: str, head_k: int, head_v: int) -> None:
    """ggml's rope asserts an even count of dimensions within the head; llama's and qwen's graphs
    assert the rope covers the whole head and the value head matches the key head."""
    key = meta.key(key)
    n_rot = meta.uint32(key, head_k)
    if not 0 < n_rot <= head_k or n_rot % 2:  # 0: ggml's rope loops on no dimensions
        raise Refused(f"{key} is {n_rot}; it must be even, 2 to the head size {head_k}")
    if meta.arch in _ROPE_IS_HEAD and not n_rot == head_k == head_v:
        raise Refused(f"{key} ({n_rot}), the key head ({head_k}) and the value head ({head_v}) differ;"
                      f" llama.cpp's {meta.arch} needs them equal")


def _floats(meta: _Meta) -> None:
    """A NaN or infinite hyper-parameter means nothing; a norm epsilon that is not >= 0 trips
    ggml's rms_norm assert on the first decode."""
    prefix = meta.key("{arch}.")
    for key, f in meta.fields.items():
        if key.startswith(prefix) and f.types in ([VT.FLOAT32], [VT.FLOAT64]):
            value = float(f.parts[f.data[0]][0])
            if not math.isfinite(value):
                raise Refused(f"{key} is {value}")
            if key.endswith("epsilon") and value < 0:
                raise Refused(f"{key} is {value}; a norm epsilon cannot be negative")


def _sliding_window(meta: _Meta, n_layer: int) -> None:
    """gemma3 with a sliding window builds an interleaved KV cache, which asserts that some layer
    slides: llama.cpp's set_swa_pattern(n) makes layer il slide when n == 0 or il % n < n - 1."""
    if meta.arch != "gemma3" or not meta.uint32(meta.key("{arch}.attention.sliding_window"), 0):
        return
    key = meta.key("{arch}.attention.sliding_window_pattern")
    arr = meta.array(key)
    if arr is not None:
        if arr[0] not in (VT.BOOL, VT.INT32, VT.UINT32) or len(arr[1]) > LLAMA_MAX_LAYERS:
            raise Refused(f"{key} must be at most {LLAMA_MAX_LAYERS} BOOL, INT32 or UINT32 values")
        slides = bool(np.any(arr[1][:n_layer]))
    else:
        n = meta.uint32(key, 6)
        slides = any(n == 0 or il % n < n - 1 for il in range(n_layer))
    if not slides:
        raise Refused(f"{key} leaves no layer of the {n_layer} on the sliding window the file declares")


def _vocab(meta: _Meta) -> None:
    model = meta.string("tokenizer.ggml.model")
    if model is None or model in _NO_VOCAB:
        return  # llama.cpp throws on a missing model (a clean failure); "none" reads no tokens
    tokens = meta.array("tokenizer.ggml.tokens")
    if tokens is None or tokens[0] != VT.STRING:
        raise Refused("tokenizer.ggml.tokens is not an array of strings")
    n_vocab = len(tokens[1])
    if n_vocab == 0 or n_vocab >= 2**31:
        raise Refused(f"tokenizer.ggml.tokens holds {n_vocab} tokens")
    _unique_tokens(meta, tokens[1])
    for key, allowed in (("tokenizer.ggml.scores", (VT.FLOAT32, VT.INT32)), ("tokenizer.ggml.token_type", (VT.INT32,))):
        arr = meta.array(key)
        if arr is None:
            if meta.types(key):
                raise Refused(f"{key} is not an array")
            continue
        if arr[0] not in allowed or len(arr[1]) < n_vocab:
            raise Refused(f"{key} must be {' or '.join(t.name for t in allowed)} values for all {n_vocab} tokens")
    types = meta.array("tokenizer.ggml.token_type")
    if types is not None and not np.isin(types[1], TOKEN_TYPES).all():
        raise Refused("tokenizer.ggml.token_type holds a value outside llama.cpp's token types 0..6")
    merges = meta.types("tokenizer.ggml.merges")
    if merges is not None and merges[:2] != [VT.ARRAY, VT.STRING]:
        raise Refused("tokenizer.ggml.merges is not an array of strings")
    _special_tokens(meta, model, n_vocab)


def _unique_tokens(meta: _Meta, spans: np.ndarray) -> None:
    """llama.cpp maps each token's text to its id and asserts no text repeats; an empty token is
    renamed [EMPTY_<id>] first, so it can only meet a token spelled that way. Compared by hash,
    8 bytes a token, then exactly where hashes meet: a set of a million token strings would cost
    ~100 MB."""
    base = int(spans[0, 0])
    raw = bytes(memoryview(meta.data)[base:int(spans[-1].sum())])  # the array's bytes, once
    ids = np.flatnonzero(spans[:, 1])  # the non-empty tokens
    hashes = np.empty(len(ids), dtype=np.int64)
    step = 1 << 16
    for lo in range(0, len(ids), step):
        rows = (spans[ids[lo:lo + step]] - [base, 0]).tolist()
        hashes[lo:lo + len(rows)] = [hash(raw[s:s + n]) for s, n in rows]
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    for h in np.unique(ordered[1:][ordered[1:] == ordered[:-1]]).tolist():
        group, seen = ids[order[ordered == h]], set()
        for lo in range(0, len(group), 1024):  # a repeat is all but certain: stop at the first
            for s, n in spans[group[lo:lo + 1024]].tolist():
                text = raw[s - base:s - base + n]
                if text in seen:
                    raise Refused(f"tokenizer.ggml.tokens repeats the token {text[:40]!r}")
                seen.add(text)
    if len(ids) < len(spans) and b"[EMPTY_" in raw:
        empty = set(np.flatnonzero(spans[:, 1] == 0).tolist())
        for s, n in spans[ids].tolist():
            text = raw[s - base:s - base + n]
            if text.startswith(b"[EMPTY_") and text[7:-1].isdigit() and int(text[7:-1]) in empty \
                    and text == b"[EMPTY_%d]" % int(text[7:-1]):
                raise Refused(f"tokenizer.ggml.tokens holds {text!r} and an empty token llama.cpp names so")


def _special_tokens(meta: _Meta, model: str, n_vocab: int) -> None:
    """An id out of the vocabulary is dropped by llama.cpp; a tokenizer that then adds a missing
    BOS or EOS asserts on the first prompt."""
    ids = {}
    for name in _SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        value = meta.uint32(key)
        if value is not None and value >= n_vocab:
            raise Refused(f"{key} is {value}, not a token of the {n_vocab}")
        ids[name] = value
    bos, eos = _DEFAULT_BOS_EOS.get(model, (None, None))
    for name, default in (("bos", bos), ("eos", eos)):
        wanted = meta.boolean(f"tokenizer.ggml.add_{name}_token")
        token = ids[name] if ids[name] is not None else default
        if wanted and (token is None or token >= n_vocab):
            raise Refused(f"tokenizer.ggml.add_{name}_token is set but the file has no {name} token")
