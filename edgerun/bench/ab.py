"""`edgerun bench`: the same prompts, seed and sampling on two configurations, A and B, compared
for speed and for output. Every number comes from the one decode loop (Runner.stream) folded
with ReplyStats; the statistics below are pure functions.

Runs are interleaved (prompt 1 on A, then on B, prompt 2 on A, ...; repeated R times) so machine
noise falls on both sides alike. Every run starts from an empty KV cache. Each configuration
gets one short warm-up reply first (not measured: it pages the weights in); the speculation
governor keeps what it measured across runs, as it does across the replies of a chat.

JSON schema (`--json`), version 1. Keys are stable; new keys may be added:

    schema          1
    partial         true when stopped early (Ctrl-C); only complete runs are counted
    settings        {prompts: [name], max_tokens, temperature, seed, repeat, n_batch: [int],
                     runs_planned, runs_done}
    configs         {"A"|"B": {model, path, draft, ngram, spec_k, runs,
                     ttft_s, tpot_s, decode_tok_s, prompt_tok_s   (mean over prompts of the
                                                                   per-prompt medians),
                     latency_s: {p50, p90, p99}   (per-token: differences of Step.t, pooled),
                     rss_bytes   (resident memory the config added: load + warm-up),
                     acceptance_rate, mean_accepted_len   (0 without speculation)}}
    per_prompt      {prompt: {sensitive, "A"|"B": {runs, prompt_tokens, generated_tokens,
                     ttft_s, tpot_s, decode_tok_s, prompt_tok_s   (medians over repeats)}}}
    ratios          {ttft_s|tpot_s|decode_tok_s|prompt_tok_s: {median, min, max}}: B / A per
                    repeat (each side's mean over the prompts both ran), spread over repeats
    agreement       {prompt: {rate, first_divergence (token index or null), sensitive,
                     tokens: [n_A, n_B]}}: first repeat's outputs, in A's vocabulary
    warnings        [text]: early divergence (before token 16) on a sensitive prompt at temp 0
    n_batch_ttft    {"128": {"A": {median, min, max}, "B": ...}}: TTFT of the longest prompt,
                    each n_batch in its own context
    peak_rss_bytes  the process's peak resident memory (both configurations together)
"""

from __future__ import annotations

import contextlib
import re
import statistics
import threading
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.bench.stats import agreement, first_divergence, gaps, percentile, ratio_spread, schedule, spread
from edgerun.errors import ConfigError
from edgerun.settings import EngineSettings, SamplerSettings

if TYPE_CHECKING:  # the decode loop loads llama.cpp: imported where it runs, so `--help` stays instant
    from edgerun.runner import Runner

SCHEMA = 1
PROMPTS_FILE = Path(__file__).parents[1] / "data" / "bench_prompts.toml"
SETS = ("code", "chat", "spec", "all")
METRICS = ("ttft_s", "tpot_s", "decode_tok_s", "prompt_tok_s")
EARLY = 16  # a divergence before this token on a numbers/code prompt changed the answer
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class BenchSettings:
    """Defaults of `edgerun bench` (the CLI reads them here)."""

    prompts: str = "all"
    max_tokens: int = 128
    temperature: float = 0.0  # greedy, so the two outputs can be compared token for token
    seed: int = 0
    repeat: int = 3
    draft: str = "none"  # a bench measures what it is told: no automatic draft


@dataclass(frozen=True)
class BenchConfig:
    label: str  # "A" or "B"
    model: str
    draft: str = "none"
    ngram: bool = False
    spec_k: int | None = None


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str
    sensitive: bool = False
    set: str = "file"


@dataclass
class Run:
    """One measured reply."""

    config: str
    prompt: str
    repeat: int
    metrics: dict[str, float]
    latencies: list[float]  # seconds between consecutive tokens
    tokens: list[int]  # in A's vocabulary, for the agreement


@dataclass
class BenchResult:
    configs: dict[str, dict]
    prompts: list[Prompt]
    settings: dict
    runs: list[Run] = field(default_factory=list)
    n_batch_ttft: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    partial: bool = False

    def as_json(self) -> dict:
        return summarize(self)


# -- prompts -----------------------------------------------------------------------------------


