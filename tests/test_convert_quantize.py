"""llama.cpp's quantizer with per-tensor overrides and an imatrix, on the real 0.5B."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest

from edgerun import _native
from edgerun.convert.imatrix import Imatrix
from edgerun.convert.quantize import anchored, quantize
from edgerun.convert.sensitivity import quantizable, read_rows
from edgerun.errors import ConvertError
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings

OVERRIDES = {
    "blk.0.ffn_down.weight": "Q2_K",
    "blk.1.attn_q.weight": "Q4_0",
    "blk.1.attn_v.weight": "Q5_1",
    "blk.2.ffn_up.weight": "IQ4_NL",
    "blk.11.ffn_down.weight": "Q3_K",  # must not also catch blk.1.ffn_down (an unanchored pattern would not)
}


@pytest.fixture(scope="module")
def quantized(small_model, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("quantized")
    shapes = _native.gguf_tensors(str(small_model))
    # a made-up but well-formed imatrix for a few tensors: exercises the path into llama.cpp
    imatrix = Imatrix(values={n: np.linspace(0.5, 2.0, shapes[n][1][0]).astype(np.float32) for n in OVERRIDES},
                      tokens=1, chunks=1)
    steps = []
    started = time.perf_counter()
    dst = quantize(small_model, out_dir / "out.gguf", ftype="Q8_0", overrides=OVERRIDES, imatrix=imatrix,
                   n_threads=2, progress=lambda *a: steps.append(a))
    return dst, steps, time.perf_counter() - started


@pytest.fixture(scope="module")
def out_tensors(quantized) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(quantized[0]).tensors}


def test_anchored_patterns_match_exactly_one_name():
    pattern = anchored("blk.1.attn_q.weight")
    assert re.search(pattern, "blk.1.attn_q.weight")
    for other in ("blk.11.attn_q.weight", "xblk.1.attn_q.weight", "blk.1.attn_q.weight.x", "blk.1xattn_q.weight"):
        assert not re.search(pattern, other)


@pytest.mark.slow
def test_overridden_tensors_get_exactly_their_type_and_the_rest_the_base(quantized, out_tensors):
    dst, steps, _ = quantized
    types = {name: t.tensor_type.name for name, t in out_tensors.items()}
    for name, t in OVERRIDES.items():
        assert types[name] == t, name
    rest = {name: t for name, t in out_tensors.items() if name not in OVERRIDES}
    assert {types[n] for n, t in rest.items() if quantizable(t)} == {"Q8_0"}
    assert {types[n] for n, t in rest.items() if not quantizable(t)} == {"F32"}  # norms, biases
    assert steps[-1][1] == steps[-1][2] == len(types) and steps[0][0] == "quantize"
    assert [p.name for p in dst.parent.iterdir()] == ["out.gguf"]  # no temp, no imatrix left


@pytest.mark.slow
def test_llama_cpp_quantized_with_the_imatrix(quantized, small_model):
    name = "blk.1.attn_q.weight"  # Q4_0: with an imatrix ggml searches weighted scales
    from edgerun.convert.tensors import open_gguf

    src_file, out_file = open_gguf(small_model), open_gguf(quantized[0])
    src = next(t for t in src_file.tensors if t.name == name)
    out = next(t for t in out_file.tensors if t.name == name)
    w = read_rows(src_file, src, np.arange(int(src.shape[1])))
    importance = np.linspace(0.5, 2.0, w.shape[1]).astype(np.float32)
    got = float(((w.astype(np.float64) - read_rows(out_file, out, np.arange(w.shape[0]))) ** 2 * importance).sum())
    # exactly the error of ggml's weighted quantizer with that importance, not the plain one's
    assert got == pytest.approx(_native.quant_error(int(gguf.GGMLQuantizationType.Q4_0), w, importance, 2), rel=1e-9)
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    plain = gguf.quants.dequantize(gguf.quants.quantize(w, q4_0), q4_0)  # ggml's reference, no imatrix
    assert got < 0.99 * float(((w.astype(np.float64) - plain) ** 2 * importance).sum())


@pytest.mark.slow
def test_output_loads_and_generates(quantized, small_model):
    dst, _, _ = quantized
    prompt = "def fibonacci(n):\n    "

    def greedy(path: Path, n: int = 8) -> list[int]:
        with Model(path) as model, Context(model, EngineSettings(n_ctx=128, n_batch=64, n_threads=2)) as ctx:
            tokens = model.tokenize(prompt, add_special=True)
            out = []
            for _ in range(n):
                ctx.prefill(tokens + out)
                logits = ctx.logits()
                assert np.all(np.isfinite(logits))
                out.append(int(np.argmax(logits)))
            return out

    got = greedy(dst)
    assert got[0] == greedy(small_model, 1)[0]  # mostly Q8_0: the obvious next token survives
    assert len(set(got)) > 1


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _no_leftovers(directory: Path, children_before: set[int]) -> None:
    assert list(directory.iterdir()) == []
    # The quantizer child is gone too (helpers other tests started, e.g. the template box, may stay).
    assert _children() - children_before == set()


@pytest.mark.slow
def test_exception_in_progress_stops_and_removes_everything(small_model, tmp_path):
    def interrupt(step, done, total):
        if done >= 3:
            raise KeyboardInterrupt

    imatrix = Imatrix(values={"blk.0.attn_q.weight": np.ones(896, np.float32)}, tokens=1, chunks=1)
    children_before = _children()
    with pytest.raises(KeyboardInterrupt):
        quantize(small_model, tmp_path / "out.gguf", ftype="Q4_K_M", overrides={}, imatrix=imatrix, progress=interrupt)
    _no_leftovers(tmp_path, children_before)


@pytest.mark.slow
def test_ctrl_c_leaves_no_output_and_no_temp(small_model, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # a shell that starts jobs in the background (CI runners do) passes SIGINT on ignored: restore
    # the handler a terminal's Ctrl-C would meet
    script = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "from pathlib import Path; from edgerun.convert.quantize import quantize; "
              "quantize(Path(sys.argv[1]), Path(sys.argv[2]), ftype='Q4_K_M', overrides={}, imatrix=None)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(small_model), str(out_dir / "out.gguf")],
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not any(p.suffix == ".part" and p.stat().st_size > 0 for p in out_dir.iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, "the quantize never started writing"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and b"KeyboardInterrupt" in err
    assert list(out_dir.iterdir()) == []


@pytest.mark.slow
def test_bad_requests_are_refused(small_model, tmp_path):
    with pytest.raises(ConvertError, match="unknown quantization"):
        quantize(small_model, tmp_path / "o.gguf", ftype="Q4_K_Z", overrides={}, imatrix=None)
    with pytest.raises(ConvertError, match="no tensor 'blk.99.attn_q.weight'"):
        quantize(small_model, tmp_path / "o.gguf", ftype="Q4_K_M", overrides={"blk.99.attn_q.weight": "Q4_0"},
                 imatrix=None)
    with pytest.raises(ConvertError, match="rows of 896 values"):
        quantize(small_model, tmp_path / "o.gguf", ftype="Q4_K_M", overrides={"blk.0.attn_q.weight": "Q4_K"},
                 imatrix=None)
    not_gguf = tmp_path / "broken.gguf"
    not_gguf.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ConvertError, match="llama.cpp could not quantize"):
        quantize(not_gguf, tmp_path / "o.gguf", ftype="Q4_K_M", overrides={}, imatrix=None)
    assert [p.name for p in tmp_path.iterdir()] == ["broken.gguf"]
