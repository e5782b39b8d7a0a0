#!/usr/bin/env python3
"""Host cost of one speculative round's decision (Speculator.round_args), without decoding.

The case timed: a governed model draft that plain decoding beats but that is not given up, so
every round asks the governor and then decodes plain. Two contexts of MODEL on the CPU; the best
of 5 repeats of 20,000 calls.

  bench_round_host.py MODEL.gguf"""

from __future__ import annotations

import argparse
import timeit

from edgerun.decode import governor
from edgerun.decode.speculative import SpecConfig, Speculator
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    args = ap.parse_args()
    settings = EngineSettings(n_ctx=512, gpu_layers="0", n_threads=2)
    # costs of a GPU pair where plain wins at the prior acceptance and a re-check is cheap
    state = governor.GovernorState(verify_s=tuple((n, 0.0017 + 0.0003 * n) for n in range(1, governor.K_MAX + 2)),
                                   draft_step_s=0.0011, catch_up_s=0.00001, drafted_rounds=5, warm_rounds=2)
    assert governor.choose(state)[0] == 0 and governor.given_up(state) is None
    with Model(args.model) as model, Context(model, settings) as target, Context(model, settings) as draft:
        target.eval([1] * 64)
        draft.eval([1] * 64)
        spec = Speculator(SpecConfig(draft=draft, governors={"model": state}), target, [1] * 64)
        n = 20000
        per = min(timeit.repeat(lambda: spec.round_args(1, 100), number=n, repeat=5)) / n
        print(f"round_args, plain round, draft not given up: {per * 1e6:.1f} us")
        for name, fn in (("governor.choose", lambda: governor.choose(state)),
                         ("governor.given_up", lambda: governor.given_up(state))):
            print(f"{name}: {min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6:.1f} us")


if __name__ == "__main__":
    main()
