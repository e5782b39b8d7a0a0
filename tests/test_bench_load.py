"""The load generator (edgerun bench load) and the serve scenario's server handling: the pure
figures from recorded requests; then the generator against a real llama-server (built by
`EDGERUN_LLAMA_BENCH=1 scripts/setup.sh`) on the tiny random-weight model, every server
stopped; a bad URL, a dead server or a server that is not OpenAI-compatible is one line."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from edgerun.bench import load, loadgen, servers
from edgerun.errors import ConfigError, EdgerunError
from testkit.cli import run_cli

LLAMA_SERVER = servers.CHECKOUT_BIN / "llama-server"
BATCHED_BENCH = servers.CHECKOUT_BIN / "llama-batched-bench"
needs_llama_server = pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK),
                                        reason="llama-server is built by EDGERUN_LLAMA_BENCH=1 scripts/setup.sh")
# the tiny model on one thread: its step is a fraction of a millisecond, so two threads meeting at
# llama.cpp's barriers beside the other tests' load cost far more than they share
THREADS = 1


def outcome(sent: float, chunks: list[float], tokens: int, error: str | None = None) -> loadgen.Outcome:
    return loadgen.Outcome(sent=sent, chunks=chunks, done=(chunks or [sent])[-1] + 0.5, tokens=tokens, error=error)


# -- the figures, from recorded requests -----------------------------------------------------------


def test_a_level_summary_is_the_requests_percentiles_over_its_wall_time():
    outs = [outcome(0.0, [1.0, 2.0, 3.0], 3), outcome(0.0, [2.0, 2.5, 4.5], 5), outcome(1.0, [], 0, "boom: 500"),
            outcome(1.0, [], 0, "second")]
    s = loadgen.summarize(outs, wall=8.0)
    assert (s["requests"], s["ok"], s["errors"], s["first_error"]) == (4, 2, 2, "boom: 500")
    # TTFT 1.0 and 2.0 s; TPOT (last - first) / (tokens - 1): 2/2 = 1.0 and 2.5/4 = 0.625 s
    assert s["ttft_ms"]["p50"] == pytest.approx(1500) and s["ttft_ms"]["p99"] == pytest.approx(1990)
    assert s["tpot_ms"]["p50"] == pytest.approx((1000 + 625) / 2)
    assert s["e2e_ms"]["p50"] == pytest.approx((3.5 + 5.0) / 2 * 1000)
    # tokens are the usage counts (3 + 5), not the chunks (3 + 3)
    assert s["completion_tokens"] == 8 and s["output_tok_s"] == pytest.approx(1.0)
    assert s["requests_s"] == pytest.approx(0.25)


def test_a_one_token_reply_has_a_ttft_but_no_tpot():
    s = loadgen.summarize([outcome(0.0, [0.25], 1)], wall=1.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(250) and s["tpot_ms"]["p50"] is None


def test_the_long_prompt_figures_split_the_streams_gaps_at_the_window():
    window = (10.0, 20.0)
    before = outcome(0.0, [1.0, 1.1, 1.2], 3)  # gaps of 0.1 s, all before the first long prompt
    stalled = outcome(8.0, [9.0, 9.1, 15.0, 15.1], 4)  # one 5.9 s stall while a long prompt ran
    after = outcome(25.0, [26.0, 27.0], 2)  # outside the window: not a running stream
    long = outcome(10.0, [14.0, 14.5], 2)
    s = loadgen.long_summary([before, stalled, after], [long], window)
    assert s["streams_gap_ms"]["max"] == pytest.approx(5900)  # the 9.1 -> 15.0 gap ends inside
    assert s["streams_gap_before_ms"]["max"] == pytest.approx(100)
    assert s["streams_tpot_ms"]["p50"] == pytest.approx(6.1 / 3 * 1000)  # only the overlapping request
    assert s["long_ttft_ms"] == [pytest.approx(4000)] and s["errors"] == 0


def test_the_serve_claims_name_each_goal_once():
    from edgerun.bench import serve

    def figures(levels):
        return {"turns": {c: [{"output_tok_s": tok_s}, {"output_tok_s": tok_s}] for c, tok_s in levels.items()}}

    def claims(levels: list[int], ours: dict, theirs: dict) -> dict:
        got = {"figures": {serve.OURS: figures(ours), serve.THEIRS: figures(theirs)}, "single": None}
        args = argparse.Namespace(concurrency=levels, long_prompts=None)
        out = serve._claims(got, None, args)
        assert len({c["claim"] for c in out}) == len(out)
        return {c["claim"]: (c["goal"], c["median"]) for c in out}

    alone = claims([1], {"1": 24.0}, {"1": 25.0})
    at_1 = f"{serve.OURS} / {serve.THEIRS} aggregate tok/s at concurrency 1"
    assert alone[at_1] == (">= 0.98", pytest.approx(0.96))
    both = claims([1, 16], {"1": 24.0, "16": 66.0}, {"1": 25.0, "16": 60.0})
    assert both[at_1] == (">= 0.98", pytest.approx(0.96))
    assert both[f"{serve.OURS} / {serve.THEIRS} aggregate tok/s at concurrency 16"] == (">= 1.0", pytest.approx(1.1))


@pytest.mark.parametrize("text", ["0", "1,x", "", "4,-1"])
def test_concurrency_levels_are_counts(text):
    with pytest.raises(argparse.ArgumentTypeError):
        load.levels(text)
    assert load.levels("16, 1,4,4") == [1, 4, 16]


def test_urls_and_tools():
    assert loadgen.base_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080/v1"
    assert loadgen.base_url("http://h:1/v1") == "http://h:1/v1"
    with pytest.raises(ConfigError, match="http://HOST:PORT"):
        loadgen.base_url("127.0.0.1:8080")
    with pytest.raises(ConfigError, match="no llama-server at /nonexistent"):
        servers.llama_tool("llama-server", "/nonexistent")


# -- one line for a server that is not there -------------------------------------------------------


def _bench(capsys, *argv: str):
    """`edgerun bench ARGV` in this process (testkit.cli): the servers it starts are its children
    as they would be the command's."""
    return run_cli(capsys, "bench", *argv)


