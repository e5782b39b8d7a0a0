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


def _run_args(p: argparse.ArgumentParser, *, tokens: int, repeat: int, what: str) -> None:
    """The reply and machine settings both speculation scenarios take."""
    p.add_argument("-n", "--max-tokens", type=count, default=tokens, help=f"tokens per reply (default {tokens})")
    p.add_argument("--repeat", type=count, default=repeat, help=f"{what} (default {repeat})")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--ctx", type=count, default=4096, help="context size (default 4096)")
    p.add_argument("--threads", type=count, default=None, help="CPU threads (default: EDGERUN_THREADS, else physical cores)")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="the target (default qwen2.5-coder-1.5b)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model (default qwen2.5-coder-0.5b)")
    p.add_argument("--prompts", default="spec", help="shipped set, prompt names or a file (default spec:"
                   " codegen and code-edit)")
    p.add_argument("--temps", type=_floats, default=[0.0, 0.7], metavar="T[,T...]", help="temperatures (default 0,0.7)")
    _run_args(p, tokens=128, repeat=3, what="runs per prompt, temperature and side")
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
        rows.append([r["prompt"], f"{r['temperature']:g}", r["drafter"], _num(r["plain_tok_s"]), _num(r["spec_tok_s"]),
                     _spread(r["ratio"]), f"{r['acceptance']:.2f}", _num(r["host_overhead"], 100, "%"), f"{r['agreement']:.2f}"])
    s = doc["settings"]
    head = (f"target {s['model']}, draft {s['draft']}; {s['max_tokens']} tokens, {s['repeat']} repeats, seed {s['seed']};"
            " ratio = drafter / plain in the same repeat")
    return "\n".join([head, "", *align(rows)])


def _spread(r: dict | None) -> str:
    return f"{r['median']:.3f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-"


def _num(value, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.2f}{suffix}"


register(Scenario("spec", "plain vs model draft vs n-gram drafting (goals: worst >= 0.97, code edit n-gram"
                  " >= 1.5, host overhead < 2%)", add_args, measure, report))


# -- `edgerun bench ngram`: long n-gram drafts vs plain and vs llama-cpp-python's prompt lookup ----

NGRAM_TEMPS = (0.0, 0.7)
PLD_DEFAULT = 10  # LlamaPromptLookupDecoding's own default num_pred_tokens
CODEGEN_PROMPT = "codegen"
# a two-turn chat: the model writes code, then is asked to change it (its reply repeats turn 1's)
CHAT_TURN_1 = ("Write a Python function `parse_duration(text)` that turns strings like '1h30m', '45s' or"
               " '2h5m10s' into a number of seconds, raising ValueError on bad input, with a docstring."
               " Only the code.")
CHAT_TURN_2 = ("Rename the function to `duration_seconds`, add type hints, and return the complete code"
               " again.")
# a fresh conversation asking for much what an earlier one (CHAT_TURN_1's) got: what a pool of
# earlier conversations could draft from
RECALL = ("Write a Python function `duration_seconds(text: str) -> int` that parses durations such as"
          " '1h30m', '45s' or '2h5m10s' into seconds, raising ValueError for malformed input, with type"
          " hints and a docstring. Only the code.")
CASES = ("edit", "chat", "codegen", "recall")


def ngram_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="the target (default qwen2.5-coder-1.5b)")
    p.add_argument("--temps", type=_floats, default=list(NGRAM_TEMPS), metavar="T[,T...]",
                   help="temperatures (default 0,0.7)")
    p.add_argument("--pld", default=f"{PLD_DEFAULT}", metavar="N[,N...]",
                   help="llama-cpp-python prompt lookup num_pred_tokens settings to run (default 10; the"
                        " best median is 'its best setting')")
    _run_args(p, tokens=256, repeat=5, what="interleaved runs per case and side")
    p.add_argument("--cases", default="edit,chat,codegen", help="which cases: edit, chat, codegen, recall"
                   " (default edit,chat,codegen; recall: a fresh conversation asking what an earlier one got)")
    p.add_argument("--pool", action="store_true", help="also run n-gram with a pool of an earlier conversation"
                   " (CHAT_TURN_1 answered at T=0) on the codegen and recall cases")
    p.add_argument("--gpu-layers", default="0", help="the model's layers on the GPU: auto, 0 (default: the CPU) or"
                   " a count; prompt lookup gets the count edgerun's placement gave")


