"""`edgerun bench rpc`: a model split over `edgerun rpc-server`s (ggml's RPC backend) against the
same model run locally, and against llama.cpp's own `--rpc` client on the same split.

    edgerun bench rpc [-m MODEL | --shape 7b] [--spawn cpu,cpu] [--mem 0.7,0.7]
    edgerun bench rpc --shape 7b --spawn gpu,cpu --mem 3,3 --max-vram 0 --llama-bench build/bin/llama-bench

The servers are started by the scenario on 127.0.0.1 (`--spawn`: one per entry, `gpu` serves the
GPU, `cpu` the host CPU even where a GPU is) and stopped at its end. An rpc-server serves one
client at a time, so every side is a process of its own in ABBA turns (`edgerun run --stats-json`,
as the GPU scenarios run it); the bytes the client moves per decode step come from the patched
ggml-rpc's own counters (runtime/rpc.py: `traffic`), in an in-process reply before the turns. With
--llama-bench, llama-bench runs the very split edgerun planned (`--rpc`, `-dev`, `-ngl`, `-ts`)
against the same servers: tg at the prompt's depth, as the GPU scenarios compare.

Layers run one after another, so a split adds memory, not speed: the figure to expect against a
local run that fits is below 1, and the claim against llama.cpp's client is the goal (>= 0.97).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
from pathlib import Path

from edgerun.bench.gpu import PROMPT, edgerun_run
from edgerun.bench.scenario import Scenario, claim, count, interleave, register, side_lines
from edgerun.bench.stats import ratio_spread, spread
from edgerun.errors import ConfigError, EngineError


def _args(p: argparse.ArgumentParser) -> None:
    from edgerun import paths

    p.add_argument("-m", "--model", default=None, help="catalog name or path (default: the catalog's target)")
    p.add_argument("--shape", default=None, help="a random-weight shape instead (bench/shapes.py: 0.5b, 1.5b, 7b)")
    p.add_argument("--shapes-dir", type=Path, default=paths.cache_dir() / "shapes")
    p.add_argument("--spawn", default="cpu,cpu", help="servers to start here, one per entry: gpu or cpu (default cpu,cpu)")
    p.add_argument("--mem", default=None, metavar="GIB[,GIB...]",
                   help="each spawned server's --mem (default: 0.7 of the model's layers each, so none holds it alone)")
    p.add_argument("--server-threads", type=count, default=1, help="CPU threads per spawned server (default 1)")
    p.add_argument("--threads", type=count, default=None,
                   help="the client's CPU threads (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--max-vram", type=float, default=None, metavar="GIB", help="the client's own GPU budget (0: none)")
    p.add_argument("--tokens", type=count, default=64, help="tokens per reply (default 64)")
    p.add_argument("--repeat", type=count, default=4, help="replies per side (default 4)")
    p.add_argument("--no-local", action="store_true", help="skip the local side (a model that does not fit here)")
    p.add_argument("--llama-bench", default=None, metavar="BIN", help="also run llama-bench --rpc on the same split")


@contextlib.contextmanager
def _servers(kinds: list[str], mems: list[float | None], threads: int):
    """The spawned servers' endpoints; their logs go to a temporary folder (a server that does not
    start is reported with its last line)."""
    from edgerun.bench.servers import rpc_servers

    with tempfile.TemporaryDirectory(prefix="edgerun-bench-rpc-") as logs, \
            rpc_servers(Path(logs), kinds, mems, threads) as started:
        yield [s.url for s in started]


def _reply(runner, tokens: int) -> tuple[float, float | None]:
    """(decode tok/s, client bytes per decode step or None) of one greedy reply."""
    from edgerun.decode.generate import Step
    from edgerun.runtime import rpc
    from edgerun.settings import SamplerSettings

    steps, first, last = 0, None, None
    for record in runner.stream(runner.raw_tokens(PROMPT), SamplerSettings(temperature=0.0), max_tokens=tokens):
        if isinstance(record, Step):
            steps += 1
            now = (record.t, sum(rpc.traffic()) if runner.remote else 0)
            first = first or now
            last = now
    if steps < 2:
        raise EngineError("the reply ended after one token; use another prompt or model")
    rate = (steps - 1) / (last[0] - first[0])
    return rate, ((last[1] - first[1]) / (steps - 1) if runner.remote else None)


def _llama_bench(binary: str, model: Path, eps: list[str], split, *, tokens: int, depth: int, threads: int | None) -> float:
    used = [(s, x) for s, x in zip(split.shares, split.tensor_split) if x]  # devices edgerun gives layers to
    if any(not s.name.startswith("RPC") for s, _ in used):
        raise ConfigError("llama-bench's side runs the split on the servers only: give the client --max-vram 0")
    ts = "/".join(str(int(x)) for _, x in used)
    cmd = [binary, "-m", str(model), "--rpc", ",".join(eps), "-dev", "/".join(s.name.split()[0] for s, _ in used),
           "-ngl", str(split.gpu_layers), "-ts", ts, "-p", "0", "-n", str(tokens), "-r", "1", "-d", str(depth), "-o", "json"]
    cmd += ["-t", str(threads)] if threads else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EngineError(f"llama-bench --rpc failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def _run(args: argparse.Namespace, say) -> dict:
    from edgerun.bench import shapes
    from edgerun.models import catalog
    from edgerun.models.fetch import resolve
    from edgerun.models.gguf_check import inspect
    from edgerun.runner import Runner, footprint
    from edgerun.runtime import placement
    from edgerun.settings import EngineSettings

    model = shapes.ensure(args.shape, args.shapes_dir) if args.shape else resolve(args.model or catalog.load().default_target)
    kinds = [k.strip() for k in args.spawn.split(",") if k.strip()]
    if not kinds or any(k not in ("cpu", "gpu") for k in kinds):
        raise ConfigError(f"--spawn {args.spawn!r}: a comma-separated list of gpu and cpu")
    engine = EngineSettings().replace(n_ctx=4096, n_threads=args.threads,
                                      max_vram=int(args.max_vram * 2**30) if args.max_vram is not None else None)
    if args.mem:
        mems = [float(x) for x in args.mem.split(",")]
        if len(mems) != len(kinds):
            raise ConfigError(f"--mem gives {len(mems)} sizes for {len(kinds)} servers")
    else:
        fp = footprint(inspect(model), engine)
        each = (sum(fp.layer_bytes) + fp.kv_per_layer * fp.n_layers + fp.output_bytes) * 0.7
        mems = [(each + placement.REMOTE_MARGIN + 2 * fp.compute_bytes) / 2**30] * len(kinds)
    flags = ["--draft", "none"] + (["--threads", str(args.threads)] if args.threads else [])
    flags += ["--max-vram", str(args.max_vram)] if args.max_vram is not None else []
    with _servers(kinds, mems, args.server_threads) as eps:
        # an rpc-server serves one client at a time: each side is a process of its own, in turns, and
        # the in-process Runner that counts the bytes per step is closed before the turns start; its
        # replies are also the servers' warm-up (the same model on the same split)
        with Runner(model, engine.replace(rpc=",".join(eps)), draft="none") as remote:
            split, speeds = remote.plan.devices, [d.speed for d in remote.remote]
            say(f"split: {split.describe()}")
            _reply(remote, 4)
            traffic = [_reply(remote, args.tokens)[1] for _ in range(2)]
            depth = len(remote.raw_tokens(PROMPT))  # the prompt `edgerun run --raw` evaluates
        rpc_flags = [*flags, "--rpc", ",".join(eps)]
        sides = {"rpc": lambda: edgerun_run(model, *rpc_flags, tokens=args.tokens)["decode_tok_s"]}
        if not args.no_local:
            sides = {"local": lambda: edgerun_run(model, *flags, tokens=args.tokens)["decode_tok_s"], **sides}
        if args.llama_bench:
            sides["llama_bench"] = lambda: _llama_bench(args.llama_bench, model, eps, split, tokens=args.tokens,
                                                       depth=depth, threads=args.threads)
        values = interleave(sides, args.repeat, say)
    claims = []
    if "local" in values:
        claims.append(claim("rpc split over loopback / local decode tok/s (a split adds memory, not speed)",
                            ratio_spread(values["local"], values["rpc"]), ">= 0.5"))
    if "llama_bench" in values:
        claims.append(claim("edgerun --rpc / llama-bench --rpc, same split and servers",
                            ratio_spread(values["llama_bench"], values["rpc"]), ">= 0.97"))
    settings = {"model": str(model), "prompt": PROMPT, "spawn": kinds, "mem_gib": mems, "tokens": args.tokens,
                "repeat": args.repeat, "server_threads": args.server_threads, "threads": engine.n_threads,
                "split": split.describe(), "tensor_split": split.tensor_split, "n_gpu_layers": split.gpu_layers,
                "device_speeds": speeds, "depth": depth}
    return {"settings": settings, "claims": claims, "tok_s": values,
            "sides": {name: spread(v) for name, v in values.items()},
            "client_bytes_per_decode_step": spread(traffic)}


def _report(doc: dict) -> str:
    b = doc["client_bytes_per_decode_step"] or {"median": 0, "min": 0, "max": 0}
    return "\n".join([f"split: {doc['settings']['split']}", *side_lines(doc["sides"]),
                      f"client bytes per decode step (sent + received): median {b['median']:.0f}"
                      f" ({b['min']:.0f}-{b['max']:.0f})"])


register(Scenario(name="rpc", help="a model split over rpc-servers vs local, and vs llama-bench --rpc (goal >= 0.97)",
                  add_args=_args, run=_run, report=_report))
