"""The `edgerun` command as a user runs it: stdout for text, one-line errors. Most run on the tiny
model (conftest's tiny_model); a real model only where the reply's words or the catalog matter.
Tests of the process itself (stdout and stderr apart, its RSS, a pipe closed under it, Ctrl+C, an
unknown name's one line) run a real edgerun process; the others call cli.main (testkit.cli)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TINY_CTX

from testkit.cli import one_line_error, run_cli

EDGERUN = [sys.executable, "-m", "edgerun.cli"]
# the tiny model on one thread: a step is a fraction of a millisecond of work, so threads meeting at
# llama.cpp's barriers on a busy 2-core CPU cost far more than they share (60 against 4700 tok/s)
ONE_THREAD = ("--threads", "1")


def edgerun(*args, input=None, timeout=300, env=None):
    return subprocess.run([*EDGERUN, *args], capture_output=True, text=True, input=input,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def cli(capsys):
    """`edgerun ARGS` in this process: cli(*args) -> returncode, stdout, stderr."""
    return lambda *args: run_cli(capsys, *args)


def test_run_streams_only_text_to_stdout_and_writes_stats(tiny_model, tmp_path):
    stats_path = tmp_path / "stats.json"
    proc = edgerun("run", "Say hello in one short sentence.", "-m", str(tiny_model), *ONE_THREAD, "-n", "32",
                   "--temp", "0", "--stats-json", str(stats_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "tok/s" not in proc.stdout
    assert "tok/s" in proc.stderr
    stats = json.loads(stats_path.read_text())
    for key in ("prompt_tokens", "generated_tokens", "ttft_s", "decode_tok_s", "prompt_tok_s", "peak_rss_bytes"):
        assert key in stats
    assert 10 < stats["prompt_tokens"] < 100
    assert 1 <= stats["generated_tokens"] <= 32
    assert stats["ttft_s"] > 0 and stats["decode_tok_s"] > 0 and stats["prompt_tok_s"] > 0
    assert stats["peak_rss_bytes"] > tiny_model.stat().st_size  # the weights were read


def test_run_is_deterministic_and_raw_skips_template(tiny_model, cli):
    args = ["-m", str(tiny_model), *ONE_THREAD, "-n", "12", "--temp", "0"]
    a = cli("run", "def fib(n):", *args)
    b = cli("run", "def fib(n):", *args)
    raw = cli("run", "def fib(n):", *args, "--raw")
    assert a.returncode == b.returncode == raw.returncode == 0, a.stderr + raw.stderr
    assert a.stdout == b.stdout
    assert raw.stdout != a.stdout


def test_run_reads_stdin_and_pipes_into_a_closed_reader(tiny_model):
    proc = subprocess.run(
        f"{sys.executable} -m edgerun.cli run - -m {tiny_model} --threads 1 -n 64 --temp 0 | head -c 3",
        shell=True, capture_output=True, text=True, errors="replace", input="Write a poem.", timeout=300,
    )
    assert len(proc.stdout) <= 3
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags", [["--draft", "SELF"], ["--ngram"]], ids=["self-draft", "ngram"])
def test_run_with_speculation_prints_what_plain_decoding_prints(tiny_model, tmp_path, flags, cli):
    """At --temp 0 a speculative reply is the target's own, token for token; the stats say how
    many drafts were proposed and accepted (the tiny model as its own draft accepts every one)."""
    args = ["run", "def add(a, b): return a + b\ndef add(a, b):", "-m", str(tiny_model), "-n", "48", "--temp", "0",
            "--ctx", "512", "--gpu-layers", "0", *ONE_THREAD]
    plain = cli(*args)
    flags = [str(tiny_model) if f == "SELF" else f for f in flags]
    stats_path = tmp_path / "stats.json"
    spec = cli(*args, *flags, "--spec-k", "4", "--stats-json", str(stats_path))
    assert plain.returncode == spec.returncode == 0, plain.stderr + spec.stderr
    assert spec.stdout == plain.stdout and plain.stdout.strip()
    stats = json.loads(stats_path.read_text())
    assert stats["generated_tokens"] == 48 and stats["spec_k"] == 4 and stats["rounds"] > 0
    assert 0 < stats["accepted"] <= stats["drafted"]
    if "--draft" in flags:
        assert stats["draft"] == str(tiny_model) and stats["accepted"] == stats["drafted"]


def test_unknown_model_name():
    line = one_line_error(edgerun("run", "hi", "-m", "no-such-model"), "no-such-model")
    assert "qwen2.5-coder-1.5b" in line  # says what is known


def test_missing_file(tmp_path, cli):
    one_line_error(cli("run", "hi", "-m", str(tmp_path / "nope.gguf")), "no such file")


def test_not_a_gguf(tmp_path, cli):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model\n" * 10)
    one_line_error(cli("run", "hi", "-m", str(bad)), "not a GGUF")


def test_context_larger_than_the_model_supports(tiny_model, cli):
    line = one_line_error(cli("run", "hi", "-m", str(tiny_model), "--ctx", "10000000"), "--ctx")
    assert str(TINY_CTX) in line


def test_an_empty_raw_prompt(tiny_model, cli):
    """Qwen adds no BOS: an empty raw prompt has no tokens (it crashed in the first pick)."""
    proc = cli("run", "", "--raw", "-m", str(tiny_model), *ONE_THREAD, "-n", "4")
    one_line_error(proc, "prompt has no tokens")


def test_counts_below_one_and_a_tiny_context(tiny_model, cli):
    proc = cli("run", "hi", "-m", str(tiny_model), *ONE_THREAD, "-n", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("-n/--max-tokens: '0' is not a whole number of 1 or more")
    # --ctx 16 aborted the process (llama.cpp caps its batch at the context; edgerun chunked the
    # prompt by the requested 512); a context too small for a chat template is now refused
    one_line_error(cli("run", "hi", "-m", str(tiny_model), *ONE_THREAD, "--ctx", "16"), "--ctx 64")


def test_a_reply_stops_where_the_context_ends(tiny_model, tmp_path, cli):
    """The reply is cut ("length") before the context overflows; it ended in a traceback from a
    failed llama_decode."""
    stats = tmp_path / "stats.json"
    proc = cli("run", "List the numbers from 1 to 300, separated by commas.", "-m", str(tiny_model), *ONE_THREAD,
                   "--ctx", "64", "-n", "500", "--temp", "0", "--stats-json", str(stats))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(stats.read_text())
    assert data["finish"] == "length"
    assert 100 < data["generated_tokens"] < 500


def test_bad_gpu_layers_value(tiny_model, cli):
    one_line_error(cli("run", "hi", "-m", str(tiny_model), "--gpu-layers", "lots"), "--gpu-layers")


def test_list_and_doctor(small_model):
    listing = edgerun("list")
    assert listing.returncode == 0
    row = next(line for line in listing.stdout.splitlines() if line.startswith("qwen2.5-coder-0.5b"))
    assert "verified" in row and str(small_model) in row
    doctor = edgerun("doctor", "-m", "qwen2.5-coder-0.5b")
    assert doctor.returncode == 0, doctor.stderr
    assert "backend: CPU only" in doctor.stdout or "backend: CUDA" in doctor.stdout
    assert "AVX2" in doctor.stdout or "NEON" in doctor.stdout
    assert "offload plan for qwen2.5-coder-0.5b" in doctor.stdout


def test_pull_of_a_present_model_prints_only_its_path(small_model):
    proc = edgerun("pull", "qwen2.5-coder-0.5b")
    assert proc.returncode == 0
    assert proc.stdout.strip() == str(small_model)


def test_pull_and_rm_of_unknown_names(cli):
    one_line_error(cli("rm", "no-such-model"), "no-such-model")
    one_line_error(cli("pull", "no-such-model"), "no-such-model")


def test_rm_of_a_converted_model_forgets_it_and_deletes_only_edgeruns_files(cli, tiny_model, edgerun_home, tmp_path):
    import shutil

    from edgerun import paths
    from edgerun.models import local

    paths.models_dir().mkdir(parents=True)
    paths.data_dir().mkdir(parents=True)
    gguf, report = paths.models_dir() / "mine.gguf", paths.data_dir() / "mine.report.json"
    shutil.copy(tiny_model, gguf)
    report.write_text("{}")
    elsewhere = tmp_path / "chosen-by-o.gguf"
    shutil.copy(tiny_model, elsewhere)
    local.register("mine", gguf, origin="test", report={}, report_path=report)
    local.register("theirs", elsewhere, origin="test", report={})
    gone = cli("rm", "mine")
    assert gone.returncode == 0 and "removed mine" in gone.stderr and "kept" not in gone.stderr
    assert not gguf.exists() and not report.exists()
    assert [m.name for m in local.load()] == ["theirs"]
    one_line_error(cli("rm", "mine"), "mine")
    forgotten = cli("rm", "theirs")
    assert forgotten.returncode == 0 and f"kept {elsewhere}" in forgotten.stderr
    assert elsewhere.exists() and local.load() == []


def test_chat_plain_keeps_history_and_exits_on_eof(small_model):
    proc = edgerun("chat", "--plain", str(small_model), "--temp", "0", "-n", "24",
                   input="My name is Ada. Reply with OK.\nWhat is my name? Answer with one word.\n")
    assert proc.returncode == 0, proc.stderr
    assert "Ada" in proc.stdout.split("\n", 1)[1]
    assert sum(line.startswith("[") for line in proc.stderr.splitlines()) == 2  # one stats line per reply


def _wait_for_output(proc, n_bytes: int, timeout: float = 120.0) -> bytes:
    import select
    import time

    got = b""
    deadline = time.monotonic() + timeout
    while len(got) < n_bytes and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            got += os.read(proc.stdout.fileno(), 4096)
    return got


def test_ctrl_c_stops_the_reply_not_the_program(small_model):
    import signal

    proc = subprocess.Popen([*EDGERUN, "chat", "--plain", str(small_model), "--temp", "0", "-n", "400"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b"Write a very long story about a lighthouse keeper.\n")
    proc.stdin.flush()
    partial = _wait_for_output(proc, 40)
    assert len(partial) >= 40
    proc.send_signal(signal.SIGINT)  # mid-reply
    out, err = proc.communicate(b"Now reply with just the word: done\n", timeout=300)
    assert proc.returncode == 0, err.decode()
    assert b"(stopped)" in err and b"Traceback" not in err
    assert sum(line.startswith(b"[") for line in err.splitlines()) == 2  # a stats line per reply
    assert b"done" in (partial + out).lower()