class _NotOpenAI(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def not_openai():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_dead_server_a_bad_url_and_a_foreign_server_are_one_line(not_openai, capsys):
    dead = f"http://127.0.0.1:{servers.free_port()}"
    for url, words in ((dead, "no OpenAI-compatible server answers at"), ("localhost:8080", "--url takes"),
                       (not_openai, "answered 404; is this an OpenAI-compatible server?")):
        proc = _bench(capsys, "load", "--url", url, "--concurrency", "1")
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], proc.stderr


# -- against a real llama-server on the tiny model -------------------------------------------------


@pytest.fixture(scope="module")
def llama_server(tiny_model, tmp_path_factory):
    server = servers.start_llama_server(str(LLAMA_SERVER), tiny_model, threads=THREADS, ctx=1024, parallel=2,
                                        log=tmp_path_factory.mktemp("llama-server") / "log")
    yield server
    server.close()
    assert server.proc.poll() is not None


@needs_llama_server
def test_a_level_against_llama_server_counts_what_it_served(llama_server):
    target = loadgen.connect(llama_server.url, None, None)
    assert target.base_url == llama_server.url + "/v1" and target.model  # the name the server lists
    level = loadgen.run_level(target, list(loadgen.PROMPTS), concurrency=2, requests=5, max_tokens=8)
    assert (level["requests"], level["ok"], level["errors"]) == (5, 5, 0), level["first_error"]
    # the server's usage: at most max_tokens each, and the aggregate is exactly those over the wall time
    assert 5 <= level["completion_tokens"] <= 5 * 8
    assert level["output_tok_s"] == pytest.approx(level["completion_tokens"] / level["wall_s"])
    assert 0 < level["ttft_ms"]["p50"] <= level["ttft_ms"]["p99"] <= level["e2e_ms"]["p99"]


@needs_llama_server
def test_long_prompts_are_about_the_asked_length_by_the_servers_count(llama_server):
    target = loadgen.connect(llama_server.url, None, None)
    got = loadgen.run_long(target, list(loadgen.PROMPTS), streams=1, tokens=300, n=2, max_tokens=8)
    assert got["errors"] == 0 and len(got["long_ttft_ms"]) == 2 and all(t > 0 for t in got["long_ttft_ms"])
    for n in got["long_prompt_tokens"]:
        assert 240 <= n <= 360, got["long_prompt_tokens"]
    assert got["streams_tpot_ms"]["p50"] is not None  # a short stream ran while they did


