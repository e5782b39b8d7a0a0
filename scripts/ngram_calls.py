"""Native calls an n-gram reply makes with plain stretches (NgramDrafter.quiet_steps) and with one
plain token a call, side by side in one process, on the bench's cases.

    .venv/bin/python scripts/ngram_calls.py [--model NAME] [--threads N] [--cases codegen,edit,chat]
                                            [--temps 0,0.7] [--seeds 0] [-n 256] [--budget 10]

A plain call returns within its time budget (50 ms in the decode loop), which a CPU step of the
1.5B outlasts: every call is one token there either way. `--budget` raises it so that the CPU's
steps fit as a GPU's do (about 2 ms a step), which is where the calls count. Each reply starts from
the governor state the runner had at load, as `edgerun bench ngram` does; the two ways run in ABBA
turns. Prints, per reply, tokens, native calls, drafted and accepted tokens, and whether the two
ways made the same tokens (at T=0 they differ only where a verify batch's numerics break a
near-tie, after the governors drafted differently).
"""

from __future__ import annotations

import argparse

from edgerun.bench.ab import load_prompts
from edgerun.bench.spec import _edgerun_case
from edgerun.decode import speculative
from edgerun.runner import Runner
from edgerun.settings import EngineSettings

STRETCHED = speculative.Speculator._plain_steps


def _one_a_call(self, remaining: int, kept) -> int:
    """The n-gram path's plain calls as before the stretches: one token each."""
    return 1 if self.ngram else STRETCHED(self, remaining, kept)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default="codegen,edit,chat")
    p.add_argument("--temps", default="0,0.7")
    p.add_argument("--seeds", default="0")
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("--budget", type=float, default=10.0, help="a plain call's time budget, seconds (default 10)")
    args = p.parse_args()
    speculative.PLAIN_BUDGET_S = args.budget
    prompts = {x.name: x.text for x in load_prompts("spec")}
    with Runner(args.model, EngineSettings().replace(n_threads=args.threads), ngram=True) as runner:
        loaded = {"ngram": runner.governors.get("ngram")}
        turn = 0
        for case in args.cases.split(","):
            for temp in (float(t) for t in args.temps.split(",")):
                for seed in (int(s) for s in args.seeds.split(",")):
                    got = {}
                    for way in ("stretched", "one a call") if turn % 2 == 0 else ("one a call", "stretched"):
                        speculative.Speculator._plain_steps = STRETCHED if way == "stretched" else _one_a_call
                        got[way] = _edgerun_case(runner, case, prompts, temp, seed, args.max_tokens, fresh=loaded)
                    speculative.Speculator._plain_steps = STRETCHED
                    turn += 1
                    same = got["stretched"]["tokens"] == got["one a call"]["tokens"]
                    print(f"{case} T={temp:g} seed {seed}: " + "; ".join(
                        f"{way} {len(r['tokens'])} tokens in {r['rounds']} calls, {r['drafted']} drafted,"
                        f" {r['accepted']} accepted" for way, r in sorted(got.items(), reverse=True))
                        + f"; same tokens: {'yes' if same else 'no'}", flush=True)


if __name__ == "__main__":
    main()