def load_prompts(choice: str) -> list[Prompt]:
    """A shipped set (code, chat, spec, all), shipped prompts by name (comma-separated, sets
    allowed among them), or a file: TOML shaped like the shipped one, otherwise plain text with
    one prompt per paragraph."""
    shipped = _from_toml(PROMPTS_FILE.read_text(), PROMPTS_FILE)
    names = [c.strip() for c in choice.split(",") if c.strip()]
    if names and all(n in SETS or any(p.name == n for p in shipped) for n in names):
        return [p for p in shipped if any(n in ("all", p.set, p.name) for n in names)]
    path = Path(choice)
    if not path.is_file():
        raise ConfigError(f"--prompts takes {', '.join(SETS)}, shipped prompt names (a,b) or a file;"
                          f" '{choice}' is none of these")
    text = path.read_text()
    prompts = _from_toml(text, path) if path.suffix == ".toml" else paragraphs(text)
    if not prompts:
        raise ConfigError(f"{path}: no prompts in it (one per paragraph, or [[prompt]] tables)")
    return prompts


def _from_toml(text: str, path: Path) -> list[Prompt]:
    try:
        tables = tomllib.loads(text).get("prompt", [])
        return [Prompt(t["name"], t["text"], bool(t.get("sensitive", looks_sensitive(t["text"]))),
                       t.get("set", "file")) for t in tables]
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a prompt file ({exc}); each [[prompt]] needs name and text") from exc


