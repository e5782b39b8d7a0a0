"""A runner's load time with its load-time costs timed against read from the kept table, side by
side in one process (runtime/cost_table.py).

    .venv/bin/python scripts/load_costs_ab.py [--model NAME] [--threads N] [--repeat N]

Each pair starts an n-gram runner twice in ABBA turns: once with the kept tables removed first
(it times its batch shapes and keeps them), once reading what the other start kept. Prints each
start's wall time, from the call to the runner ready, and the medians and the ratio per pair.
It removes the kept tables of the cache it runs in (EDGERUN_KV_DIR moves it).
"""

from __future__ import annotations

import argparse
import statistics
import time

from edgerun.runner import Runner
from edgerun.runtime import cost_table
from edgerun.settings import EngineSettings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    engine = EngineSettings().replace(n_threads=args.threads)
    got: dict[str, list[float]] = {"timed": [], "kept": []}
    for i in range(args.repeat):
        for side in ("timed", "kept") if i % 2 == 0 else ("kept", "timed"):
            if side == "timed":
                cost_table.clear()
            start = time.perf_counter()
            with Runner(args.model, engine, ngram=True):
                got[side].append(time.perf_counter() - start)
        print(f"[{i + 1}/{args.repeat}] timed {got['timed'][-1]:.3f} s, kept {got['kept'][-1]:.3f} s", flush=True)
    ratios = [t / k for t, k in zip(got["timed"], got["kept"])]
    for side, v in got.items():
        print(f"{side}: median {statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f})")
    print(f"timed / kept: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