@needs_llama_server
def test_the_cli_writes_every_level_and_a_plot(llama_server, tmp_path, capsys):
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    proc = _bench(capsys, "load", "--url", llama_server.url, "--concurrency", "1,2", "--requests", "3", "-n", "8",
                  "--long-prompts", "200", "--long-streams", "1", "--long-count", "1", "--json", str(out),
                  "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["scenario"] == "load" and doc["claims"] == []
    (figures,) = doc["servers"].values()
    assert [lv["concurrency"] for lv in figures["levels"]] == [1, 2]
    assert all(lv["ok"] == 3 for lv in figures["levels"])
    assert figures["long"]["long_count"] == 1
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "concurrency" not in proc.stdout.splitlines()[0] and "TTFT p50/p90/p99 ms" in proc.stdout


def _servers_of(model: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if str(model) in (p.info["cmdline"] or []) and p.pid != os.getpid():
            found.append(p)
    return found


@needs_llama_server
def test_the_serve_scenario_on_llama_server_alone_stops_it(tiny_model, tmp_path, capsys):
    out = tmp_path / "serve.json"
    before = {p.pid for p in _servers_of(tiny_model)}  # the module's own llama-server, if it runs
    proc = _bench(capsys, "serve", "-m", str(tiny_model), "--sides", "llama-server", "--concurrency", "1,2", "--requests",
                  "2", "-n", "8", "--repeat", "2", "--threads", str(THREADS), "--ctx", "512", "--no-run", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    turns = doc["servers"]["llama-server"]["turns"]
    assert sorted(turns) == ["1", "2"] and all(len(t) == 2 for t in turns.values())
    assert doc["settings"]["parallel"] == 2
    # the claims that need edgerun serve are there, not measured
    assert doc["claims"] and all(c["median"] is None for c in doc["claims"])
    assert not {p.pid for p in _servers_of(tiny_model)} - before, "the scenario's llama-server is still running"


@needs_llama_server
def test_a_server_that_cannot_start_is_one_error_naming_its_last_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(EdgerunError, match="llama-server exited"):
        servers.start_llama_server(str(LLAMA_SERVER), bad, threads=1, ctx=256, parallel=1, log=tmp_path / "log")
    assert not _servers_of(bad)


@pytest.mark.skipif(not os.access(BATCHED_BENCH, os.X_OK),
                    reason="llama-batched-bench is built by EDGERUN_LLAMA_BENCH=1 scripts/setup.sh")
def test_llama_batched_bench_gives_a_rate_per_batch_size(tiny_model):
    got = servers.llama_batched_bench(str(BATCHED_BENCH), tiny_model, threads=THREADS, batches=[1, 2], prompt=16, gen=8)
    assert sorted(got) == [1, 2] and all(v > 0 for v in got.values())


@needs_llama_server
def test_the_serve_scenario_measures_both_servers_and_stops_them(tiny_model, tmp_path, capsys):
    out = tmp_path / "serve.json"
    before = {p.pid for p in _servers_of(tiny_model)}
    proc = _bench(capsys, "serve", "-m", str(tiny_model), "--concurrency", "1,2", "--requests", "2", "-n", "8", "--repeat",
                  "2", "--threads", str(THREADS), "--ctx", "1024", "--long-prompts", "200", "--long-streams", "1",
                  "--long-count", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert sorted(doc["servers"]) == ["edgerun serve", "llama-server"]
    for figures in doc["servers"].values():
        assert sorted(figures["turns"]) == ["1", "2", "long"] and all(len(t) == 2 for t in figures["turns"].values())
        assert all(lv["errors"] == 0 and lv["ok"] == 2 for lv in figures["levels"])
    assert len(doc["edgerun_run"]["edgerun run"]) == 2
    # every claim but llama-batched-bench's (not asked for) has a figure from paired turns
    assert len(doc["claims"]) == 4 and all(c["median"] is not None for c in doc["claims"])
    assert not {p.pid for p in _servers_of(tiny_model)} - before, "a server of the scenario is still running"


@pytest.mark.parametrize("argv,says", [
    (["--gpu-layers", "lots"], "--gpu-layers takes a layer count, all or 0"),
    (["--shape", "0.5b"], "give -m or --shape, not both"),
])
def test_the_serve_scenario_refuses_bad_placement_flags_before_starting(tiny_model, argv, says, capsys):
    before = {p.pid for p in _servers_of(tiny_model)}
    proc = _bench(capsys, "serve", "-m", str(tiny_model), "--sides", "edgerun serve", *argv)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr
    assert not {p.pid for p in _servers_of(tiny_model)} - before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_that_comes_while_a_server_starts_stops_that_server(tmp_path, monkeypatch, sig):
    # the signal lands after the fork, before Popen returns (the real Popen, then the signal)
    started = []

    def popen_then_signal(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        signal.raise_signal(sig)
        return started[-1]

    real_popen, int_handler = subprocess.Popen, signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(servers.subprocess, "Popen", popen_then_signal)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # as `bench serve` has it
    try:
        with pytest.raises((SystemExit, KeyboardInterrupt)):
            servers.Server("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(started) == 1 and started[0].poll() is not None, "the server outlived the bench"
    assert signal.getsignal(signal.SIGINT) is int_handler  # the held handlers are put back


def test_a_terminated_serve_scenario_stops_its_server(tiny_model):
    import time

    before = {p.pid for p in _servers_of(tiny_model)}
    bench = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "bench", "serve", "-m", str(tiny_model), "--sides",
                              "edgerun serve", "--concurrency", "1", "--requests", "1000", "--threads", "1", "--ctx",
                              "256", "--no-run"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = lambda: {p.pid for p in _servers_of(tiny_model)} - before - {bench.pid}  # noqa: E731
    try:
        for _ in range(1200):  # until its server runs (a bound, polled every 0.1 s)
            if started() or bench.poll() is not None:
                break
            time.sleep(0.1)
        assert started() and bench.poll() is None
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM
        assert not started(), "the scenario's server outlived it"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
