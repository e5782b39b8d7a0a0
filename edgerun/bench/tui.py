"""`edgerun bench chat-app`: tok/s of a reply generated in the chat app vs the same reply with no UI.

Two server processes load the model once each: one runs the app (headless, driven by Textual's
Pilot), one a plain generation loop. They take ABBA turns generating the same reply (same prompt,
greedy, same token count, an empty conversation each time); the idle one is stopped with SIGSTOP
so it takes no CPU. Each turn pair is one app reply and one plain reply seconds apart, because a
shared VM's speed drifts by 5-20% over minutes, and only a ratio of neighbours keeps that drift
out. The app's conversations and settings go to a throwaway XDG home.

Claim: the app costs under 3% of decode speed (app / headless >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

from edgerun.bench.scenario import Scenario, claim, count, interleave, register, side_lines
from edgerun.bench.stats import ratio_spread, spread
from edgerun.errors import EdgerunError

PROMPT = "Write a Python function that parses an ISO 8601 date string, with a docstring and tests."
N_CTX = 4096


def serve_headless(model: str, n: int) -> None:
    """The side without a UI: a reply per 'go' line on stdin, its decode tok/s on stdout."""
    import threading

    from edgerun.decode.stats import ReplyStats
    from edgerun.runner import Runner
    from edgerun.settings import EngineSettings, SamplerSettings

    with Runner(model, EngineSettings(n_ctx=N_CTX), draft="none") as r:
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
    """The app's side: each 'go' starts a new conversation and sends the prompt with Enter."""
    import asyncio

    from edgerun import user_settings
    from edgerun.settings import EngineSettings
    from edgerun.tui.app import EdgerunApp

    # plain decoding on both sides: the claim is what the UI costs, not what drafting gains
    user_settings.save(user_settings.UserSettings().replace(temperature=0.0, max_tokens=n, ngram=False))
    app = EdgerunApp(model, draft="none", engine=EngineSettings(n_ctx=N_CTX))
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
    """One side in a child process, stopped (SIGSTOP) between its replies."""

    def __init__(self, side: str, model: str, n: int, env: dict) -> None:
        call = (f"tui.serve_headless({model!r}, {n})" if side == "headless"
                else f"asyncio.run(tui.serve_app({model!r}, {n}))")
        self.proc = subprocess.Popen([sys.executable, "-c", f"import asyncio; from edgerun.bench import tui; {call}"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise EdgerunError(f"the chat-app bench's {side} side did not start (it said {line!r}); its stderr is above")
        os.kill(self.proc.pid, signal.SIGSTOP)

    def reply(self) -> float:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        os.kill(self.proc.pid, signal.SIGSTOP)
        if not line:
            raise EdgerunError("a chat-app bench side ended mid-run; its stderr is above")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="catalog name or .gguf (default qwen2.5-coder-1.5b)")
    p.add_argument("-n", "--max-tokens", type=count, default=256, help="tokens per reply (default 256)")
    p.add_argument("--repeat", type=count, default=12, help="turn pairs (default 12)")


def measure(args: argparse.Namespace, say) -> dict:
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, XDG_DATA_HOME=f"{home}/data", XDG_CONFIG_HOME=f"{home}/config")
        servers = []
        try:
            servers.append(Server("app", args.model, args.max_tokens, env))
            servers.append(Server("headless", args.model, args.max_tokens, env))
            app, headless = servers
            app.reply(), headless.reply()  # not measured: the first reply pages the weights in
            values = interleave({"app": app.reply, "headless": headless.reply}, args.repeat, say)
        finally:
            for server in servers:
                server.close()
    settings = {"model": args.model, "max_tokens": args.max_tokens, "repeat": args.repeat, "prompt": PROMPT,
                "ctx": N_CTX, "temperature": 0.0}
    ratio = ratio_spread(values["headless"], values["app"])
    return {"settings": settings, "decode_tok_s": values, "sides": {k: spread(v) for k, v in values.items()},
            "claims": [claim("chat app / headless decode tok/s", ratio, ">= 0.97")]}


def report(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"{s['model']}, {s['max_tokens']} tokens, greedy, {s['repeat']} turn pairs"]
    return "\n".join(lines + side_lines(doc["sides"]))


register(Scenario("chat-app", "the chat app's decode tok/s vs the same reply with no UI (goal >= 0.97)",
                  add_args, measure, report))
