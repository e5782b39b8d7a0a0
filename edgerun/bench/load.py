"""`edgerun bench load`: the load generator (loadgen.py) against one running OpenAI-compatible
server: per concurrency level TTFT, TPOT and end-to-end latency P50/P90/P99, aggregate output
tok/s and requests/s, errors; with `--long-prompts TOKENS`, long prompts among running streams.

It measures one server and states no claim of its own; `edgerun bench serve` runs it against
edgerun serve and llama-server side by side and states the serving claims.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from edgerun.bench.scenario import Scenario, count, register
from edgerun.bench.table import align
from edgerun.errors import ConfigError

DEFAULT_TOKENS = 128


def levels(text: str) -> list[int]:
    """argparse type of --concurrency: comma-separated counts, e.g. 1,4,16."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of counts of 1 or more (e.g. 1,4,16)")
    return sorted({int(p) for p in parts})


def add_load_args(p: argparse.ArgumentParser, concurrency: str = "1,4,16") -> None:
    """The flags `load` and `serve` share: levels, requests, prompts, reply length, long prompts."""
    p.add_argument("--concurrency", type=levels, default=levels(concurrency),
                   help=f"clients at once, one level each (default {concurrency})")
    p.add_argument("--requests", type=count, default=None,
                   help="requests per level (default: twice the level's concurrency, at least 4)")
    p.add_argument("--prompts", default=None,
                   help="a prompt file or a shipped set (edgerun bench -h); default: requests for 300-word replies")
    p.add_argument("-n", "--max-tokens", type=count, default=DEFAULT_TOKENS,
                   help=f"max_tokens of every request (default {DEFAULT_TOKENS}), at temperature 0")
    p.add_argument("--long-prompts", type=count, default=None, metavar="TOKENS",
                   help="also send prompts of about TOKENS tokens among running streams (e.g. 2000)")
    p.add_argument("--long-streams", type=count, default=4, help="short streams running meanwhile (default 4)")
    p.add_argument("--long-count", type=count, default=2, help="long prompts, one after another (default 2)")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server: http://HOST:PORT (or its /v1)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="its key (default $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="the model name requests carry (default: the first it lists)")
    add_load_args(p)
    p.add_argument("--plot", type=Path, default=None, help="a PNG of latency and tok/s per level")


def prompt_texts(choice: str | None) -> list[str]:
    from edgerun.bench.ab import load_prompts
    from edgerun.bench.loadgen import PROMPTS

    return list(PROMPTS) if choice is None else [p.text for p in load_prompts(choice)]


