"""The n-gram governor replayed without noise: the n-gram bench's replies, recorded once with plain
decoding, run again through the n-gram drafter and one governor or more, every round charged a
fixed price.

    .venv/bin/python scripts/governor_replay.py [--model NAME] [--against GOVERNOR.py ...]

On a shared machine a side-by-side bench moves by more than a governor's choices do (plain decoding
read 11 to 16 tok/s from one run to the next on the 2-core CPU); here two governors meet the same
tokens at the same prices and differ only by their decisions. `--against` takes another governor
module (an older one: `git show REV:edgerun/decode/governor.py > /tmp/old.py`). What a replay
cannot show: a round that costs what the prices do not say, and at T > 0 the reply a round's
draws would have made (a verify samples as plain decoding does, so the recorded reply is one
the n-gram side could have made too).

Replies are recorded on the first run into edgerun's cache (replay/<model>.json): codegen at T=0
and at T=0.7 seeds 1-3, the code edit at T=0, the two-turn chat at T=0 and T=0.7 seeds 1-2.
Each governor replays each alone, the chat's turn 2 after its turn 1 (the classes carry as they do
in the app), and the edit after each codegen reply (a session that wrote new code first).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
from dataclasses import replace
from pathlib import Path

from edgerun.decode import governor
from edgerun.decode.ngram import NgramDrafter

# the price tables: verify of n tokens, ms
# the 1.5B Q4_K_M on the 2-core CPU, 2 threads: the governor's tests' table; rounds cost it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_governor import MEASURED_2T as CPU_2T  # noqa: E402

# the same model on one H100 as the runner timed it at load; in a reply a round cost about 1.5x
# the governor's curve through these, a batch size's first two runs (no CUDA graph yet) 2.7x, and
# a plain step 2.04 ms (the lease's diagnosis)
H100_LOAD = {1: 1.889, 2: 2.874, 3: 2.299, 4: 2.65, 5: 2.748, 6: 2.975, 7: 3.134, 8: 3.373, 9: 4.025,
             16: 3.906, 32: 5.064}
H100_ROUND, H100_COLD, H100_PLAIN = 1.5, 2.7, 2.04e-3

CODEGEN = [(0.0, 1), (0.7, 1), (0.7, 2), (0.7, 3)]
CHAT = [(0.0, 1), (0.7, 1), (0.7, 2)]


def record(model: str, path: Path) -> dict:
    """The replies as plain decoding makes them (at most 256 tokens each)."""
    from edgerun.bench.ab import load_prompts
    from edgerun.bench.spec import CHAT_TURN_1, CHAT_TURN_2, CODEGEN_PROMPT, EDIT_PROMPT, _reply
    from edgerun.convert.atomic import atomic_path
    from edgerun.runner import Runner
    from edgerun.settings import EngineSettings, SamplerSettings

    prompts = {p.name: p.text for p in load_prompts("spec")}
    out: dict = {}
    with Runner(model, EngineSettings().replace(n_ctx=4096)) as r:
        def reply(tokens, temp, seed):  # the bench's own reply: its tokens and text, the end left out
            return _reply(r, tokens, SamplerSettings().replace(temperature=temp, seed=seed), 256)

        for temp, seed in CODEGEN:
            tokens = r.chat_tokens([{"role": "user", "content": prompts[CODEGEN_PROMPT]}])
            out[f"codegen T={temp:g} seed {seed}"] = {"prompt": tokens, "reply": reply(tokens, temp, seed)["tokens"]}
        tokens = r.chat_tokens([{"role": "user", "content": prompts[EDIT_PROMPT]}])
        out["edit T=0"] = {"prompt": tokens, "reply": reply(tokens, 0.0, 1)["tokens"]}
        for temp, seed in CHAT:
            first = [{"role": "user", "content": CHAT_TURN_1}]
            p1 = r.chat_tokens(first)
            r1 = reply(p1, temp, seed)
            p2 = r.chat_tokens(first + [{"role": "assistant", "content": r1["text"]},
                                        {"role": "user", "content": CHAT_TURN_2}])
            out[f"chat T={temp:g} seed {seed}"] = {"turn1": {"prompt": p1, "reply": r1["tokens"]},
                                                   "prompt": p2, "reply": reply(p2, temp, seed)["tokens"]}
        eog = [t for t in range(r.model.n_vocab) if r.model.is_eog(t)]
    doc = {"model": model, "eog": eog, "replies": out}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(doc))
    return doc


class Prices:
    """What a round and a plain step cost on one machine, and the table the governor starts from."""

    def __init__(self, machine: str, g):
        self.machine = machine
        table = CPU_2T if machine == "cpu" else H100_LOAD
        self.load = tuple((n, ms / 1000) for n, ms in sorted(table.items()) if machine != "cpu" or n in (*range(1, 10), 16, 32))
        if machine == "cpu":
            self.plain = CPU_2T[1] / 1000
        else:
            self.curve = g.curve(start(g, self.load), g.K_MAX_NGRAM + 1)
            self.plain = H100_PLAIN

    def round(self, n: int, runs: int) -> float:
        if self.machine == "cpu":
            return CPU_2T[n] / 1000
        return (H100_COLD if runs < 2 else H100_ROUND) * self.curve[n - 1]

    def cold(self, runs: int) -> bool:
        """A batch size's first two runs on the GPU have no CUDA graph yet."""
        return self.machine != "cpu" and runs < 2