def ngram_measure(args: argparse.Namespace, say) -> dict:
    from edgerun.bench.external import PromptLookup
    from edgerun.runner import Runner
    from edgerun.settings import EngineSettings, default_threads

    pld = sorted({int(v) for v in args.pld.split(",") if v.strip().isdigit() and int(v) > 0})
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not pld or not set(cases) <= set(CASES):
        raise argparse.ArgumentTypeError(f"--pld takes counts (10,16) and --cases {', '.join(CASES)}")
    threads = args.threads or default_threads()
    engine = EngineSettings().replace(n_ctx=args.ctx, n_threads=threads, gpu_layers=args.gpu_layers)
    prompts = {p.name: p.text for p in load_prompts("spec")}
    runs: list[dict] = []
    with Runner(args.model, engine) as plain, Runner(args.model, engine, ngram=True) as ngram:
        loaded = {name: ngram.governors.get(name) for name in ("ngram",)}  # what `edgerun run` starts from
        on_gpu = plain.model.n_gpu_layers  # what the placement made of --gpu-layers
        lookup = (PromptLookup(plain.path, n_ctx=args.ctx, threads=threads, gpu_layers=on_gpu)
                  if "edit" in cases else None)
        pool = _earlier_conversation(plain, args.max_tokens) if args.pool else None
        try:
            for rep in range(args.repeat):
                for temp in args.temps:
                    seed = args.seed + rep
                    for case in cases:
                        sides = {"plain": lambda: _edgerun_case(plain, case, prompts, temp, seed, args.max_tokens),
                                 "ngram": lambda: _edgerun_case(ngram, case, prompts, temp, seed, args.max_tokens,
                                                                fresh=loaded)}
                        if pool is not None and case in ("codegen", "recall"):
                            sides["pool"] = lambda: _edgerun_case(ngram, case, prompts, temp, seed, args.max_tokens,
                                                                  fresh=loaded, pool=pool)
                        if case == "edit":
                            tokens = plain.chat_tokens([{"role": "user", "content": prompts[EDIT_PROMPT]}])
                            for n in pld:
                                sides[f"pld{n}"] = (lambda n=n: lookup.reply(tokens, num_pred=n, temperature=temp,
                                                                             seed=seed, max_tokens=args.max_tokens))
                        names = list(sides) if rep % 2 == 0 else list(sides)[::-1]  # ABBA turns
                        got = {name: sides[name]() for name in names}
                        for name, r in got.items():
                            runs.append({"case": case, "temperature": temp, "repeat": rep, "side": name,
                                         **{k: v for k, v in r.items() if k != "tokens"}, "n": len(r["tokens"])})
                        say(f"[{rep + 1}/{args.repeat}] {case} T={temp:g} "
                            + ", ".join(f"{n} {got[n]['decode_tok_s']:.1f}" for n in sides) + " tok/s")
        finally:
            if lookup:
                lookup.close()
    settings = {"model": args.model, "temps": args.temps, "pld": pld, "cases": cases, "max_tokens": args.max_tokens,
                "repeat": args.repeat, "seed": args.seed, "ctx": args.ctx, "threads": threads,
                "gpu_layers": on_gpu, "chat": [CHAT_TURN_1, CHAT_TURN_2], "recall": RECALL,
                "pool_tokens": len(pool) if pool else 0}
    rows = _ngram_rows(runs, pld)
    return {"settings": settings, "runs": runs, "rows": rows, "claims": _ngram_claims(rows)}


def _earlier_conversation(runner, max_tokens: int):
    """A pool holding one earlier conversation (CHAT_TURN_1 and its T=0 reply), as the chat app
    would keep both roles of it."""
    from edgerun.decode.ngram import NgramPool
    from edgerun.settings import SamplerSettings

    tokens = runner.chat_tokens([{"role": "user", "content": CHAT_TURN_1}])
    pool = NgramPool()
    pool.add(tokens + _reply(runner, tokens, SamplerSettings().replace(temperature=0.0), max_tokens)["tokens"])
    return pool


def _edgerun_case(runner, case: str, prompts: dict, temp: float, seed: int, max_tokens: int,
                  fresh: dict | None = None, pool=None) -> dict:
    """One measured reply on an edgerun runner. `fresh`: the governor state the runner had at load,
    restored first, so each run starts as `edgerun run` (or a new chat) does. The chat case answers
    turn 1 first (unmeasured) and measures the reply to turn 2. `pool`: the n-gram pool to draft
    from too (none otherwise)."""
    from edgerun.decode.governor import GovernorMemory
    from edgerun.settings import SamplerSettings

    if fresh is not None:
        runner.governors = GovernorMemory(fresh)
    runner.ngram_pool = pool
    sampling = SamplerSettings().replace(temperature=temp, seed=seed)
    if case == "chat":
        first = [{"role": "user", "content": CHAT_TURN_1}]
        answer = _reply(runner, runner.chat_tokens(first), sampling, max_tokens)
        messages = first + [{"role": "assistant", "content": answer["text"]}, {"role": "user", "content": CHAT_TURN_2}]
    elif case == "recall":
        messages = [{"role": "user", "content": RECALL}]
    else:
        messages = [{"role": "user", "content": prompts[EDIT_PROMPT if case == "edit" else CODEGEN_PROMPT]}]
    return _reply(runner, runner.chat_tokens(messages), sampling, max_tokens)