def requests_for(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests or max(4, 2 * concurrency)


def settings(args: argparse.Namespace) -> dict:
    return {"concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
            "temperature": 0.0, "prompts": args.prompts or "300-word replies (built in)",
            "long_prompts": args.long_prompts, "long_streams": args.long_streams, "long_count": args.long_count}


def run_all(target, args: argparse.Namespace, say) -> dict:
    """Every level, then the long-prompt run if asked: the figures of one server."""
    from edgerun.bench import loadgen

    prompts = prompt_texts(args.prompts)
    loadgen.warm_up(target, prompts[0])
    out = {"levels": [], "long": None}
    for c in args.concurrency:
        level = loadgen.run_level(target, prompts, c, requests_for(args, c), args.max_tokens)
        say(level_line(level))
        out["levels"].append(level)
    if args.long_prompts:
        out["long"] = loadgen.run_long(target, prompts, args.long_streams, args.long_prompts, args.long_count,
                                       args.max_tokens)
        say(long_line(out["long"]))
    return out


def measure(args: argparse.Namespace, say) -> dict:
    from edgerun.bench import loadgen

    target = loadgen.connect(args.url, args.api_key, args.model)
    if args.plot is not None and not args.plot.parent.is_dir():
        raise ConfigError(f"--plot {args.plot}: its folder does not exist")
    body = {"settings": {"url": target.base_url, "model": target.model} | settings(args),
            "servers": {target.base_url: run_all(target, args, say)}, "claims": []}
    if args.plot is not None:
        plot(body["servers"], args.plot)
    return body


def _f(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def level_line(level: dict) -> str:
    return (f"concurrency {level['concurrency']}: {level['output_tok_s']:.1f} tok/s, TTFT P50 "
            f"{_f(level['ttft_ms']['p50'])} ms, TPOT P50 {_f(level['tpot_ms']['p50'])} ms, {level['errors']} errors")


def long_line(long: dict) -> str:
    return (f"long prompts ({long['long_tokens']} tokens) among {long['streams']} streams: TPOT P99 "
            f"{_f(long['streams_tpot_ms']['p99'])} ms, largest gap {_f(long['streams_gap_ms']['max'])} ms")


def table(figures: dict) -> list[str]:
    """One server's levels as rows, and its long-prompt figures."""
    head = ["conc", "tok/s", "req/s", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "E2E p50/p99 s", "tokens", "errors"]
    rows = [head]
    for lv in figures["levels"]:
        t, p, e = lv["ttft_ms"], lv["tpot_ms"], lv["e2e_ms"]
        rows.append([str(lv["concurrency"]), f"{lv['output_tok_s']:.1f}", f"{lv['requests_s']:.2f}",
                     "/".join(_f(t[k]) for k in ("p50", "p90", "p99")),
                     "/".join(_f(p[k], ".1f") for k in ("p50", "p90", "p99")),
                     f"{_f(e['p50'] and e['p50'] / 1000, '.1f')}/{_f(e['p99'] and e['p99'] / 1000, '.1f')}",
                     f"{lv['mean_tokens']:.0f}", str(lv["errors"])])
    lines = align(rows)
    errors = [f"  first error at concurrency {lv['concurrency']}: {lv['first_error']}"
              for lv in figures["levels"] if lv["first_error"]]
    long = figures.get("long")
    if long:
        g, b = long["streams_gap_ms"], long["streams_gap_before_ms"]
        lines.append(f"long prompts ({', '.join(map(str, long['long_prompt_tokens']))} tokens) among "
                     f"{long['streams']} streams: their TPOT P50/P99 {_f(long['streams_tpot_ms']['p50'], '.1f')}/"
                     f"{_f(long['streams_tpot_ms']['p99'], '.1f')} ms; gaps P99/max {_f(g['p99'])}/{_f(g['max'])} ms"
                     f" (before: {_f(b['p99'])}/{_f(b['max'])} ms); long TTFT "
                     + ", ".join(_f(t) for t in long["long_ttft_ms"]) + " ms")
        if long["first_error"]:
            errors.append(f"  first error in the long-prompt run: {long['first_error']}")
    return lines + errors


def report(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"{s['model']} at {s['url']}: max_tokens {s['max_tokens']}, T=0, prompts: {s['prompts']}"]
    for name, figures in doc["servers"].items():
        lines += ([name] if len(doc["servers"]) > 1 else []) + table(figures)
    return "\n".join(lines)


def plot(servers: dict[str, dict], path: Path) -> None:
    """A PNG: TTFT and TPOT P50/P99 per level (left), aggregate tok/s per level (right), one
    colour per server. matplotlib's object API, written atomically."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="tight")
    left, right = fig.subplots(1, 2)
    for i, (name, figures) in enumerate(servers.items()):
        xs = [lv["concurrency"] for lv in figures["levels"]]
        for key, style in (("ttft_ms", "-"), ("tpot_ms", "--")):
            for q, marker in (("p50", "o"), ("p99", "^")):
                left.plot(xs, [lv[key][q] or 0 for lv in figures["levels"]], style, marker=marker, color=f"C{i}",
                          label=f"{name} {key[:4].upper()} {q.upper()}")
        right.plot(xs, [lv["output_tok_s"] for lv in figures["levels"]], "-o", color=f"C{i}", label=name)
    for ax, ylabel in ((left, "latency (ms)"), (right, "aggregate output tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    left.set_yscale("log")
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


register(Scenario("load", "a load test of an OpenAI-compatible server: TTFT/TPOT/latency percentiles and"
                  " tok/s per concurrency level (no goal: it measures one server)", add_args, measure, report))
