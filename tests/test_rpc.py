"""ggml's RPC backend: `edgerun rpc-server` processes on 127.0.0.1 and a Runner with `--rpc`.

Every server is a real `edgerun rpc-server` process, stopped when the test that starts it ends
(the pair two tests share: when the second ends; killed if it does not stop). The splits are
checked against llama.cpp's own accounting (the memory each server reports in use after the load)
and the replies against a local run."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgerun.bench.servers import free_port, rpc_servers
from edgerun.errors import ConfigError, EngineError
from edgerun.runtime import placement, rpc
from edgerun.runner import Runner
from edgerun.settings import EngineSettings, SamplerSettings
from testkit.cli import run_cli

MiB = 2**20
GREEDY = SamplerSettings(temperature=0.0)


@contextlib.contextmanager
def servers(logs, n: int, *, mem_gib: float):
    """n `edgerun rpc-server`s on 127.0.0.1 serving their CPU, each capped at mem_gib; yields
    (endpoints, bench.servers.Server of each)."""
    with rpc_servers(logs, ["cpu"] * n, [mem_gib] * n, threads=1) as started:
        yield [s.url for s in started], started


def _reply(runner: Runner, prompt: str, n: int) -> list[int]:
    return [r.token for r in runner.stream(runner.raw_tokens(prompt), GREEDY, max_tokens=n) if hasattr(r, "token")]


def _used(runner: Runner) -> list[int]:
    """Bytes each server's device holds now (what it reports as total minus free)."""
    return [total - free for free, total in map(rpc.memory, (d.handle for d in runner.remote))]


# --- the plan (pure) -------------------------------------------------------------------------

def _fp(n: int = 10, block: int = 100 * MiB) -> placement.Footprint:
    return placement.Footprint(layer_bytes=(block,) * n, input_bytes=50 * MiB, output_bytes=80 * MiB,
                               kv_per_layer=10 * MiB, compute_bytes=20 * MiB)


def test_equal_devices_share_blocks_in_proportion_to_free_memory():
    places = [placement.Place("a", 2000 * MiB, margin=0), placement.Place("b", 1000 * MiB, margin=0)]
    split = placement.plan_devices(_fp(), places, free_ram=64 * 2**30)
    assert [s.blocks for s in split.shares] == [7, 3] and split.cpu_blocks == 0
    assert [s.head for s in split.shares] == [False, True]  # the head goes with the last device
    # llama.cpp deals n_gpu_layers - 1 blocks plus the head by tensor_split, in device order
    assert split.gpu_layers == 11 and split.tensor_split == (7.0, 4.0)


def test_faster_devices_fill_first_and_the_cpu_takes_what_fits_nowhere():
    fp = _fp()
    places = [placement.Place("slow", 10_000 * MiB, speed=1.0, margin=0),
              placement.Place("fast", 130 + 450 * MiB, speed=4.0, margin=0)]
    split = placement.plan_devices(fp, places, free_ram=64 * 2**30)
    # fast: (450 MiB - compute 20 - head 80) // 110 = 3 blocks; the slow one takes the other 7
    assert [s.blocks for s in split.shares] == [7, 3]
    tight = [placement.Place("small", 300 * MiB, margin=0)]
    split = placement.plan_devices(fp, tight, free_ram=64 * 2**30)
    assert split.shares[0].blocks == 1 and split.cpu_blocks == 9
    assert split.cpu_bytes >= 9 * 110 * MiB + fp.input_bytes


def test_measured_speeds_rank_devices_alike_together_and_a_slow_one_after():
    gb = 1e9
    # two servers alike, measured with noise, share a rank; a remote CPU ten times slower ranks after
    assert placement.speed_classes([20 * gb, 14 * gb, 1.5 * gb]) == [1.0, 1.0, 1.5 / 20]
    assert placement.speed_classes([None, 3 * gb]) == [1.0, 1.0]  # unmeasured: as the fastest
    assert placement.speed_classes([None, None]) == [1.0, 1.0]
    fp = _fp()
    ranks = placement.speed_classes([1.5 * gb, 20 * gb])
    places = [placement.Place("remote cpu", 10_000 * MiB, speed=ranks[0], margin=0),
              placement.Place("remote gpu", 130 + 450 * MiB, speed=ranks[1], margin=0)]
    split = placement.plan_devices(fp, places, free_ram=64 * 2**30)
    assert [s.blocks for s in split.shares] == [7, 3]  # the GPU as full as its room allows, the CPU the rest
    even = placement.speed_classes([1.5 * gb, 2 * gb])
    places = [placement.Place("a", 2000 * MiB, speed=even[0], margin=0),
              placement.Place("b", 1000 * MiB, speed=even[1], margin=0)]
    assert [s.blocks for s in placement.plan_devices(fp, places, free_ram=64 * 2**30).shares] == [7, 3]


