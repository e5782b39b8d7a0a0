"""gguf_hparams: a GGUF whose hyper-parameters llama.cpp would abort on is refused in Python.

The mutation test takes a tiny valid GGUF of each architecture edgerun converts (written by the
converter from a tiny random checkpoint), sets every integer key in turn to 0, a wrapped negative
and a huge value, every string to garbage, inserts the keys llama.cpp reads when present, and
breaks the vocabulary arrays. Each variant must be refused by inspect() with one clear line, or
be loaded (and a prompt decoded) by real llama.cpp in a child process that exits cleanly. A child
killed by a signal or still running after its limit names the variant that did it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gguf
import pytest
from gguf import GGUFValueType as VT

from edgerun.errors import InvalidModelFile
from edgerun.models.gguf_check import inspect
from test_gguf_check import N_VOCAB, assert_refused, write_gguf

pytestmark = pytest.mark.usefixtures("edgerun_home")

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
FILE_LIMIT_S = 30  # a tiny model loads and decodes in well under a second; one stuck this long hangs
_BITS = {VT.UINT8: 8, VT.INT8: 8, VT.UINT16: 16, VT.INT16: 16, VT.UINT32: 32, VT.INT32: 32, VT.UINT64: 64, VT.INT64: 64}
_SIGNED = {VT.INT8, VT.INT16, VT.INT32, VT.INT64}
# read by llama.cpp when present, absent from the converter's files: inserted as UINT32
_INSERTED_UINT32 = (
    "{arch}.expert_count", "{arch}.expert_used_count", "{arch}.expert_group_count",
    "{arch}.expert_group_used_count", "{arch}.nextn_predict_layers", "{arch}.attention.key_length",
    "{arch}.attention.value_length", "{arch}.rope.dimension_count", "{arch}.attention.sliding_window",
    "{arch}.attention.sliding_window_pattern", "{arch}.vocab_size", "{arch}.rope.dimension_count_swa",
    "{arch}.attention.key_length_swa", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id",
)
_INSERTED_STRINGS = ("{arch}.rope.scaling.type", "tokenizer.ggml.pre")

# the child: for each file, record "start", then load it with edgerun's engine, decode a prompt,
# record the outcome; a crash leaves a "start" without an outcome
CHILD = textwrap.dedent("""
    import json, sys
    from edgerun.errors import EdgerunError
    from edgerun.runtime.engine import Context, Model
    from edgerun.settings import EngineSettings
    files, out = json.load(open(sys.argv[1])), open(sys.argv[2], "a")
    settings = EngineSettings(n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1)
    for path in files:
        out.write(json.dumps(["start", path]) + "\\n"); out.flush()
        try:
            with Model(path) as model, Context(model, settings) as ctx:
                ctx.eval(model.tokenize("def hello(): return 1\\n", add_special=True)[:32])
            out.write(json.dumps(["loaded", path]) + "\\n")
        except EdgerunError as exc:
            out.write(json.dumps(["refused-by-llama.cpp", path, str(exc)]) + "\\n")
        out.flush()
