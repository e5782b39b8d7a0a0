"""`edgerun bench round-host`: what the host adds around the native round.

The decode loop spends its wall time in two places: inside the native round (drafting, the
batched verify, acceptance; timed by the round itself as draft_s and verify_s) and on the host
(Python's bookkeeping of the round's result, the governor's choice, the stream of Step records).
The smallest model has the shortest rounds, so it shows the host's share at its largest. Plain
decoding (rounds of k = 0) and n-gram drafting (a governed round every few tokens) run through
the A/B harness (ab.run), interleaved.

Claim: the host's share of decode time stays under 2% on every reply.
"""

from __future__ import annotations

import argparse
import statistics

from edgerun.bench.ab import BenchConfig, load_prompts
from edgerun.bench.ab import run as run_ab
from edgerun.bench.scenario import Scenario, claim, count, register
from edgerun.bench.spec import host_share
from edgerun.bench.table import align

SIDES = ("plain", "ngram")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="gemma-3-270m", help="the model (default gemma-3-270m: the shortest rounds)")
    p.add_argument("--prompts", default="spec", help="shipped set, prompt names or a file (default spec)")
    p.add_argument("-n", "--max-tokens", type=count, default=128, help="tokens per reply (default 128)")
    p.add_argument("--repeat", type=count, default=3, help="runs per prompt and side (default 3)")
    p.add_argument("--threads", type=count, default=None, help="CPU threads (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--gpu-layers", default="0", help="layers on the GPU (default 0: the host's share on a CPU)")


def measure(args: argparse.Namespace, say) -> dict:
    from edgerun.settings import EngineSettings, SamplerSettings

    prompts = load_prompts(args.prompts)
    engine = EngineSettings().replace(n_ctx=4096, n_threads=args.threads, gpu_layers=args.gpu_layers)
    sampling = SamplerSettings().replace(temperature=0.0, seed=0)
    configs = [BenchConfig("plain", args.model), BenchConfig("ngram", args.model, ngram=True)]
    result = run_ab(configs, prompts, engine, sampling, max_tokens=args.max_tokens, repeat=args.repeat, say=say)
    if result.partial:
        raise KeyboardInterrupt
    rows = []
    for p in prompts:
        for side in SIDES:
            runs = [r.metrics for r in result.runs if r.prompt == p.name and r.config == side]
            shares = [host_share(m) for m in runs]
            per_token = [(m["decode_s"] - m["in_round_s"]) / max(m["generated_tokens"] - 1, 1) for m in runs]
            # native calls a token after the first (picked from the prompt's logits): a plain
            # stretch or a round of drafts makes several tokens in one
            calls = [m["rounds"] / max(m["generated_tokens"] - 1, 1) for m in runs]
            rows.append({"prompt": p.name, "side": side, "decode_tok_s": statistics.median(m["decode_tok_s"] for m in runs),
                         "host_share": {"median": statistics.median(shares), "max": max(shares)},
                         "host_us_per_token": statistics.median(per_token) * 1e6,
                         "calls_per_token": statistics.median(calls)})
    worst = max(r["host_share"]["max"] for r in rows)
    settings = {"model": args.model, "prompts": [p.name for p in prompts], "max_tokens": args.max_tokens,
                "repeat": args.repeat, "threads": args.threads, "gpu_layers": args.gpu_layers, "temperature": 0.0}
    return {"settings": settings, "sides": result.configs, "rows": rows,
            "claims": [claim("host share of decode time (worst reply)", worst, "< 0.02")]}


def report(doc: dict) -> str:
    rows = [["prompt", "side", "decode tok/s", "host share (median)", "host share (max)", "host us/token",
             "calls/token"]]
    for r in doc["rows"]:
        calls = r.get("calls_per_token")  # not in files written before it was measured
        rows.append([r["prompt"], r["side"], f"{r['decode_tok_s']:.1f}", f"{r['host_share']['median']:.2%}",
                     f"{r['host_share']['max']:.2%}", f"{r['host_us_per_token']:.0f}",
                     "-" if calls is None else f"{calls:.2f}"])
    s = doc["settings"]
    return "\n".join([f"{s['model']}, {s['max_tokens']} tokens, {s['repeat']} repeats, greedy", "", *align(rows)])


register(Scenario("round-host", "host time around the native round, share of decode time (goal < 2%)",
                  add_args, measure, report))
