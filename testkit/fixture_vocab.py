"""A GGUF's vocabulary as HF tokenizer files (tokenizer.json, tokenizer_config.json): the
tokenizer half of the test fixture (see fixture.py).

Byte-level BPE (tokenizer.ggml.model "gpt2") becomes an HF BPE tokenizer with the GGUF's merges;
SentencePiece ("llama") becomes a Unigram tokenizer holding the GGUF's scores. Control tokens
become special added tokens, user-defined ones non-special added tokens, so that hf_vocab.py reads
back the same token table, types, special ids and flags."""

from __future__ import annotations

from typing import Any

import gguf
from gguf import GGUFReader, TokenType

from edgerun.convert.hf_vocab import PRE_TOKENIZER_REGEX
from edgerun.errors import ConvertError

K = gguf.Keys.Tokenizer
# HF's name of each special token -> its GGUF key
SPECIAL_KEYS = {
    "bos": K.BOS_ID, "eos": K.EOS_ID, "unk": K.UNK_ID, "sep": K.SEP_ID, "pad": K.PAD_ID,
    "mask": K.MASK_ID, "eot": K.EOT_ID, "eom": K.EOM_ID,
}
ADD_KEYS = {"bos": K.ADD_BOS, "eos": K.ADD_EOS, "sep": K.ADD_SEP}
_SPM_SPACE = "\u2581"


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _added(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    return [
        {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": typ == TokenType.CONTROL}
        for i, (text, typ) in enumerate(zip(tokens, types))
        if typ in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]


def _bpe_json(reader: GGUFReader, tokens: list[str], types: list[int]) -> dict[str, Any]:
    pre = field(reader, K.PRE, "default")
    regex = PRE_TOKENIZER_REGEX.get(pre)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": regex is None}
    steps = [{"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}] if regex else []
    vocab = {text: i for i, (text, typ) in enumerate(zip(tokens, types)) if typ == TokenType.NORMAL}
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*steps, byte_level]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            # gguf-py's merge strings ("a b"); gguf.SpecialVocab reads them back verbatim
            "merges": list(field(reader, K.MERGES, [])),
        },
    }


def _unigram_json(reader: GGUFReader, tokens: list[str], types: list[int]) -> dict[str, Any]:
    scores = field(reader, K.SCORES)
    if scores is None:
        raise ConvertError("the GGUF's SentencePiece vocabulary has no scores; it cannot become a Unigram tokenizer")
    normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": _SPM_SPACE}]
    if field(reader, K.ADD_PREFIX, True):
        normalizers.insert(0, {"type": "Prepend", "prepend": _SPM_SPACE})
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": _SPM_SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "Unigram", "unk_id": field(reader, K.UNK_ID), "byte_fallback": True,
                  "vocab": [[text, float(s)] for text, s in zip(tokens, scores)]},
    }


def tokenizer_files(reader: GGUFReader) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
    """(tokenizer.json, tokenizer_config.json, special ids as config.json's *_token_id)."""
    tokens = list(field(reader, K.LIST, []))
    types = [int(t) for t in field(reader, K.TOKEN_TYPE, [TokenType.NORMAL] * len(tokens))]
    model = field(reader, K.MODEL)
    if model == "gpt2":
        # [PADn] rows (UNUSED) only pad the embedding: config.json's vocab_size brings them back
        while tokens and types[-1] == TokenType.UNUSED:
            tokens.pop()
            types.pop()
        body = _bpe_json(reader, tokens, types)
    elif model == "llama":
        body = _unigram_json(reader, tokens, types)
    else:
        raise ConvertError(f"GGUF tokenizer model {model!r} is not supported by the fixture (gpt2, llama are)")
    tok_json = {"version": "1.0", "truncation": None, "padding": None,
                "added_tokens": _added(tokens, types), "post_processor": None, **body}
    ids = {typ: int(v) for typ, key in SPECIAL_KEYS.items() if (v := field(reader, key)) is not None}
    n_ctx = field(reader, f"{field(reader, 'general.architecture')}.context_length", 2048)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(n_ctx)}
    for typ, i in ids.items():
        config[f"{typ}_token"] = tokens[i] if i < len(tokens) else None
    for typ, key in ADD_KEYS.items():
        if (flag := field(reader, key)) is not None:
            config[f"add_{typ}_token"] = bool(flag)
    if (template := field(reader, gguf.Keys.Tokenizer.CHAT_TEMPLATE)) is not None:
        config["chat_template"] = template
    return tok_json, config, ids
