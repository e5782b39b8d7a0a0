"""`edgerun convert` as a user runs it: one-line errors for bad arguments (through cli.main), and a
whole conversion of a tiny random-weight model (the 0.5B's real tokenizer, two small layers)
through every step, in a real edgerun process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from testkit.cli import run_cli

EDGERUN = [sys.executable, "-m", "edgerun.cli"]
CODE = Path(__file__).parents[1] / "edgerun" / "data" / "calib" / "code.txt"


def edgerun(*args, env=None, timeout=900):
    return subprocess.run([*EDGERUN, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line_error(proc, *needles) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgerun: error:"), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def cli(capsys):
    """`edgerun ARGS` through cli.main (the argument checks need no process of their own)."""
    return lambda *args: run_cli(capsys, *args)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    """Any file that exists will do for the argument checks, which run before it is read."""
    path = tmp_path_factory.mktemp("args") / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_missing_src(tmp_path, cli):
    one_line_error(cli("convert", tmp_path / "nope", "-o", tmp_path / "o.gguf", "--quant", "Q4_K_M"),
                   "no such file or directory")
    one_line_error(cli("convert", "-o", tmp_path / "o.gguf", "--quant", "Q4_K_M"), "name what to convert")


def test_budget_flags(gguf_file, tmp_path, cli):
    out = tmp_path / "o.gguf"
    one_line_error(cli("convert", gguf_file, "-o", out, "--quant", "Q4_K_M", "--bpw", "3.5"), "exactly one budget")
    one_line_error(cli("convert", gguf_file, "-o", out), "exactly one budget")
    one_line_error(cli("convert", gguf_file, "-o", out, "--size", "big"), "--size 'big'")
    one_line_error(cli("convert", gguf_file, "-o", out, "--size=-3GB"), "--size")
    one_line_error(cli("convert", gguf_file, "-o", out, "--bpw", "three"), "--bpw")
    one_line_error(cli("convert", gguf_file, "-o", out, "--quant", "Q9_X"), "Q9_X")


def test_calib_and_paths(gguf_file, tmp_path, cli):
    out = tmp_path / "o.gguf"
    one_line_error(cli("convert", gguf_file, "-o", out, "--quant", "Q4_K_M", "--calib", "code,poetry"),
                   "unknown calibration set 'poetry'", "code, chat, prose")
    one_line_error(cli("convert", gguf_file, "--quant", "Q4_K_M"), "-o OUT.gguf")
    one_line_error(cli("convert", gguf_file, "-o", tmp_path / "no" / "o.gguf", "--quant", "Q4_K_M"),
                   "directory does not exist")
    one_line_error(cli("convert", gguf_file, "-o", out, "--quant", "Q4_K_M", "--threads", "0"), "--threads")


# --- a whole conversion ---

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Everything but the sizes: the real tokenizer, template and special ids."""
    sizes = {"qwen2.embedding_length": HIDDEN, "qwen2.feed_forward_length": FFN, "qwen2.block_count": LAYERS,
             "qwen2.attention.head_count": HEADS, "qwen2.attention.head_count_kv": KV_HEADS}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = sizes.get(field.name, field.contents())
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _random_tensors(n_vocab: int):
    rng = np.random.default_rng(5)
    f16 = lambda *shape, std=0.05: (rng.standard_normal(shape) * std).astype(np.float16)  # noqa: E731
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    yield "token_embd.weight", f16(n_vocab, HIDDEN, std=0.1)  # tied: also the output layer
    yield "output_norm.weight", ones(HIDDEN)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", ones(HIDDEN)
        for name, rows in (("attn_q", HIDDEN), ("attn_k", kv), ("attn_v", kv)):
            yield p + name + ".weight", f16(rows, HIDDEN)
            yield p + name + ".bias", np.zeros(rows, dtype=np.float32)
        yield p + "attn_output.weight", f16(HIDDEN, HIDDEN)
        yield p + "ffn_norm.weight", ones(HIDDEN)
        yield p + "ffn_gate.weight", f16(FFN, HIDDEN)
        yield p + "ffn_up.weight", f16(FFN, HIDDEN)
        yield p + "ffn_down.weight", f16(HIDDEN, FFN)


