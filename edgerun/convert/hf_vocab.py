"""An HF tokenizer (tokenizer.json, or tokenizer.model for SentencePiece) as GGUF vocab metadata.

llama.cpp needs the whole vocabulary in the GGUF: every token's text, type and (for SentencePiece)
score, the BPE merges, the pre-tokenizer's name, the special ids and the chat template. The merges,
special ids, add-bos/eos flags and chat template come from gguf-py's own `SpecialVocab`; the token
table is read here from tokenizer.json because gguf-py's `BpeVocab` marks every added token as a
control token, while llama.cpp treats user-defined ones (text it should match literally) differently."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from gguf import TokenType

from edgerun.errors import ConvertError

# The split regex of a byte-level BPE tokenizer.json, and the llama.cpp pre-tokenizer that
# implements it (llama.cpp names pre-tokenizers; it cannot run an arbitrary regex).
PRE_TOKENIZER_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask", "eot", "eom")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPM_SPACE = "\u2581"


@dataclass
class Vocab:
    """Everything tokenizer.ggml.* holds."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    add_space_prefix: bool | None
    special: gguf.SpecialVocab

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        self.special.add_to_gguf(writer, quiet=True)


def looks_special(text: str) -> bool:
    """Added tokens some models leave unmarked although they are control tokens (<|im_end|>,
    gemma's <unusedN>); llama.cpp's converter promotes them the same way."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _added_type(item: dict[str, Any]) -> int:
    if item.get("special") or looks_special(item["content"]):
        return TokenType.CONTROL
    return TokenType.USER_DEFINED


def _pre_name(tok: dict[str, Any], arch: str) -> str:
    """The llama.cpp pre-tokenizer for a byte-level BPE tokenizer.json, found by its split regex;
    a regex edgerun does not know falls back to the one that architecture's models use."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    regexes = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    for name, regex in PRE_TOKENIZER_REGEX.items():
        if regex in regexes:
            return name
    if not regexes:
        return "gpt-2"  # ByteLevel's own regex
    return {"qwen2": "qwen2", "qwen3": "qwen2", "llama": "llama-bpe"}.get(arch, "default")


def _fill(n: int, table: dict[int, tuple[str, int, float]]) -> tuple[list[str], list[int], list[float]]:
    """Token id -> (text, type, score) into dense lists; ids no tokenizer file names become
    [PADn] (the embedding has rows for them)."""
    tokens, types, scores = [], [], []
    for i in range(n):
        text, typ, score = table.get(i, (f"[PAD{i}]", TokenType.UNUSED, -1000.0))
        tokens.append(text)
        types.append(typ)
        scores.append(score)
    return tokens, types, scores


def _bpe_table(tok: dict[str, Any]) -> dict[int, tuple[str, int, float]]:
    table = {int(i): (text, TokenType.NORMAL, 0.0) for text, i in tok["model"]["vocab"].items()}
    for item in tok.get("added_tokens", []):
        table[int(item["id"])] = (item["content"], _added_type(item), 0.0)
    return table


def _unigram_table(tok: dict[str, Any]) -> dict[int, tuple[str, int, float]]:
    model = tok["model"]
    table = {}
    for i, (text, score) in enumerate(model["vocab"]):
        typ = TokenType.BYTE if _BYTE_TOKEN.fullmatch(text) else TokenType.NORMAL
        table[i] = (text, typ, float(score))
    if model.get("unk_id") is not None:
        text, _, score = table[model["unk_id"]]
        table[model["unk_id"]] = (text, TokenType.UNKNOWN, score)
    for item in tok.get("added_tokens", []):
        i = int(item["id"])
        text = item["content"]
        typ = _added_type(item)
        if typ == TokenType.USER_DEFINED:
            text = text.replace(_SPM_SPACE, " ")  # llama.cpp matches user-defined text pre-normalized
        table[i] = (text, typ, table.get(i, ("", 0, -1000.0))[2])
    return table


def _space_prefix(tok: dict[str, Any]) -> bool:
    """Whether a SentencePiece-style tokenizer.json prepends ▁ to the text (normalizer Prepend, or
    a Metaspace pre-tokenizer that prepends)."""
    def walk(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "Prepend" and node.get("prepend") == _SPM_SPACE:
            return True
        if node.get("type") == "Metaspace":
            return node.get("prepend_scheme", "always") != "never" and node.get("add_prefix_space", True)
        return any(walk(n) for key in ("normalizers", "pretokenizers") for n in node.get(key, []))
    return walk(tok.get("normalizer")) or walk(tok.get("pre_tokenizer"))


def _sentencepiece_table(root: Path, tok: dict[str, Any] | None) -> dict[int, tuple[str, int, float]]:
    try:
        spm = gguf.vocab.SentencePieceVocab(root)
    except RuntimeError:
        raise ConvertError(f"{root}: its tokenizer.model needs the sentencepiece package; "
                           "pip install sentencepiece") from None
    table = {i: (text.decode("utf-8"), int(typ), score) for i, (text, score, typ) in enumerate(spm.all_tokens())}
    for item in (tok or {}).get("added_tokens", []):
        i = int(item["id"])
        table[i] = (item["content"], _added_type(item), table.get(i, ("", 0, -1000.0))[2])
    return table


def _load_tokenizer_json(root: Path) -> dict[str, Any] | None:
    path = root / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{path}: cannot read it ({exc}); re-download the tokenizer files") from None


def load_vocab(root: Path, arch: str, vocab_size: int | None) -> Vocab:
    """The GGUF vocabulary of the HF checkpoint in ROOT (vocab_size: config.json's, the number of
    embedding rows, which may exceed the tokenizer's own count)."""
    tok = _load_tokenizer_json(root)
    kind = (tok or {}).get("model", {}).get("type")
    decoder = (tok or {}).get("decoder") or {}
    byte_level = kind == "BPE" and not tok["model"].get("byte_fallback") and decoder.get("type") == "ByteLevel"
    try:
        if byte_level:
            model, pre, table, space = "gpt2", _pre_name(tok, arch), _bpe_table(tok), None
        elif kind == "Unigram":
            model, pre, table, space = "llama", "default", _unigram_table(tok), _space_prefix(tok)
        elif (root / "tokenizer.model").is_file():
            model, pre, table = "llama", "default", _sentencepiece_table(root, tok)
            space = False if arch == "gemma3" else None  # gemma's SentencePiece model adds no ▁ prefix
        else:
            raise ConvertError(f"{root}: tokenizer.json holds a {kind or 'unknown'} tokenizer edgerun cannot "
                               "convert (byte-level BPE or Unigram); add the tokenizer.model file")
        n = max(vocab_size or 0, max(table) + 1)
        special = gguf.SpecialVocab(root, load_merges=model == "gpt2", special_token_types=SPECIAL_TYPES, n_vocab=n)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConvertError(f"{root}: malformed tokenizer files ({exc!r}); re-download them") from None
    tokens, types, scores = _fill(n, table)
    if model == "gpt2" and not special.merges:
        raise ConvertError(f"{root}: the BPE tokenizer has no merges; re-download tokenizer.json")
    return Vocab(model=model, pre=pre, tokens=tokens, types=[int(t) for t in types],
                 scores=scores if model == "llama" else None, add_space_prefix=space, special=special)
