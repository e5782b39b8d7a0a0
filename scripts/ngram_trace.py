"""Every round of n-gram replies on the bench's cases, as the governor saw it: the plan's decision
and its reason, the proposal's match, what the round drafted and kept, its plain steps, the
native timing and the plain step's cost the governor then held. Each reply starts from the
governor state the runner had at load, as `edgerun bench ngram` does.

    .venv/bin/python scripts/ngram_trace.py [--model NAME] [--gpu-layers N] [--cases chat,codegen]
                                            [--temp 0] [--repeat 5] [-n 256] --json OUT

Prints one line a reply (tok/s, native calls, drafted, accepted); OUT holds the rounds of the
measured reply (the chat case's second).
"""

from __future__ import annotations

import argparse
import json

from edgerun.bench.ab import load_prompts
from edgerun.bench.spec import _edgerun_case
from edgerun.decode import governor, speculative
from edgerun.runner import Runner
from edgerun.settings import EngineSettings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--gpu-layers", default="0")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cases", default="chat,codegen")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    rounds = []  # (speculator, round) of the reply being made
    real_after = speculative.Speculator.after

    def after(self, result):
        planned, record = self._planned, real_after(self, result)
        rounds.append((id(self), {
            "kind": planned.decision.kind.name, "k": planned.decision.k, "reason": planned.decision.reason,
            "match": planned.match, "drafts": len(result.drafts), "accepted": result.accepted,
            "steps": 1 + len(result.more), "native_s": result.verify_s, "cold": planned.cold,
            "plain_s": governor.plain_cost(self.memory.get("ngram"))}))
        return record

    speculative.Speculator.after = after
    prompts = {x.name: x.text for x in load_prompts("spec")}
    replies = []
    engine = EngineSettings().replace(gpu_layers=args.gpu_layers, n_threads=args.threads)
    with Runner(args.model, engine, ngram=True) as runner:
        loaded = {"ngram": runner.governors.get("ngram")}
        for case in args.cases.split(","):
            for rep in range(args.repeat):
                rounds.clear()
                r = _edgerun_case(runner, case, prompts, args.temp, 0, args.max_tokens, fresh=loaded)
                last = rounds[-1][0]  # the measured reply's speculator (the chat case answers turn 1 first)
                replies.append({"case": case, "repeat": rep, "tok_s": r["decode_tok_s"], "calls": r["rounds"],
                                "drafted": r["drafted"], "accepted": r["accepted"],
                                "rounds": [x for s, x in rounds if s == last]})
                print(f"{case} #{rep}: {r['decode_tok_s']:.1f} tok/s, {r['rounds']} calls, {r['drafted']} drafted,"
                      f" {r['accepted']} accepted", flush=True)
    with open(args.json, "w") as f:
        json.dump(replies, f)


if __name__ == "__main__":
    main()