def _reply(runner, tokens: list[int], sampling, max_tokens: int) -> dict:
    from edgerun.decode.generate import Step
    from edgerun.decode.stats import ReplyStats

    stats, out, text = ReplyStats(), [], []
    for record in runner.stream(tokens, sampling, max_tokens=max_tokens):
        stats.add(record)
        if isinstance(record, Step) and record.finish != "stop":
            out.append(record.token)
            text.append(record.text)
    return {"tokens": out, "text": "".join(text), "decode_tok_s": stats.decode_tok_s,
            "acceptance": stats.acceptance_rate, "rounds": stats.rounds, "drafted": stats.drafted,
            "accepted": stats.accepted}


def _ngram_rows(runs: list[dict], pld: list[int]) -> list[dict]:
    """Per case and temperature: each side's median tok/s, and n-gram's paired ratios against
    plain and against each prompt lookup setting (the best one by its median, too)."""
    rows = []
    for case, temp in dict.fromkeys((r["case"], r["temperature"]) for r in runs):
        mine = [r for r in runs if r["case"] == case and r["temperature"] == temp]
        by = {}
        for r in mine:
            by.setdefault(r["side"], {})[r["repeat"]] = r["decode_tok_s"]
        reps = sorted(by["ngram"])
        tok_s = {side: statistics.median(v.values()) for side, v in by.items()}
        against = {side: ratio_spread([by[side][i] for i in reps], [by["ngram"][i] for i in reps])
                   for side in by if side != "ngram"}
        lookups = [f"pld{n}" for n in pld if f"pld{n}" in by]
        best = max(lookups, key=lambda s: tok_s[s]) if lookups else None
        ngram_runs = [r for r in mine if r["side"] == "ngram"]
        drafted = sum(r["drafted"] for r in ngram_runs)
        rows.append({"case": case, "temperature": temp, "tok_s": tok_s, "ratios": against, "best_pld": best,
                     "acceptance": sum(r["accepted"] for r in ngram_runs) / drafted if drafted else 0.0,
                     "tokens": statistics.median(r["n"] for r in ngram_runs),
                     "pool_gain": ratio_spread([by["ngram"][i] for i in reps], [by["pool"][i] for i in reps])
                     if "pool" in by else None})
    return rows


def _ngram_claims(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        at = f"{r['case']} T={r['temperature']:g}"
        if r["case"] == "edit":
            for side in dict.fromkeys([f"pld{PLD_DEFAULT}", r["best_pld"]]):
                if side in r["ratios"]:
                    out.append(claim(f"{at}: n-gram / prompt lookup ({side}) median", r["ratios"][side], ">= 1.3"))
                    out.append(claim(f"{at}: n-gram / prompt lookup ({side}) worst run", r["ratios"][side]["min"],
                                     ">= 1.0"))
        elif r["case"] == "chat":
            out.append(claim(f"{at}: second reply, n-gram / plain", r["ratios"]["plain"], ">= 1.5"))
        elif r["case"] == "codegen":
            out.append(claim(f"{at}: n-gram / plain worst run", r["ratios"]["plain"]["min"], ">= 0.97"))
        if r.get("pool_gain"):  # the pool pays where it helps recall and costs nothing elsewhere
            goal = ">= 1.1" if r["case"] == "recall" else ">= 0.97"
            out.append(claim(f"{at}: n-gram with the pool / without, median", r["pool_gain"], goal))
    return out


def ngram_report(doc: dict) -> str:
    from edgerun.bench.table import align

    s = doc["settings"]
    sides = ["plain", "ngram"] + [f"pld{n}" for n in s["pld"]] + (["pool"] if s.get("pool_tokens") else [])
    table = [["case", "T", *[f"{x} tok/s" for x in sides], "n-gram / plain", "n-gram / best pld", "acceptance"]
             + (["pool / n-gram"] if s.get("pool_tokens") else [])]
    for r in doc["rows"]:
        table.append([r["case"], f"{r['temperature']:g}", *[_num(r["tok_s"].get(x)) for x in sides],
                      _spread(r["ratios"].get("plain")), _spread(r["ratios"].get(r["best_pld"])),
                      f"{r['acceptance']:.2f}"]
                     + ([_spread(r.get("pool_gain"))] if s.get("pool_tokens") else []))
    where = f", {s['gpu_layers']} layers on the GPU" if s.get("gpu_layers") else ""
    head = (f"{s['model']}, {s['threads']} threads{where}, up to {s['max_tokens']} tokens, {s['repeat']} interleaved runs;"
            " ratios are medians (min-max) of paired runs")
    return "\n".join([head, "", *align(table)])


register(Scenario("ngram", "n-gram drafting vs plain and vs llama-cpp-python's prompt lookup: code edit, a"
                  " two-turn edit of the model's own code, codegen (goals: >= 1.3x prompt lookup, >= 1.5x"
                  " plain, >= 0.97x plain)", ngram_args, ngram_measure, ngram_report))
