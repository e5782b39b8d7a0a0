"""`edgerun bench serve`: edgerun serve vs llama.cpp's llama-server, side by side, under the
same load (loadgen.py).

Both servers load the same model file with the same threads, `--parallel` slots and context per
slot (llama-server: `-np`, `-c` = slots x context, continuous batching), on free 127.0.0.1
ports. They take ABBA turns at each concurrency level and in the long-prompt run; the idle one
is stopped with SIGSTOP so it takes no CPU (as the chat-app scenario does), and both are
stopped at the end. A ratio is taken per pair of neighbouring turns, so a shared machine's drift
falls on both sides. `edgerun run` on the same prompt, with both servers stopped, is the
single-stream reference; `--batched-bench` adds llama.cpp's own batched decode ceiling
(llama-batched-bench at the same batch sizes, same threads).

Claims (docs/BENCHMARKS.md, Serving): aggregate tok/s at the top concurrency >= 1.0x
llama-server and >= 0.9x llama-batched-bench; concurrency 1 >= 0.98x llama-server and >= 0.95x
`edgerun run`; the running streams' TPOT P99 while long prompts arrive <= llama-server's.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from edgerun.bench import load, shapes
from edgerun.bench.scenario import Scenario, claim, count, interleave, register
from edgerun.bench.stats import ratio_spread
from edgerun.errors import ConfigError, EdgerunError

OURS, THEIRS = "edgerun serve", "llama-server"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="catalog name or .gguf (default qwen2.5-coder-0.5b)")
    p.add_argument("--shape", default=None, choices=list(shapes.SHAPES),
                   help="instead of -m: a random-weight Qwen2.5 shape (bench/shapes.py), written once and reused")
    p.add_argument("--shapes-dir", type=Path, default=None, help="where shapes are written (default: the cache's shapes/)")
    p.add_argument("--gpu-layers", default=None,
                   help="layers on the GPU, both servers and edgerun run: a count, all, or 0 (default: all where"
                        " a GPU is, else 0)")
    load.add_load_args(p, concurrency="1,16")
    p.add_argument("--threads", type=count, default=None,
                   help="CPU threads, both servers (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--ctx", type=count, default=4096, help="context per slot in tokens (default 4096)")
    p.add_argument("--parallel", type=count, default=None, help="slots of both servers (default: the top concurrency)")
    p.add_argument("--repeat", type=count, default=2, help="turns per side at each level (default 2)")
    p.add_argument("--sides", default=f"{OURS},{THEIRS}", help=f"the servers to run (default '{OURS},{THEIRS}')")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: build/bin's, then PATH)")
    p.add_argument("--batched-bench", nargs="?", const="", default=None, metavar="BIN",
                   help="also measure llama-batched-bench's ceiling (default binary: build/bin's, then PATH)")
    p.add_argument("--no-run", action="store_true", help="leave out the `edgerun run` reference")
    p.add_argument("--plot", type=Path, default=None, help="a PNG of latency and tok/s per level, both servers")


def _sides(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or any(n not in (OURS, THEIRS) for n in names):
        raise ConfigError(f"--sides takes '{OURS}' and/or '{THEIRS}'; '{text}' is not that")
    return names


def _start(name: str, args, model: Path, threads: int, parallel: int, logdir: Path, binary: str | None):
    from edgerun.bench import servers

    log = logdir / f"{name.replace(' ', '-')}.log"
    if name == OURS:
        return servers.start_edgerun(model, threads, args.ctx, parallel, log, ["--gpu-layers", str(args.ngl)])
    return servers.start_llama_server(binary, model, threads, args.ctx, parallel, log, ngl=args.ngl)


def _gpu_layers(text: str | None) -> int:
    """--gpu-layers as one count for every side: all is 999 (llama.cpp and edgerun clamp it to
    the model's layers and its output head), the default all where a GPU is, else 0."""
    from edgerun.runtime import devices

    if text is None:
        text = "all" if devices.gpu_offload_supported() else "0"
    if text == "all":
        return 999
    if not text.isdigit():
        raise ConfigError(f"--gpu-layers takes a layer count, all or 0; '{text}' is none of them")
    return int(text)


def _model(args) -> Path:
    from edgerun import paths
    from edgerun.models.fetch import resolve

    if args.shape and args.model:
        raise ConfigError("give -m or --shape, not both")
    if args.shape:
        return shapes.ensure(args.shape, args.shapes_dir or paths.cache_dir() / "shapes")
    return resolve(args.model or "qwen2.5-coder-0.5b")


def _turns(live: dict, run, repeat: int, say, what: str) -> dict[str, list]:
    """`run(server)` for each side, `repeat` times in ABBA order, the others stopped meanwhile."""
    out: dict[str, list] = {name: [] for name in live}
    names = list(live)
    for rep in range(repeat):
        for name in names if rep % 2 == 0 else names[::-1]:
            live[name].resume()
            try:
                out[name].append(run(live[name]))
            finally:
                live[name].pause()
        say(f"[{what} {rep + 1}/{repeat}] done")
    return out


def _median_turn(turns: list[dict], key) -> dict:
    """The turn whose figure is the (lower) median: the one the table shows."""
    return sorted(turns, key=key)[(len(turns) - 1) // 2]


def _edgerun_run(model: Path, prompt: str, n: int, threads: int, ctx: int, ngl: int) -> float:
    from edgerun.bench import servers

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stats.json"
        proc = subprocess.run([sys.executable, "-m", "edgerun.cli", "run", prompt, "-m", str(model), "-n", str(n),
                               "--temp", "0", "--threads", str(threads), "--gpu-layers", str(ngl), "--ctx", str(ctx),
                               "--stats-json", str(out)], capture_output=True, text=True, timeout=servers.TOOL_S)
        if proc.returncode != 0:
            raise EdgerunError(f"edgerun run failed (exit {proc.returncode}): {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        return json.loads(out.read_text())["decode_tok_s"]


def _measure_live(live: dict, args, model: Path, threads: int, say) -> dict:
    from edgerun.bench import loadgen

    prompts = load.prompt_texts(args.prompts)
    targets = {}
    for name, server in live.items():
        server.resume()
        targets[name] = loadgen.connect(server.url, None, None)
        loadgen.warm_up(targets[name], prompts[0])
        server.pause()
    figures = {name: {"turns": {}, "levels": [], "long": None} for name in live}
    for c in args.concurrency:
        got = _turns(live, lambda s, c=c: loadgen.run_level(targets[_name(live, s)], prompts, c,
                                                           load.requests_for(args, c), args.max_tokens),
                     args.repeat, say, f"concurrency {c}")
        for name, turns in got.items():
            figures[name]["turns"][str(c)] = turns
            figures[name]["levels"].append(_median_turn(turns, lambda t: t["output_tok_s"]))
    if args.long_prompts:
        got = _turns(live, lambda s: loadgen.run_long(targets[_name(live, s)], prompts, args.long_streams,
                                                      args.long_prompts, args.long_count, args.max_tokens),
                     args.repeat, say, "long prompts")
        for name, turns in got.items():
            figures[name]["turns"]["long"] = turns
            figures[name]["long"] = _median_turn(turns, lambda t: t["streams_tpot_ms"]["p99"] or 0)
    single = None
    if OURS in live and not args.no_run:
        ours = live[OURS]
        one = lambda: _resumed(ours, lambda: loadgen.run_level(targets[OURS], prompts[:1], 1, 1, args.max_tokens)["decode_tok_s"])
        single = interleave({OURS: one, "edgerun run": lambda: _edgerun_run(model, prompts[0], args.max_tokens,
                                                                            threads, args.ctx, args.ngl)},
                            args.repeat, say)
    return {"figures": figures, "single": single}


def _name(live: dict, server) -> str:
    return next(n for n, s in live.items() if s is server)


def _resumed(server, run):
    server.resume()
    try:
        return run()
    finally:
        server.pause()


def measure(args: argparse.Namespace, say) -> dict:
    from edgerun.bench import servers
    from edgerun.settings import default_threads

    names = _sides(args.sides)
    args.ngl = _gpu_layers(args.gpu_layers)
    model, threads = _model(args), args.threads or default_threads()
    parallel = args.parallel or max(max(args.concurrency), args.long_streams + 1 if args.long_prompts else 1)
    binary = servers.llama_tool("llama-server", args.llama_server) if THEIRS in names else None
    batched = servers.llama_tool("llama-batched-bench", args.batched_bench or None) if args.batched_bench is not None else None
    live: dict = {}
    # a SIGTERM to the bench stops its servers too (by default Python dies without its finally blocks)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory() as logdir:
        try:
            for name in names:
                live[name] = _start(name, args, model, threads, parallel, Path(logdir), binary)
                live[name].pause()
            got = _measure_live(live, args, model, threads, say)
        finally:
            for server in live.values():
                server.close()
            signal.signal(signal.SIGTERM, previous)
    ceiling = None
    if batched:
        ceiling = servers.llama_batched_bench(batched, model, threads, args.concurrency, 128, args.max_tokens, ngl=args.ngl)
        say("llama-batched-bench S_TG: " + ", ".join(f"{b}: {v:.1f}" for b, v in ceiling.items()))
    if args.plot is not None:
        load.plot(got["figures"], args.plot)
    settings = {"model": args.model or (f"shape {args.shape}" if args.shape else "qwen2.5-coder-0.5b"),
                "path": str(model), "gpu_layers": args.ngl, "threads": threads, "ctx_per_slot": args.ctx,
                "parallel": parallel, "repeat": args.repeat, "sides": names} | load.settings(args)
    return {"settings": settings, "servers": got["figures"], "edgerun_run": got["single"],
            "batched_bench_tg_tok_s": ceiling, "claims": _claims(got, ceiling, args)}


def _per_turn(figures: dict, name: str, key: str, pick) -> list[float]:
    return [pick(t) for t in figures.get(name, {}).get("turns", {}).get(key, [])]


def _claims(got: dict, ceiling: dict | None, args) -> list[dict]:
    f, top = got["figures"], str(max(args.concurrency))
    agg = lambda name, c: _per_turn(f, name, c, lambda t: t["output_tok_s"])
    out = []
    if top != "1":  # the batched claim; at concurrency 1 alone it would be the next one under another goal
        out.append(claim(f"{OURS} / {THEIRS} aggregate tok/s at concurrency {top}", ratio_spread(agg(THEIRS, top), agg(OURS, top)) if THEIRS in f else None, ">= 1.0"))
    out.append(claim(f"{OURS} / {THEIRS} aggregate tok/s at concurrency 1", ratio_spread(agg(THEIRS, "1"), agg(OURS, "1")) if "1" in f.get(OURS, {}).get("turns", {}) and THEIRS in f else None, ">= 0.98"))
    single = got["single"]
    out.append(claim(f"{OURS} at concurrency 1 / edgerun run decode tok/s",
                     ratio_spread(single["edgerun run"], single[OURS]) if single else None, ">= 0.95"))
    if args.long_prompts:
        p99 = lambda name: _per_turn(f, name, "long", lambda t: t["streams_tpot_ms"]["p99"])
        ratio = ratio_spread(p99(THEIRS), p99(OURS)) if OURS in f and THEIRS in f else None
        out.append(claim(f"running streams' TPOT P99 with {args.long_prompts}-token prompts arriving, {OURS} / {THEIRS}",
                         ratio, "<= 1.0"))
    if ceiling and OURS in f and int(top) in ceiling:
        out.append(claim(f"{OURS} aggregate tok/s at concurrency {top} / llama-batched-bench at batch {top}",
                         statistics.median(agg(OURS, top)) / ceiling[int(top)], ">= 0.9"))
    return out


def report(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"{s['model']}, {s['threads']} threads, {s['parallel']} slots of {s['ctx_per_slot']} tokens,"
             f" max_tokens {s['max_tokens']}, T=0, {s['repeat']} turns per side (median turn shown)"]
    for name, figures in doc["servers"].items():
        lines += [name, *load.table(figures)]
    if doc.get("edgerun_run"):
        lines.append("single stream decode tok/s: " + ", ".join(
            f"{n} {statistics.median(v):.1f}" for n, v in doc["edgerun_run"].items()))
    if doc.get("batched_bench_tg_tok_s"):
        lines.append("llama-batched-bench S_TG tok/s: " + ", ".join(
            f"batch {b}: {v:.1f}" for b, v in doc["batched_bench_tg_tok_s"].items()))
    return "\n".join(lines)


register(Scenario("serve", "edgerun serve vs llama-server under the same load: aggregate tok/s at the top"
                  " concurrency (goal >= 1.0) and at 1 (>= 0.98), long-prompt TPOT P99 (<= 1.0)",
                  add_args, measure, report))