@given(st.lists(st.tuples(st.integers(0, 3000), st.sampled_from([1.0, 4.0])), min_size=1, max_size=4),
       st.integers(1, 40))
def test_a_device_plan_places_every_block_once_and_never_past_a_place_s_room(places, n):
    fp = _fp(n)
    spots = [placement.Place(f"d{i}", free * MiB, speed=speed, margin=0) for i, (free, speed) in enumerate(places)]
    split = placement.plan_devices(fp, spots, free_ram=2**50)
    assert sum(s.blocks for s in split.shares) + split.cpu_blocks == n
    for share, spot in zip(split.shares, spots):
        assert share.bytes <= spot.free or not share.blocks
    heads = [s for s in split.shares if s.head]
    assert len(heads) == (1 if split.cpu_blocks < n else 0) and (not heads or heads[0] is
                                                                  [s for s in split.shares if s.blocks][-1])
    assert split.gpu_layers == (n - split.cpu_blocks + 1 if split.cpu_blocks < n else 0)


def test_a_plan_whose_host_share_does_not_fit_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="fit on no device.*add an rpc server"):
        placement.plan_devices(_fp(), [placement.Place("small", 300 * MiB, margin=0)], free_ram=1200 * MiB)


def test_the_draft_stays_local_and_a_local_gpu_comes_last():
    remote = [placement.Place("RPC0", 600 * MiB, margin=0)]
    plan = placement.plan_remote(_fp(), _fp(2, 10 * MiB), remote, free_vram=8 * 2**30, free_ram=64 * 2**30,
                                 gpu_available=True)
    assert plan.draft.all_on_gpu
    assert [s.name for s in plan.devices.shares] == ["RPC0", "local GPU"]
    assert plan.devices.shares[-1].head and plan.devices.shares[-1].blocks == 10  # the faster local GPU first


# --- the build, endpoints and servers down at start ---------------------------------------------

def test_the_installed_llama_cpp_has_the_patched_rpc_backend_and_no_false_gpu():
    assert rpc.lib().patched and rpc.available() == "built in (GGML_RPC=ON)"
    from edgerun.runtime import devices
    import llama_cpp

    # llama.cpp counts RPC as GPU offload; edgerun asks for a local GPU device instead
    assert devices.gpu_offload_supported() == bool(rpc.local_gpus())
    assert llama_cpp.llama_supports_rpc()



def test_endpoints_parse_and_bad_ones_say_the_form():
    assert [str(e) for e in rpc.parse("10.0.0.2:50052, box")] == ["10.0.0.2:50052", f"box:{rpc.DEFAULT_PORT}"]
    for bad in ("host:port", ":50052", "a:1,a:1", ",", "h:70000"):
        with pytest.raises(ConfigError, match="--rpc"):
            rpc.parse(bad)