""")


# ---------------------------------------------------------------------------------------------
# each rule, on test_gguf_check's tiny file (no llama.cpp needed): key -> (value, type[, item])

TOKENS = ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(3, N_VOCAB)]
RULES = {
    "no-blocks": ({"llama.block_count": (0, VT.UINT32)}, "llama.block_count is 0"),
    "513-blocks": ({"llama.block_count": (513, VT.UINT32)}, "llama.block_count is 513"),
    "block-count-as-uint64": ({"llama.block_count": (2, VT.UINT64)}, "reads it as UINT32"),
    "nextn-over-blocks": ({"llama.nextn_predict_layers": (3, VT.UINT32)}, "nextn_predict_layers is 3"),
    "too-many-experts": ({"llama.expert_count": (1025, VT.UINT32), "llama.expert_used_count": (2, VT.UINT32)},
                         "expert_count is 1025"),
    "more-used-than-experts": ({"llama.expert_count": (4, VT.UINT32), "llama.expert_used_count": (5, VT.UINT32)},
                               "expert_used_count is 5"),
    "experts-none-used": ({"llama.expert_count": (4, VT.UINT32)}, "expert_used_count is 0"),
    "used-without-experts": ({"llama.expert_used_count": (2, VT.UINT32)}, "more than the 0 experts"),
    "per-layer-used-too-short": ({"llama.expert_count": (4, VT.UINT32),
                                  "llama.expert_used_count": ([2], VT.ARRAY, VT.UINT32)}, "1 values for 2 layers"),
    "expert-groups-not-dividing": ({"llama.expert_count": (6, VT.UINT32), "llama.expert_used_count": (2, VT.UINT32),
                                    "llama.expert_group_count": (4, VT.UINT32),
                                    "llama.expert_group_used_count": (1, VT.UINT32)}, "do not split 6 experts"),
    "unknown-rope-scaling": ({"llama.rope.scaling.type": ("sideways", VT.STRING)}, "rope.scaling.type is 'sideways'"),
    "kv-heads-not-dividing": ({"llama.attention.head_count_kv": (3, VT.UINT32)}, "(3) does not divide"),
    "no-kv-heads": ({"llama.attention.head_count_kv": (0, VT.UINT32)}, "head_count_kv is 0"),
    "heads-not-dividing-width": ({"llama.attention.head_count": (3, VT.UINT32),
                                  "llama.attention.head_count_kv": (1, VT.UINT32)}, "(3) does not divide"),
    "rope-dims-zero": ({"llama.rope.dimension_count": (0, VT.UINT32)}, "rope.dimension_count is 0"),
    "rope-dims-odd": ({"llama.rope.dimension_count": (15, VT.UINT32)}, "rope.dimension_count is 15"),
    "rope-dims-not-head": ({"llama.rope.dimension_count": (8, VT.UINT32)}, "needs them equal"),
    "value-head-not-key-head": ({"llama.attention.value_length": (8, VT.UINT32)}, "needs them equal"),
    "nan-epsilon": ({"llama.attention.layer_norm_rms_epsilon": (math.nan, VT.FLOAT32)}, "epsilon is nan"),
    "negative-epsilon": ({"llama.attention.layer_norm_rms_epsilon": (-1e-6, VT.FLOAT32)}, "cannot be negative"),
    "infinite-rope-base": ({"llama.rope.freq_base": (math.inf, VT.FLOAT32)}, "freq_base is inf"),
    "context-over-int32": ({"llama.context_length": (2**31, VT.UINT32)}, "context_length is 2147483648"),
    "tokens-not-strings": ({"tokenizer.ggml.tokens": (list(range(N_VOCAB)), VT.ARRAY, VT.INT32)}, "array of strings"),
    "repeated-token": ({"tokenizer.ggml.tokens": (TOKENS[:4] + TOKENS[3:4] + TOKENS[5:], VT.ARRAY, VT.STRING)},
                       "repeats the token b'tok3'"),
    "empty-token-meets-its-name": ({"tokenizer.ggml.tokens": (TOKENS[:4] + ["", "[EMPTY_4]"] + TOKENS[6:],
                                                              VT.ARRAY, VT.STRING)}, "b'[EMPTY_4]'"),
    "scores-short": ({"tokenizer.ggml.scores": ([0.0] * (N_VOCAB - 1), VT.ARRAY, VT.FLOAT32)}, "for all 300 tokens"),
    "scores-as-uint8": ({"tokenizer.ggml.scores": ([0] * N_VOCAB, VT.ARRAY, VT.UINT8)}, "FLOAT32 or INT32"),
    "token-type-unknown": ({"tokenizer.ggml.token_type": ([9] + [1] * (N_VOCAB - 1), VT.ARRAY, VT.INT32)},
                           "token types 0..6"),
    "merges-not-strings": ({"tokenizer.ggml.merges": ([1, 2], VT.ARRAY, VT.INT32)}, "merges is not an array"),
    "bos-out-of-vocab": ({"tokenizer.ggml.bos_token_id": (N_VOCAB, VT.UINT32)}, "bos_token_id is 300"),
    "add-bos-without-bos": ({"tokenizer.ggml.model": ("t5", VT.STRING),  # t5 has no default BOS
                             "tokenizer.ggml.add_bos_token": (True, VT.BOOL)}, "no bos token"),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_each_rule_refuses_with_the_key(tmp_path, name):
    override, expect = RULES[name]
    assert_refused(write_gguf(tmp_path / f"{name}.gguf", override=override), expect)


def test_the_rules_accept_their_edges(tmp_path):
    """The limits themselves are allowed: the most experts, per-layer counts, a rope of the full
    head, every token type, the longest context."""
    path = write_gguf(tmp_path / "edges.gguf", override={
        "llama.expert_count": (1024, VT.UINT32), "llama.expert_used_count": ([8, 1024], VT.ARRAY, VT.INT32),
        "llama.rope.dimension_count": (16, VT.UINT32), "llama.rope.scaling.type": ("yarn", VT.STRING),
        "tokenizer.ggml.token_type": (list(range(7)) * (N_VOCAB // 7) + [1] * (N_VOCAB % 7), VT.ARRAY, VT.INT32),
        "tokenizer.ggml.add_bos_token": (True, VT.BOOL), "llama.context_length": (2**31 - 1, VT.UINT32),
    })
    assert inspect(path).n_layers == 2


# ---------------------------------------------------------------------------------------------
# the valid files and their variants


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """A tiny F16 GGUF of each architecture, as edgerun convert writes it."""
    from edgerun.convert.source import prepare_f16
    from testkit.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("bases")
    return {arch: prepare_f16(str(write_tiny_checkpoint(root / arch, arch)), root / f"{arch}-work") for arch in ARCHS}


def read_kvs(path: Path) -> tuple[gguf.GGUFReader, dict[str, tuple]]:
    """The file's keys: name -> (value, type, item type)."""
    reader = gguf.GGUFReader(path)
    kvs = {}
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        sub = f.types[1] if f.types[0] == VT.ARRAY and len(f.types) > 1 else None
        kvs[f.name] = (f.contents(), f.types[0], sub)
    return reader, kvs


