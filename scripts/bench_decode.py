#!/usr/bin/env python3
"""Decode tok/s of `edgerun run` vs llama-cpp-python's high-level `Llama`, side by side.

Same model file, threads, prompt (raw, no template), greedy, same token count; each side runs in
its own process, alternating, `--rounds` times; the ratio of medians is printed.
Decode tok/s for both = (tokens - 1) / (time of last token - time of first token)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from edgerun.models.fetch import resolve
from edgerun.settings import physical_cores

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"

LLAMA_SIDE = r"""
import json, sys, time
from llama_cpp import Llama
path, n, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = Llama(path, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
            n_gpu_layers=0, verbose=False)
times = []
for _ in llm.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1, stream=True):
    times.append(time.perf_counter())
print(json.dumps({"tokens": len(times), "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}))
"""


def edgerun_side(model: Path, n: int, threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stats.json"
        subprocess.run(
            [sys.executable, "-m", "edgerun.cli", "run", PROMPT, "--raw", "-m", str(model), "-n", str(n),
             "--temp", "0", "--threads", str(threads), "--gpu-layers", "0", "--ctx", "2048",
             "--stats-json", str(out)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        return json.loads(out.read_text())["decode_tok_s"]


def llama_side(model: Path, n: int, threads: int) -> float:
    proc = subprocess.run([sys.executable, "-c", LLAMA_SIDE, str(model), str(n), str(threads), PROMPT],
                          check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=physical_cores())
    args = ap.parse_args()
    model = resolve(args.model)
    ours, theirs = [], []
    for r in range(args.rounds):
        ours.append(edgerun_side(model, args.n, args.threads))
        theirs.append(llama_side(model, args.n, args.threads))
        print(f"round {r + 1}: edgerun {ours[-1]:.2f} tok/s, Llama {theirs[-1]:.2f} tok/s", flush=True)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"model {args.model}, {args.n} tokens, {args.threads} threads")
    print(f"edgerun run  median {a:.2f} tok/s")
    print(f"Llama (high-level) median {b:.2f} tok/s")
    print(f"ratio edgerun/Llama = {a / b:.3f}  (goal >= 0.98)")


if __name__ == "__main__":
    main()