def test_a_server_down_at_start_is_one_line_naming_it(tiny_model):
    port = free_port()
    with pytest.raises(ConfigError, match=f"rpc server 127.0.0.1:{port} is not reachable"):
        Runner(tiny_model, EngineSettings(rpc=f"127.0.0.1:{port}", n_ctx=256), draft="none")
    out = subprocess.run([sys.executable, "-m", "edgerun.cli", "run", "hi", "-m", str(tiny_model), "--rpc",
                          f"127.0.0.1:{port}", "--draft", "none"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"edgerun: error: rpc server 127.0.0.1:{port} is not reachable (Connection refused):"
        " start `edgerun rpc-server` there or drop it from --rpc"]


def test_the_server_refuses_a_port_in_use_and_warns_off_loopback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "edgerun.cli", "rpc-server", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "rpc-server", "--host", "0.0.0.0", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert "warning: ggml's RPC protocol has no authentication" in first and "trusted network only" in first
        # the line it says once SIGTERM stops it cleanly
        assert any("Ctrl-C stops" in line for line in proc.stderr), "rpc-server exited before it served"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        proc.stderr.close()


# --- a tiny model split over two servers ------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two servers of 0.5 GiB, fresh for the split test; the timeout test after it silences one,
    so it is their last client."""
    with servers(tmp_path_factory.mktemp("rpc"), 2, mem_gib=0.5) as got:
        yield got


def test_a_tiny_model_split_over_two_servers_replies_as_the_local_run(tiny_model, pair):
    settings = EngineSettings(n_ctx=512, n_threads=1, gpu_layers="0")
    with Runner(tiny_model, settings, draft="none") as local:
        want = _reply(local, "split me", 48)
    eps, _ = pair
    with Runner(tiny_model, settings.replace(rpc=",".join(eps)), draft="none") as remote:
        assert [s.blocks for s in remote.plan.devices.shares] == [1, 1]  # equal servers: one block each
        assert remote.plan.devices.cpu_blocks == 0
        assert all(d.speed and d.speed > 0 for d in remote.remote)  # each device's probe ran on it
        held = _used(remote)
        assert all(n > 0 for n in held), held  # each server holds its share (weights and KV)
        sent_before = rpc.traffic()[0]
        assert _reply(remote, "split me", 48) == want
        assert rpc.traffic()[0] > sent_before  # the decode steps went over the sockets
    from edgerun import doctor

    text = doctor.report(str(tiny_model), ",".join(eps))  # the plan as `edgerun doctor --rpc` shows it
    assert "RPC backend: built in (GGML_RPC=ON)" in text
    assert sum(f"at {ep}:" in text for ep in eps) == 2
    assert text.count("streams weights at") == 3 and "? (not measured)" not in text  # this CPU and each device
    assert f"0/2 layers on the local CPU" in text and f"({eps[1]}) + head" in text


def test_a_server_that_stops_answering_ends_the_reply_within_the_timeout(tiny_model, pair):
    settings = EngineSettings(n_ctx=512, n_threads=1, gpu_layers="0", rpc_timeout_s=2)
    eps, started = pair
    with Runner(tiny_model, settings.replace(rpc=",".join(eps)), draft="none") as runner:
        assert len(_reply(runner, "warm", 4)) == 4
        started[1].pause()  # SIGSTOP: alive but silent; only the timeout can end the wait
        start = time.monotonic()
        with pytest.raises(EngineError, match=f"rpc server {eps[1]} stopped answering"):
            _reply(runner, "and now", 200)
        assert time.monotonic() - start < 2 + 10  # the timeout, plus scheduling on a loaded machine
        # the runner stays usable as an object: a new reply says the same at once, close frees it
        with pytest.raises(EngineError, match=eps[1]):
            _reply(runner, "again", 4)


# --- the real 1.5B over two capped servers (model tier) ---------------------------------------

def test_the_1_5b_split_over_two_capped_servers_equals_the_local_run(target_model, tmp_path):
    from edgerun.models.gguf_check import inspect
    from edgerun.runner import footprint

    settings = EngineSettings(n_ctx=512, gpu_layers="0")
    info = inspect(target_model)
    fp = footprint(info, settings)
    # each server holds well under the whole model, the two together all of it
    cap = (sum(fp.layer_bytes) + fp.output_bytes) * 0.7 + placement.REMOTE_MARGIN + 2 * fp.compute_bytes
    prompt = "def fibonacci(n):"
    # the servers' CPU backend runs llama.cpp's plain kernels (no repacked weights): the local run
    # that must agree bit for bit runs the same ones
    with Runner(target_model, settings.replace(cpu_repack=False), draft="none") as local:
        want = _reply(local, prompt, 24)
    with servers(tmp_path, 2, mem_gib=cap / 2**30) as (eps, started):
        with Runner(target_model, settings.replace(rpc=",".join(eps)), draft="none") as runner:
            shares = [s.blocks for s in runner.plan.devices.shares]
            assert all(0 < n < info.n_layers for n in shares) and runner.plan.devices.cpu_blocks == 0
            assert _reply(runner, prompt, 24) == want
            # a server killed mid-reply: the reply ends with the error naming it, within the timeout
            stream = runner.stream(runner.raw_tokens("Write a long story about a lighthouse."), GREEDY,
                                   max_tokens=400)
            got, start = 0, None
            with pytest.raises(EngineError, match=f"rpc server {eps[0]} stopped answering"):
                for record in stream:
                    if hasattr(record, "token"):
                        got += 1
                        if got == 3:
                            started[0].proc.kill()
                            started[0].proc.wait()
                            start = time.monotonic()
            assert start is not None and time.monotonic() - start < settings.rpc_timeout_s


def test_bench_rpc_measures_both_sides_and_the_bytes_per_step(tiny_model, tmp_path, capsys):
    # the bench in this process (testkit.cli): its servers and `edgerun run` turns are its children
    # as they are the command's
    out = tmp_path / "rpc.json"
    proc = run_cli(capsys, "bench", "rpc", "-m", tiny_model, "--repeat", "1", "--tokens", "16", "--threads", "1",
                   "--json", out)
    assert proc.returncode == 0, proc.stderr
    import json

    doc = json.loads(out.read_text())
    assert doc["scenario"] == "rpc" and set(doc["tok_s"]) == {"local", "rpc"}
    assert doc["settings"]["n_gpu_layers"] == 3
    # two servers of one CPU: measured alike they share the blocks by memory; where the machine's
    # load made one measure more than twice as fast, it takes every block it has room for
    speeds = doc["settings"]["device_speeds"]
    alike = len(set(placement.speed_classes(speeds))) == 1
    fast = speeds.index(max(speeds))
    assert doc["settings"]["tensor_split"] == ([1.0, 2.0] if alike else [3.0 * (i == fast) for i in range(2)])
    assert [c["claim"].split(" ")[0] for c in doc["claims"]] == ["rpc"]
    # every decode step moves the tiny model's logits (320 floats) back at least
    assert doc["client_bytes_per_decode_step"]["median"] > 320 * 4