class _Writer(gguf.GGUFWriter):
    """gguf-py's writer, packing each array value once: the variants of a base share all its
    arrays but the one they mutate, and gguf-py packs an array item by item (~2 ms a file for the
    vocabulary, merges and scores). The cache holds each value it saw, so an id names one value."""

    def __init__(self, path: Path, arch: str, packed: dict[int, tuple]):
        super().__init__(path, arch)
        self.packed = packed

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype != VT.ARRAY:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        key = (add_vtype, sub_type)
        hit = self.packed.get(id(val))
        if hit is None or hit[0] is not val or hit[1] != key:
            hit = self.packed[id(val)] = (val, key, super()._pack_val(val, vtype, add_vtype, sub_type))
        return hit[2]


def rewrite(reader: gguf.GGUFReader, kvs: dict[str, tuple], out: Path, packed: dict[int, tuple]) -> Path:
    """The file again with these keys (the tensors as they were); packed: _Writer's cache."""
    w = _Writer(out, kvs["general.architecture"][0], packed)
    for key, (value, vtype, sub) in kvs.items():
        if key not in ("general.alignment", "general.architecture"):  # the writer adds these
            w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data)
    w.close()
    return out


def int_values(vtype: VT) -> dict[str, int]:
    """0, a wrapped negative (-1 in the key's own type) and a huge value."""
    bits = _BITS[vtype]
    if vtype in _SIGNED:
        return {"zero": 0, "minus-one": -1, "huge": 2 ** (bits - 1) - 1}
    return {"zero": 0, "wrapped": 2**bits - 1, "huge": 2 ** (bits - 1)}


