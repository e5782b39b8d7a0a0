#!/usr/bin/env python3
"""tok/s of a reply generated in the chat app (headless Pilot) vs the same reply with no UI.

Two server processes load the model once each: one runs the app, one a plain generation loop.
They take turns generating the same reply (same prompt, greedy, same token count, an empty
conversation each time), the idle one stopped with SIGSTOP so it takes no CPU, in the order
ABBA so drift during a round cancels. Each round is one app reply and one plain reply a few
seconds apart: this VM's speed drifts by 5-20% over minutes (memory bandwidth shared with other
tenants), and pairing each app reply with the plain reply next to it keeps that drift out of
the ratio. Prints the median of the per-round ratios (goal >= 0.97)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading

from edgerun import user_settings
from edgerun.decode.stats import ReplyStats
from edgerun.runner import Runner
from edgerun.settings import EngineSettings, SamplerSettings

PROMPT = "Write a Python function that parses an ISO 8601 date string, with a docstring and tests."
ENGINE = EngineSettings(n_ctx=4096)


def serve_headless(model: str, n: int) -> None:
    with Runner(model, ENGINE, draft="none") as r:
        tokens = r.chat_tokens([{"role": "user", "content": PROMPT}])
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            stats = ReplyStats()
            for record in r.stream(tokens, SamplerSettings(temperature=0.0), max_tokens=n, cancel=threading.Event()):
                stats.add(record)
            print(json.dumps(stats.decode_tok_s), flush=True)


async def serve_app(model: str, n: int) -> None:
    from edgerun.tui.app import EdgerunApp

    app = EdgerunApp(model, draft="none", engine=ENGINE)
    async with app.run_test(size=(140, 45)) as pilot:
        while app.session is None:
            await pilot.pause(0.05)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "go":
            await app.action_new_conversation()
            app.query_one("#input").text = PROMPT
            await pilot.press("enter")
            # poll with a plain sleep: Pilot's pause also forces a screen update, two extra
            # renders a second that a user's terminal would not see
            while app.stats is None or app.generating or not app.stats.generated_tokens:
                await asyncio.sleep(0.5)
            print(json.dumps(app.stats.decode_tok_s), flush=True)


class Server:
    def __init__(self, side: str, model: str, n: int) -> None:
        run = (f"bench_tui.serve_headless({model!r}, {n})" if side == "headless"
               else f"asyncio.run(bench_tui.serve_app({model!r}, {n}))")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen([sys.executable, "-c", f"import asyncio, bench_tui; {run}"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise SystemExit(f"bench_tui: the {side} server did not start (said {line!r}); see its stderr above")
        self.pause()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def reply(self) -> float:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        result = json.loads(self.proc.stdout.readline())
        self.pause()
        return result

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as home:
        # the app's conversations and settings go to a throwaway place
        os.environ["XDG_DATA_HOME"], os.environ["XDG_CONFIG_HOME"] = f"{home}/data", f"{home}/config"
        user_settings.save(user_settings.UserSettings().replace(temperature=0.0, max_tokens=args.n))
        app, headless = Server("app", args.model, args.n), Server("headless", args.model, args.n)
        try:
            ratios = []
            for r in range(args.rounds):
                if r % 2 == 0:
                    a, h = app.reply(), headless.reply()
                else:
                    h, a = headless.reply(), app.reply()
                ratios.append(a / h)
                print(f"round {r + 1}: app {a:.2f} tok/s, headless {h:.2f} tok/s, ratio {a / h:.3f}", flush=True)
        finally:
            app.close()
            headless.close()
    q = statistics.quantiles(ratios, n=4)
    print(f"model {args.model}, {args.n} tokens, {args.rounds} rounds: ratio {statistics.median(ratios):.3f} "
          f"(median; quartiles {q[0]:.3f}-{q[2]:.3f}; goal >= 0.97)")


if __name__ == "__main__":
    main()
