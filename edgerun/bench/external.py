"""`edgerun bench llama-cpp-python`: decode tok/s of `edgerun run` vs llama-cpp-python's `Llama`.

An external side: the same model file, threads, raw prompt (no template), greedy, same token
count, on the same llama.cpp build (llama-cpp-python's, which edgerun links). Each side runs in
a fresh process of its own, so neither inherits the other's page cache warm-up order or OpenMP
thread team; the sides take ABBA turns. Decode tok/s for both is (tokens - 1) / (time of the
last token - time of the first), as ReplyStats computes it.

Claim: edgerun's own loop costs nothing measurable over the library's (ratio >= 0.98).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from edgerun.bench.scenario import Scenario, claim, count, interleave, register, side_lines
from edgerun.bench.stats import ratio_spread, spread
from edgerun.errors import EdgerunError

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"
N_CTX = 2048

LLAMA_SIDE = r"""
import json, sys, time
from llama_cpp import Llama
path, n, threads, n_ctx, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = Llama(path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
            verbose=False)
times = []
for _ in llm.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1, stream=True):
    times.append(time.perf_counter())
print(json.dumps({"tokens": len(times), "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}))
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="catalog name or .gguf (default qwen2.5-coder-1.5b)")
    p.add_argument("-n", "--max-tokens", type=count, default=128, help="tokens per reply (default 128)")
    p.add_argument("--repeat", type=count, default=3, help="turns per side (default 3)")
    p.add_argument("--threads", type=count, default=None,
                   help="CPU threads, both sides (default: EDGERUN_THREADS, else physical cores)")


def _edgerun_side(model: Path, n: int, threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stats.json"
        _child([sys.executable, "-m", "edgerun.cli", "run", PROMPT, "--raw", "-m", str(model), "-n", str(n),
                "--temp", "0", "--threads", str(threads), "--gpu-layers", "0", "--ctx", str(N_CTX),
                "--stats-json", str(out)], "edgerun run")
        return json.loads(out.read_text())["decode_tok_s"]


def _llama_side(model: Path, n: int, threads: int) -> float:
    out = _child([sys.executable, "-c", LLAMA_SIDE, str(model), str(n), str(threads), str(N_CTX), PROMPT],
                 "llama-cpp-python's Llama")
    return json.loads(out.strip().splitlines()[-1])["decode_tok_s"]


def _child(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgerunError(f"{what} failed (exit {proc.returncode}): {last}")
    return proc.stdout


def measure(args: argparse.Namespace, say) -> dict:
    from edgerun.models.fetch import resolve
    from edgerun.settings import default_threads

    model, threads = resolve(args.model), args.threads or default_threads()
    values = interleave({"edgerun": lambda: _edgerun_side(model, args.max_tokens, threads),
                         "llama-cpp-python": lambda: _llama_side(model, args.max_tokens, threads)},
                        args.repeat, say)
    ours, theirs = values["edgerun"], values["llama-cpp-python"]
    settings = {"model": args.model, "path": str(model), "max_tokens": args.max_tokens, "repeat": args.repeat,
                "threads": threads, "prompt": PROMPT, "ctx": N_CTX}
    return {"settings": settings, "decode_tok_s": values,
            "sides": {name: spread(v) for name, v in values.items()},
            "claims": [claim("edgerun / llama-cpp-python decode tok/s", ratio_spread(theirs, ours), ">= 0.98")]}


def report(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"{s['model']}, {s['max_tokens']} tokens, {s['threads']} threads, raw prompt, greedy, {s['repeat']} turns each"]
    return "\n".join(lines + side_lines(doc["sides"]))


register(Scenario("llama-cpp-python", "edgerun run vs llama-cpp-python's Llama, decode tok/s (goal >= 0.98)",
                  add_args, measure, report))


# -- llama-cpp-python's prompt lookup decoding, in process (the `ngram` scenario's external side) --


class PromptLookup:
    """llama-cpp-python's own n-gram speculation (`Llama` with `LlamaPromptLookupDecoding`) on the
    same model file, threads and context as edgerun's side, fed the same prompt tokens. Its
    `num_pred_tokens` is set per reply; the draft model sees the whole prompt and reply. logits_all
    is passed too: a draft model turns it on, but the score buffer is sized from the argument
    (n_batch rows), and a prompt and reply past 512 tokens would overrun it."""

    def __init__(self, path: Path, *, n_ctx: int, threads: int, gpu_layers: int = 0):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
        self.llm = Llama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                         n_gpu_layers=gpu_layers, draft_model=self.draft, logits_all=True, verbose=False)

    def reply(self, tokens: list[int], *, num_pred: int, temperature: float, seed: int, max_tokens: int) -> dict:
        """One reply with edgerun's default sampler chain: decode tok/s as ReplyStats counts it
        (tokens after the first over the time after the first; end-of-generation not counted)."""
        import time

        import llama_cpp

        self.draft.num_pred_tokens = num_pred
        self.llm.set_seed(seed)
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        times, out = [], []
        for token in self.llm.generate(tokens, temp=temperature, top_k=40, top_p=0.95, min_p=0.05,
                                       repeat_penalty=1.0):
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            times.append(time.perf_counter())
            out.append(token)
            if len(out) >= max_tokens:
                break
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        return {"tokens": out, "decode_tok_s": (len(times) - 1) / span if span > 0 else 0.0}

    def close(self) -> None:
        self.llm.close()