def variants(arch: str, kvs: dict[str, tuple]) -> dict[str, dict[str, tuple]]:
    """name -> the mutated key set."""
    out: dict[str, dict[str, tuple]] = {}

    def put(name: str, key: str, value) -> None:
        out[f"{arch}:{key}={name}"] = kvs | {key: value}

    for key, (value, vtype, sub) in kvs.items():
        if vtype in _BITS:
            for name, v in int_values(vtype).items():
                put(name, key, (v, vtype, None))
        elif vtype == VT.STRING and key != "general.alignment":
            put("garbage", key, ("zz\u00ff-garbage", VT.STRING, None))
        elif vtype == VT.BOOL:
            put("flipped", key, (not value, VT.BOOL, None))
        elif vtype == VT.FLOAT32:
            for name, v in (("zero", 0.0), ("nan", math.nan), ("minus-inf", -math.inf)):
                put(name, key, (v, VT.FLOAT32, None))
        elif vtype == VT.ARRAY and sub is not None and value:
            array_variants(put, key, list(value), sub)
    for template in _INSERTED_UINT32:
        key = template.replace("{arch}", arch)
        if key not in kvs:
            for name, v in int_values(VT.UINT32).items() | {("one", 1), ("two", 2)}:
                put(name, key, (v, VT.UINT32, None))
    for template in _INSERTED_STRINGS:
        key = template.replace("{arch}", arch)
        put("garbage", key, ("zz-garbage", VT.STRING, None))
    put("true", "tokenizer.ggml.add_bos_token", (True, VT.BOOL, None))
    put("true", "tokenizer.ggml.add_eos_token", (True, VT.BOOL, None))
    n_layer = kvs[f"{arch}.block_count"][0]
    for key in (f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv", f"{arch}.expert_used_count"):
        put("per-layer-zeros", key, ([0] * n_layer, VT.ARRAY, VT.UINT32))
        put("per-layer-short", key, ([1] * (n_layer - 1), VT.ARRAY, VT.UINT32))
    return out


def array_variants(put, key: str, value: list, sub: VT) -> None:
    if sub == VT.STRING:
        put("repeated-item", key, (value[:2] + value[1:2] + value[3:], VT.ARRAY, sub))
        put("empty-item", key, (value[:1] + [""] + value[2:], VT.ARRAY, sub))
        put("no-space", key, (["nospace"] + value[1:], VT.ARRAY, sub))
    elif sub in _BITS:
        for name, v in int_values(sub).items():
            put(f"first-{name}", key, ([v] + value[1:], VT.ARRAY, sub))
    elif sub == VT.FLOAT32:
        put("first-nan", key, ([math.nan] + value[1:], VT.ARRAY, sub))
    put("one-short", key, (value[:-1], VT.ARRAY, sub))
    put("one-item", key, (value[:1], VT.ARRAY, sub))  # gguf-py's writer refuses empty arrays
    put("as-float-array", key, ([0.5] * len(value), VT.ARRAY, VT.FLOAT32))


@pytest.fixture(scope="module")
def corpus(bases, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    files = {}
    for arch, base in bases.items():
        reader, kvs = read_kvs(base)
        packed: dict[int, tuple] = {}
        for i, (name, mutated) in enumerate(variants(arch, kvs).items()):
            files[name] = rewrite(reader, mutated, root / f"{arch}-{i:04d}.gguf", packed)
    return files


# ---------------------------------------------------------------------------------------------
# running them


def run_child(todo: Path, log: Path, env: dict) -> tuple[int | str, str]:
    """One child over the files in TODO: its exit status ("hang" when one file took over
    FILE_LIMIT_S) and the end of its stderr."""
    err_path = log.with_suffix(".stderr")
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(todo), str(log)], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        seen, since = -1, time.monotonic()
        while proc.poll() is None:
            size = log.stat().st_size if log.exists() else 0
            if size != seen:
                seen, since = size, time.monotonic()
            elif time.monotonic() - since > FILE_LIMIT_S:
                proc.kill()
                proc.wait()
                return "hang", f"no progress for {FILE_LIMIT_S} s"
            time.sleep(0.1)
    return proc.returncode, err_path.read_text()[-300:]


def run_children(paths: list[str], workdir: Path) -> dict[str, tuple]:
    """Each path -> its outcome in a child, restarting after a crash; a crash or hang is recorded
    against the file the child was on."""
    results: dict[str, tuple] = {}
    left = list(paths)
    # the test's own EDGERUN_HOME: the child finds inspect()'s memo of each file the parent judged
    # instead of parsing it again
    env = dict(os.environ)
    while left:
        todo, log = workdir / "todo.json", workdir / f"log-{len(results)}.jsonl"
        todo.write_text(json.dumps(left))
        rc, tail = run_child(todo, log, env)
        current = None
        for line in log.read_text().splitlines() if log.exists() else []:
            kind, path, *rest = json.loads(line)
            if kind == "start":
                current = path
            else:
                results[path], current = (kind, *rest), None
        if current is not None:
            results[current] = ("crashed" if rc != "hang" else "hung", rc, tail)
        elif rc != 0:
            raise AssertionError(f"child failed outside any file (rc {rc}): {tail}")
        left = [p for p in left if p not in results]
    return results


def outcomes(corpus: dict[str, Path], workdir: Path) -> dict[str, tuple]:
    """name -> ("refused", message) from inspect(), or the child's outcome."""
    got: dict[str, tuple] = {}
    for name, path in corpus.items():
        try:
            inspect(path)
        except InvalidModelFile as exc:
            got[name] = ("refused", str(exc))
    by_path = {str(path): name for name, path in corpus.items() if name not in got}
    for path, outcome in run_children(list(by_path), workdir).items():
        got[by_path[path]] = outcome
    return got


@pytest.mark.slow
def test_no_hyperparameter_variant_kills_llama_cpp(corpus, tmp_path):
    got = outcomes(corpus, tmp_path)
    counts = {kind: sum(1 for o in got.values() if o[0] == kind) for kind in sorted({o[0] for o in got.values()})}
    print(f"\n{len(got)} variants: {counts}")
    bad = [f"{name}: {o}" for name, o in got.items() if o[0] in ("crashed", "hung")]
    assert not bad, "\n".join(bad)
    for name, o in got.items():
        if o[0] == "refused":
            assert len(o[1].splitlines()) == 1 and o[1].isprintable(), f"{name}: {o[1]!r}"
    assert len(got) == len(corpus) > 300 and counts.get("refused", 0) > 50 and counts.get("loaded", 0) > 50
