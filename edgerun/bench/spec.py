"""`edgerun bench spec`: plain decoding vs a model draft vs the n-gram drafter, in one run.

Three runners of the same target (plain, with the draft model, with n-gram drafting) go through
the A/B harness (ab.run: interleaved runs, each from an empty KV cache, the governor as a user
gets it, costs timed at load), once per temperature. For every prompt and drafter the ratio is
drafter tok/s over the plain run of the same repeat. Host overhead is the share of decode wall
time spent outside the native round (Python's bookkeeping, the governor, the stream).

Claims: no drafter loses more than 3% where it does not pay (worst ratio >= 0.97); the n-gram
drafter pays on a code edit (>= 1.5x); host overhead stays under 2%.
"""

from __future__ import annotations

import argparse
import statistics

from edgerun.bench.ab import BenchConfig, load_prompts
from edgerun.bench.ab import run as run_ab
from edgerun.bench.scenario import Scenario, claim, count, register
from edgerun.bench.stats import agreement, ratio_spread

DRAFTERS = ("draft", "ngram")
EDIT_PROMPT = "code-edit"


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected temperatures of 0 or more separated by commas, not '{text}'")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="the target (default qwen2.5-coder-1.5b)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model (default qwen2.5-coder-0.5b)")
    p.add_argument("--prompts", default="spec", help="shipped set, prompt names or a file (default spec:"
                   " codegen and code-edit)")
    p.add_argument("--temps", type=_floats, default=[0.0, 0.7], metavar="T[,T...]", help="temperatures (default 0,0.7)")
    p.add_argument("-n", "--max-tokens", type=count, default=128, help="tokens per reply (default 128)")
    p.add_argument("--repeat", type=count, default=3, help="runs per prompt, temperature and side (default 3)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--ctx", type=count, default=4096, help="context size (default 4096)")
    p.add_argument("--threads", type=count, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--gpu-layers", default="auto", help="target's layers on the GPU: auto, 0 or a count")


def measure(args: argparse.Namespace, say) -> dict:
    from edgerun.settings import EngineSettings, SamplerSettings

    prompts = load_prompts(args.prompts)
    engine = EngineSettings().replace(n_ctx=args.ctx, n_threads=args.threads, gpu_layers=args.gpu_layers)
    configs = [BenchConfig("plain", args.model), BenchConfig("draft", args.model, draft=args.draft),
               BenchConfig("ngram", args.model, ngram=True)]
    rows, sides = [], {}
    for temp in args.temps:
        say(f"temperature {temp}")
        sampling = SamplerSettings().replace(temperature=temp, seed=args.seed)
        result = run_ab(configs, prompts, engine, sampling, max_tokens=args.max_tokens, repeat=args.repeat, say=say)
        if result.partial:
            raise KeyboardInterrupt
        sides = result.configs
        rows += [_row(result, p.name, temp, label) for p in prompts for label in DRAFTERS]
    settings = {"model": args.model, "draft": args.draft, "prompts": [p.name for p in prompts], "temps": args.temps,
                "max_tokens": args.max_tokens, "repeat": args.repeat, "seed": args.seed, "ctx": args.ctx,
                "threads": args.threads, "gpu_layers": args.gpu_layers}
    return {"settings": settings, "sides": sides, "rows": rows, "claims": _claims(rows)}


def _row(result, prompt: str, temp: float, label: str) -> dict:
    """One drafter on one prompt at one temperature, against plain decoding of the same repeats."""
    runs = {(r.config, r.repeat): r for r in result.runs if r.prompt == prompt}
    reps = sorted(rep for (cfg, rep) in runs if cfg == label and ("plain", rep) in runs)
    plain = [runs["plain", rep].metrics for rep in reps]
    spec = [runs[label, rep].metrics for rep in reps]
    drafted, accepted = sum(m["drafted"] for m in spec), sum(m["accepted"] for m in spec)
    first = (runs["plain", reps[0]].tokens, runs[label, reps[0]].tokens) if reps else ([], [])
    return {"prompt": prompt, "temperature": temp, "drafter": label,
            "plain_tok_s": statistics.median(m["decode_tok_s"] for m in plain) if reps else None,
            "spec_tok_s": statistics.median(m["decode_tok_s"] for m in spec) if reps else None,
            "ratio": ratio_spread([m["decode_tok_s"] for m in plain], [m["decode_tok_s"] for m in spec]),
            "acceptance": accepted / drafted if drafted else 0.0,
            "host_overhead": max((host_share(m) for m in plain + spec), default=None),
            "agreement": agreement(*first)}


def host_share(metrics: dict) -> float:
    """The share of decode wall time outside the native round (0 for a reply of one token)."""
    decode = metrics["decode_s"]
    return max(0.0, decode - metrics["in_round_s"]) / decode if decode > 0 else 0.0


def _claims(rows: list[dict]) -> list[dict]:
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    worst = min(ratios, key=lambda r: r["median"]) if ratios else None
    edit = [r["ratio"] for r in rows if r["prompt"] == EDIT_PROMPT and r["drafter"] == "ngram" and r["ratio"]]
    overhead = [r["host_overhead"] for r in rows if r["host_overhead"] is not None]
    out = [claim("worst drafter / plain decode tok/s", worst, ">= 0.97")]
    if edit:
        out.append(claim(f"{EDIT_PROMPT}: n-gram / plain decode tok/s (worst temperature)",
                         min(edit, key=lambda r: r["median"]), ">= 1.5"))
    out.append(claim("host overhead, share of decode time (worst reply)", max(overhead) if overhead else None, "< 0.02"))
    return out


def report(doc: dict) -> str:
    from edgerun.bench.table import align

    rows = [["prompt", "T", "drafter", "plain tok/s", "spec tok/s", "ratio (min-max)", "acceptance",
             "host overhead", "agreement"]]
    for r in doc["rows"]:
        ratio = r["ratio"]
        rows.append([r["prompt"], f"{r['temperature']:g}", r["drafter"], _num(r["plain_tok_s"]), _num(r["spec_tok_s"]),
                     f"{ratio['median']:.3f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "-",
                     f"{r['acceptance']:.2f}", _num(r["host_overhead"], 100, "%"), f"{r['agreement']:.2f}"])
    s = doc["settings"]
    head = (f"target {s['model']}, draft {s['draft']}; {s['max_tokens']} tokens, {s['repeat']} repeats, seed {s['seed']};"
            " ratio = drafter / plain in the same repeat")
    return "\n".join([head, "", *align(rows)])


def _num(value, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.2f}{suffix}"


register(Scenario("spec", "plain vs model draft vs n-gram drafting (goals: worst >= 0.97, code edit n-gram"
                  " >= 1.5, host overhead < 2%)", add_args, measure, report))