@pytest.fixture(scope="module")
def tiny_f16(small_model, tmp_path_factory) -> Path:
    """An F16 qwen2 GGUF with random weights: 2 layers of width 256, the 0.5B's tokenizer."""
    reader = gguf.GGUFReader(small_model)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    path = tmp_path_factory.mktemp("tiny") / "tiny-f16.gguf"
    writer = gguf.GGUFWriter(path, "qwen2")
    _copy_metadata(reader, writer)
    for name, data in _random_tensors(n_vocab):
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
def test_convert_end_to_end_and_rerun_reuses_steps(tiny_f16, tmp_path):
    env = {"EDGERUN_HOME": str(tmp_path / "home")}
    calib = tmp_path / "calib.txt"
    calib.write_text(CODE.read_text()[:8000])
    out, report_path = tmp_path / "out.gguf", tmp_path / "report.json"
    size = int(0.45 * tiny_f16.stat().st_size)  # about 7 bits per weight: room for real choices
    proc = edgerun("convert", tiny_f16, "-o", out, "--size", str(size), "--calib", calib,
                   "--eval-chunks", "1", "--report", report_path, "--threads", "2", env=env)
    assert proc.returncode == 0, proc.stderr
    for step in ("calibrate", "sensitivity", "weigh roles", "quantize", "evaluate"):
        assert step in proc.stderr
    assert "mean KLD" in proc.stdout and "ffn_down" in proc.stdout

    doc = json.loads(report_path.read_text())
    for key in ("size_bytes", "bpw", "kld_mean", "top1_agreement", "ppl", "ppl_ref", "tensors"):
        assert doc[key] is not None, key
    assert doc["size_bytes"] == out.stat().st_size <= size
    assert doc["kld_mean"] > 0 and 0 < doc["top1_agreement"] <= 1 and doc["ppl"] > 0
    assert doc["plan"]["tensor_bytes"] <= doc["budget_bytes"]
    assert set(doc["role_gains"]) == {"token_embd.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                      "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
    assert all(g > 0 for g in doc["role_gains"].values())
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    planned = doc["plan"]["types"]
    assert planned and {n: written[n] for n in planned} == planned  # the quantizer followed the plan
    assert len(set(planned.values())) > 1  # a mixed plan, not one type everywhere
    assert {n: t["type"] for n, t in doc["tensors"].items()} == written
    assert written["blk.0.attn_norm.weight"] == "F32"

    again = edgerun("convert", tiny_f16, "-o", tmp_path / "again.gguf", "--size", str(size), "--calib", calib,
                    "--eval-chunks", "0", "--keep-f16", tmp_path / "kept.gguf", env=env)
    assert again.returncode == 0, again.stderr
    for step in ("calibrate", "sensitivity", "weigh roles"):
        assert f"{step} (cached)" in again.stderr
    assert (tmp_path / "again.gguf").read_bytes() == out.read_bytes()  # same plan, same bytes
    assert (tmp_path / "kept.gguf").read_bytes() == tiny_f16.read_bytes()


@pytest.mark.slow
def test_quant_budget_is_the_size_of_llama_cpp_recipe(tiny_f16, tmp_path):
    """--quant Q3_K_M's budget: the dry run's types are the types a real stock quantize writes."""
    from edgerun.convert import pipeline, plan
    from edgerun.convert.quantize import quantize

    stock = pipeline.stock_types(tiny_f16, "Q3_K_M")
    real = quantize(tiny_f16, tmp_path / "stock.gguf", ftype="Q3_K_M", overrides={}, imatrix=None)
    tensors = gguf.GGUFReader(real).tensors
    assert stock == {t.name: t.tensor_type.name for t in tensors}
    assert plan.budget_for_types(stock, {t.name: int(t.n_elements) for t in tensors}) == sum(
        int(t.n_bytes) for t in tensors)


@pytest.mark.slow
def test_role_gains_predict_the_kld_of_two_roles_quantized_together(tiny_f16, tmp_path):
    """The planner adds up gain x error over tensors; check that on a probe the gains never saw."""
    from edgerun.convert import gains, pipeline
    from edgerun.convert.quantize import quantize
    from edgerun.convert.report import Reference

    calib = tmp_path / "calib.txt"
    calib.write_text(CODE.read_text()[:8000])
    opts = pipeline.ConvertOptions(src=str(tiny_f16), output=tmp_path / "unused.gguf", quant="Q4_K_M",
                                   calib=(str(calib),), n_threads=2)
    imatrix, key = pipeline.cached_imatrix(tiny_f16, opts, tmp_path, None)
    costs = pipeline.cached_costs(tiny_f16, imatrix, key, opts, tmp_path, None)
    measured = pipeline.cached_gains(tiny_f16, imatrix, key, costs, opts, tmp_path, None)
    assert set(measured) == {gains.role_of(c.name) for c in costs} and all(g > 0 for g in measured.values())
    assert not any((tmp_path / "probe").iterdir())  # probes are removed

    pair = {c.name: gains.probe_type(c) for c in costs
            if gains.role_of(c.name) in ("attn_v.weight", "ffn_down.weight")}
    predicted = sum(measured[gains.role_of(c.name)] * c.errors[pair[c.name]] for c in costs if c.name in pair)
    reference = Reference(tiny_f16, calib.read_text(), n_ctx=gains.PROBE_CTX, max_chunks=gains.PROBE_CHUNKS,
                          first=gains.PROBE_FIRST, n_threads=2)
    cheap = quantize(tiny_f16, tmp_path / "cheap.gguf", ftype=gains.PROBE_FTYPE, overrides=pair, imatrix=imatrix)
    rise = reference.compare(gains.Splicer(tiny_f16, cheap).write(set(pair), tmp_path / "both.gguf")).kld_mean
    print(f"KLD rise {rise:.5f}, predicted {predicted:.5f}")
    assert 0.6 * predicted < rise < 1.6 * predicted