def paragraphs(text: str) -> list[Prompt]:
    blocks = [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
    return [Prompt(f"p{i}", b, looks_sensitive(b)) for i, b in enumerate(blocks, 1)]


def looks_sensitive(text: str) -> bool:
    """Numbers or code: prompts where one changed token changes the answer."""
    return bool(re.search(r"\d|```|\bdef |\bclass |\breturn\b|[{};]", text))


# -- measuring ---------------------------------------------------------------------------------


def run(configs: Sequence[BenchConfig], prompts: list[Prompt], engine: EngineSettings,
        sampling: SamplerSettings, *, max_tokens: int, repeat: int, n_batches: Sequence[int] = (),
        cancel: threading.Event | None = None, say: Callable[[str], None] = lambda line: None) -> BenchResult:
    """Load the configurations, run the schedule, then the n_batch TTFT sweep. When `cancel` is
    set the current run is dropped and the result so far comes back with partial=True."""
    from edgerun.decode.stats import peak_rss_bytes

    if repeat < 1 or max_tokens < 1 or not prompts:
        raise ConfigError("bench needs --repeat and -n of at least 1, and at least one prompt")
    cancel = cancel or threading.Event()
    settings = {"prompts": [p.name for p in prompts], "max_tokens": max_tokens,
                "temperature": sampling.temperature, "seed": sampling.seed, "repeat": repeat,
                "n_batch": list(n_batches), "runs_planned": repeat * len(prompts) * len(configs)}
    result = BenchResult({}, prompts, settings)
    with contextlib.ExitStack() as stack:
        runners = _load(configs, engine, sampling, prompts[0], stack, result, cancel)
        if not cancel.is_set():
            _measure(runners, prompts, sampling, max_tokens, repeat, result, cancel, say)
        if n_batches and not cancel.is_set():
            _sweep(runners, max(prompts, key=lambda p: len(p.text)), sampling, n_batches, repeat,
                   result, cancel, say)
    result.partial = cancel.is_set()
    result.settings["runs_done"] = len(result.runs)
    result.peak_rss_bytes = peak_rss_bytes()
    return result


def _load(configs, engine, sampling, warmup: Prompt, stack, result, cancel) -> dict[str, Runner]:
    """Open each configuration and warm it up; its RSS growth over both is its footprint."""
    import psutil

    from edgerun.runner import Runner

    runners = {}
    for cfg in configs:
        if cancel.is_set():
            break
        before = psutil.Process().memory_info().rss
        runner = stack.enter_context(Runner(cfg.model, engine, draft=cfg.draft, ngram=cfg.ngram, spec_k=cfg.spec_k))
        _reply(runner, _tokens(runner, warmup), sampling, WARMUP_TOKENS, cancel)
        runners[cfg.label] = runner
        result.configs[cfg.label] = {
            "model": runner.info.name, "path": str(runner.path), "draft": runner.draft_spec or "none",
            "ngram": cfg.ngram, "spec_k": "auto" if cfg.spec_k is None else cfg.spec_k,
            "rss_bytes": psutil.Process().memory_info().rss - before,
        }
    return runners


def _tokens(runner: Runner, prompt: Prompt) -> list[int]:
    return runner.chat_tokens([{"role": "user", "content": prompt.text}])


def _reply(runner: Runner, tokens: list[int], sampling, max_tokens: int, cancel):
    """One reply from an empty KV cache: (ReplyStats, token times, token ids, text)."""
    from edgerun.decode.generate import Step
    from edgerun.decode.stats import ReplyStats

    for ctx in (runner.ctx, runner.draft_ctx):
        if ctx is not None:
            ctx.trim(0)  # no prefix reuse from the previous run: every run prefills in full
    stats, times, ids, parts = ReplyStats(), [], [], []
    for record in runner.stream(tokens, sampling, max_tokens=max_tokens, cancel=cancel):
        stats.add(record)
        if isinstance(record, Step):
            parts.append(record.text)
            if record.finish != "stop":  # the end-of-generation token is not output
                times.append(record.t)
                ids.append(record.token)
    return stats, times, ids, "".join(parts)


def _measure(runners: dict[str, Runner], prompts, sampling, max_tokens, repeat, result, cancel, say) -> None:
    from edgerun.runtime import vocab

    first = next(iter(runners.values()))
    same_vocab = all(r is first or vocab.mismatch(first.model, r.model) is None for r in runners.values())
    tokens = {(label, i): _tokens(r, p) for label, r in runners.items() for i, p in enumerate(prompts)}
    plan = schedule(len(prompts), list(runners), repeat)
    for n, (rep, i, label) in enumerate(plan, 1):
        stats, times, ids, text = _reply(runners[label], tokens[label, i], sampling, max_tokens, cancel)
        if stats.finish == "cancelled" or cancel.is_set():
            return
        # different vocabularies: compare both outputs as A's tokenizer reads their text
        comparable = ids if same_vocab else first.model.tokenize(text, add_special=False, parse_special=False)
        result.runs.append(Run(label, prompts[i].name, rep, _metrics(stats), gaps(times), comparable))
        say(f"[{n}/{len(plan)}] {label} {prompts[i].name} #{rep + 1}: {stats.generated_tokens} tok,"
            f" {stats.decode_tok_s:.1f} tok/s, TTFT {stats.ttft_s * 1000:.0f} ms")


def _metrics(stats) -> dict[str, float]:
    return {"ttft_s": stats.ttft_s, "tpot_s": stats.tpot_s, "decode_tok_s": stats.decode_tok_s,
            "prompt_tok_s": stats.prompt_tok_s, "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens, "drafted": stats.drafted,
            "accepted": stats.accepted, "draft_rounds": sum(stats.accepted_hist.values()), "rounds": stats.rounds,
            # decode wall time and the part of it inside the native round: the rest is host time
            "decode_s": stats.last_t - stats.ttft_s, "in_round_s": stats.draft_s + stats.verify_s}


def _sweep(runners: dict[str, Runner], prompt: Prompt, sampling, n_batches, repeat, result, cancel, say) -> None:
    """TTFT of the longest prompt for each n_batch, each value in a context of its own."""
    from edgerun.runtime.engine import Context

    tokens = {label: _tokens(r, prompt) for label, r in runners.items()}
    for nb in n_batches:
        times = result.n_batch_ttft[nb] = {label: [] for label in runners}
        with contextlib.ExitStack() as stack:
            contexts = {label: stack.enter_context(Context(r.model, r.settings.replace(n_batch=nb)))
                        for label, r in runners.items()}
            for rep in range(repeat):
                for label, ctx in contexts.items():
                    if cancel.is_set():
                        return
                    times[label].append(_ttft(ctx, tokens[label], sampling))
                    say(f"n_batch {nb} {label} {prompt.name} #{rep + 1}: TTFT {times[label][-1] * 1000:.0f} ms")


def _ttft(ctx, tokens: list[int], sampling) -> float:
    from edgerun.decode.generate import Step, generate

    ctx.trim(0)
    for record in generate(ctx, tokens, sampling, max_tokens=1):
        if isinstance(record, Step):
            return record.t
    return 0.0


# -- summary -----------------------------------------------------------------------------------


def summarize(result: BenchResult) -> dict:
    """The JSON document (schema in the module docstring)."""
    labels = list(result.configs)
    per_prompt = {p.name: _prompt_summary(result, p, labels) for p in result.prompts}
    agree = _agreement(result, labels)
    return {
        "schema": SCHEMA,
        "partial": result.partial,
        "settings": result.settings,
        "configs": {label: _config_summary(result, label, per_prompt) for label in labels},
        "per_prompt": per_prompt,
        "ratios": _ratios(result, labels),
        "agreement": agree,
        "warnings": _warnings(agree, labels, result.settings["temperature"]),
        "n_batch_ttft": {str(nb): {label: spread(v) for label, v in t.items()}
                         for nb, t in result.n_batch_ttft.items()},
        "peak_rss_bytes": result.peak_rss_bytes,
    }


def _runs(result: BenchResult, label: str, prompt: str | None = None) -> list[Run]:
    return [r for r in result.runs if r.config == label and prompt in (None, r.prompt)]


def _prompt_summary(result: BenchResult, prompt: Prompt, labels) -> dict:
    out: dict = {"sensitive": prompt.sensitive}
    keys = (*METRICS, "prompt_tokens", "generated_tokens")
    for label in labels:
        runs = _runs(result, label, prompt.name)
        out[label] = {"runs": len(runs)} | {k: statistics.median(r.metrics[k] for r in runs) if runs else None
                                            for k in keys}
    return out


def _config_summary(result: BenchResult, label: str, per_prompt: dict) -> dict:
    runs = _runs(result, label)
    lat = [x for r in runs for x in r.latencies]
    total = {k: sum(r.metrics[k] for r in runs) for k in ("drafted", "accepted", "draft_rounds")}
    means = {k: _mean_over_prompts(per_prompt, label, k) for k in METRICS}
    return result.configs[label] | {"runs": len(runs)} | means | {
        "latency_s": {f"p{q}": percentile(lat, q) for q in (50, 90, 99)},
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "mean_accepted_len": total["accepted"] / total["draft_rounds"] if total["draft_rounds"] else 0.0,
    }


def _mean_over_prompts(per_prompt: dict, label: str, key: str) -> float | None:
    values = [p[label][key] for p in per_prompt.values() if p[label]["runs"]]
    return statistics.fmean(values) if values else None


def _ratios(result: BenchResult, labels) -> dict:
    """Per repeat, each side's mean over the prompts both ran; then B / A over repeats."""
    if len(labels) < 2:
        return {}
    a, b = labels[0], labels[1]
    paired: dict[str, tuple[list, list]] = {k: ([], []) for k in METRICS}
    for rep in range(result.settings["repeat"]):
        runs = {(r.config, r.prompt): r for r in result.runs if r.repeat == rep}
        both = [p.name for p in result.prompts if (a, p.name) in runs and (b, p.name) in runs]
        if not both:
            continue
        for k in METRICS:
            paired[k][0].append(statistics.fmean(runs[a, p].metrics[k] for p in both))
            paired[k][1].append(statistics.fmean(runs[b, p].metrics[k] for p in both))
    return {k: ratio_spread(*paired[k]) for k in METRICS}


def _agreement(result: BenchResult, labels) -> dict:
    """B against A on the first repeat where both ran the prompt."""
    if len(labels) < 2:
        return {}
    out = {}
    for p in result.prompts:
        b_runs = {r.repeat: r for r in _runs(result, labels[1], p.name)}
        pairs = [(ra.tokens, b_runs[ra.repeat].tokens)
                 for ra in _runs(result, labels[0], p.name) if ra.repeat in b_runs]
        if pairs:
            a, b = pairs[0]
            out[p.name] = {"rate": agreement(a, b), "first_divergence": first_divergence(a, b),
                           "sensitive": p.sensitive, "tokens": [len(a), len(b)]}
    return out


def _warnings(agree: dict, labels, temperature: float) -> list[str]:
    if temperature > 0:
        return []
    return [f"{labels[1]} diverges from {labels[0]} at token {a['first_divergence']} on {name}"
            f" (numbers/code): at temperature 0 the answer changed"
            for name, a in agree.items()
            if a["sensitive"] and a["first_divergence"] is not None and a["first_divergence"] < EARLY]


def describe(config: dict) -> str:
    """A configuration in words: model, then draft and n-gram drafting where used."""
    extras = [f"draft {config['draft']}"] if config["draft"] != "none" else []
    extras += ["ngram"] if config["ngram"] else []
    return config["model"] + (f" ({', '.join(extras)})" if extras else "")