def start(g, load) -> governor.GovernorState:
    """The n-gram governor as the runner starts a reply: sizes timed at load, draft steps free."""
    state = g.from_costs(g.Costs(load, draft_step_s=0.0), warm_rounds=1)
    return replace(g.new_reply(state), hopeful=True, k_max=g.K_MAX_NGRAM)


def replay(g, prices: Prices, prompt: list[int], reply: list[int], eog: set[int], state=None):
    """The reply made again with the n-gram drafter under governor module g: (plain time over
    drafted time, drafted rounds, drafts accepted, drafts, the state after)."""
    state = start(g, prices.load) if state is None else g.new_reply(state)
    drafter = NgramDrafter(is_stop=lambda t: t in eog)
    drafter.reset(prompt)
    pos, spent, rounds, accepted, drafted, runs = 1, 0.0, 0, 0, 0, {}
    shadows = "shadow" in inspect.signature(g.update).parameters
    while pos < len(reply):
        drafter.extend([reply[pos - 1]])
        proposal = drafter.lookup(g.K_MAX_NGRAM)
        k = 0
        if proposal.tokens:
            budget = min(len(proposal.tokens), max(1, len(reply) - pos))
            cold = frozenset(n for n in range(2, budget + 2) if prices.cold(runs.get(n, 0)))
            k = g.choose(state, budget, match=proposal.match, ends=budget < g.K_MAX_NGRAM, cold=cold).k
        if k:
            held = next((i for i in range(k) if pos + i >= len(reply) or proposal.tokens[i] != reply[pos + i]), k)
            n = k + 1
            cost = prices.round(n, runs.get(n, 0))
            state = g.update(state, k=k, drafted=k, accepted=held, draft_s=0.0, verify_s=cost,
                             match=proposal.match, cold=prices.cold(runs.get(n, 0)))
            runs[n] = runs.get(n, 0) + 1
            drafter.extend(proposal.tokens[:held])
            pos, spent = pos + held + 1, spent + cost
            rounds, accepted, drafted = rounds + 1, accepted + held, drafted + k
        else:
            # a plain step says whether it made the proposal's first token (to governors that ask)
            told = {"shadow": proposal.tokens[0] == reply[pos]} if proposal.tokens and shadows else {}
            state = g.update(state, k=0, drafted=0, accepted=0, draft_s=0.0, verify_s=prices.plain, **told)
            pos, spent = pos + 1, spent + prices.plain
    return (len(reply) - 1) * prices.plain / spent, rounds, accepted, drafted, state


def load_governor(path: str):
    spec = importlib.util.spec_from_file_location(f"governor_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target whose replies are replayed")
    p.add_argument("--against", nargs="*", default=[], metavar="GOVERNOR.py", help="other governor modules")
    p.add_argument("--record", action="store_true", help="record the replies again")
    args = p.parse_args()
    from edgerun.paths import cache_dir

    name = Path(args.model).name.removesuffix(".gguf")
    path = cache_dir() / "replay" / f"{name}.json"
    doc = record(args.model, path) if args.record or not path.exists() else json.loads(path.read_text())
    eog, replies = set(doc["eog"]), doc["replies"]
    governors = {"this": governor, **{"/".join(Path(a).parts[-2:]): load_governor(a) for a in args.against}}
    print(f"replies of {doc['model']} ({path}); ratio = plain time / n-gram time, (drafted rounds, accepted/drafted)")
    for machine in ("cpu", "h100"):
        print(f"\n{machine + ' prices':26s}" + "".join(f" | {name:>24s}" for name in governors))
        for key, r in replies.items():
            cells = []
            for g in governors.values():
                prices, state = Prices(machine, g), None
                if "turn1" in r:
                    state = replay(g, prices, r["turn1"]["prompt"], r["turn1"]["reply"], eog)[-1]
                ratio, rounds, acc, drafted, _ = replay(g, prices, r["prompt"], r["reply"], eog, state)
                cells.append(f"{ratio:6.3f} ({rounds:2d}, {acc:3d}/{drafted:3d})")
            label = key.replace("chat", "chat turn 2")
            print(f"{label:26s}" + "".join(f" | {c:>24s}" for c in cells))
        for key, r in replies.items():
            if key.startswith("codegen"):
                cells = []
                for g in governors.values():
                    prices = Prices(machine, g)
                    state = replay(g, prices, r["prompt"], r["reply"], eog)[-1]
                    ratio, rounds, acc, drafted, _ = replay(g, prices, replies["edit T=0"]["prompt"],
                                                            replies["edit T=0"]["reply"], eog, state)
                    cells.append(f"{ratio:6.3f} ({rounds:2d}, {acc:3d}/{drafted:3d})")
                print(f"edit after {key[8:]:15s}" + "".join(f" | {c:>24s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
