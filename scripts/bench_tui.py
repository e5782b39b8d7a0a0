#!/usr/bin/env python3
"""tok/s of a reply generated in the chat app (headless Pilot) vs the same reply with no UI.

Same model, prompt, greedy sampling and token count; each side in a fresh process, alternating,
`--rounds` times; prints the median of the per-round ratios (goal >= 0.97). Pairing each app run
with the headless run next to it keeps this VM's drift (which moves both sides) out of the ratio."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading

from edgerun import user_settings
from edgerun.decode.stats import ReplyStats
from edgerun.runner import Runner
from edgerun.settings import EngineSettings, SamplerSettings

PROMPT = "Write a Python function that parses an ISO 8601 date string, with a docstring and tests."


def headless(model: str, n: int, engine: EngineSettings) -> float:
    with Runner(model, engine, draft="none") as r:
        stats = ReplyStats()
        tokens = r.chat_tokens([{"role": "user", "content": PROMPT}])
        for record in r.stream(tokens, SamplerSettings(temperature=0.0), max_tokens=n, cancel=threading.Event()):
            stats.add(record)
    return stats.decode_tok_s


async def in_app(model: str, n: int, engine: EngineSettings) -> float:
    from edgerun.tui.app import EdgerunApp

    app = EdgerunApp(model, draft="none", engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        while app.session is None:
            await pilot.pause(0.05)
        app.query_one("#input").text = PROMPT
        await pilot.press("enter")
        # poll with a plain sleep: Pilot's pause also forces a screen update, two extra renders a
        # second that a user's terminal would not see, each taking CPU from llama.cpp
        while app.stats is None or app.generating or not app.stats.generated_tokens:
            await asyncio.sleep(0.5)
        return app.stats.decode_tok_s


def _child(side: str, model: str, n: int) -> float:
    """Each measurement in a fresh process: llama.cpp's OpenMP thread teams from one run must not
    linger into the next."""
    import json
    import subprocess
    import sys

    code = (f"import asyncio, json, scripts_bench_tui as b; from edgerun.settings import EngineSettings;"
            f"e = EngineSettings(n_ctx=4096);"
            f"print(json.dumps(b.headless({model!r}, {n}, e) if {side!r} == 'headless' else asyncio.run(b.in_app({model!r}, {n}, e))))")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code.replace("scripts_bench_tui", "bench_tui")],
                         capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as home:
        # the app's conversations and settings go to a throwaway place
        os.environ["XDG_DATA_HOME"], os.environ["XDG_CONFIG_HOME"] = f"{home}/data", f"{home}/config"
        user_settings.save(user_settings.UserSettings().replace(temperature=0.0, max_tokens=args.n))
        ui, plain = [], []
        for r in range(args.rounds):
            plain.append(_child("headless", args.model, args.n))
            ui.append(_child("app", args.model, args.n))
            print(f"round {r + 1}: app {ui[-1]:.2f} tok/s, headless {plain[-1]:.2f} tok/s, "
                  f"ratio {ui[-1] / plain[-1]:.3f}", flush=True)
    a, b = statistics.median(ui), statistics.median(plain)
    ratio = statistics.median(u / p for u, p in zip(ui, plain))
    print(f"model {args.model}, {args.n} tokens: app {a:.2f} tok/s, headless {b:.2f} tok/s (medians), "
          f"ratio {ratio:.3f} (median of {args.rounds} paired ratios, goal >= 0.97)")


if __name__ == "__main__":
    main()
