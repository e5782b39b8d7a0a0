"""`edgerun bench resume`: TTFT of the first new reply in a reopened long conversation, its saved
KV state restored vs the whole conversation evaluated again.

The conversation is the shipped chat set's turns (data/calib/chat.txt) up to --tokens tokens. It
is evaluated once and its state saved, as the chat app saves it after a reply (into a throwaway
store). Then the sides take ABBA turns, each from an empty context, as a conversation reopened
after a restart finds it, answering the same new question:

- restore: resume.StateCache.resume (the file read, checked whole, loaded by llama.cpp), then the
  question's prefill and the first token;
- restore-cold: the same after the state file is dropped from the page cache
  (posix_fadvise DONTNEED), as after a reboot: the read comes from the disk;
- prefill: the conversation and the question evaluated.

TTFT is the wall time from the start of the side to its first token. A restored state holds the
very KV bytes the conversation had in memory, so both restore sides must give the in-memory
conversation's reply token for token (greedy); the re-prefilled reply's agreement with it is
reported: llama.cpp's CPU kernels round differently for other batch shapes, and evaluating 3,000
tokens in n_batch chunks is another shape than a conversation built turn by turn. With --draft, the draft model's state is measured too: its restore against
the catch-up prefill it otherwise pays before its first drafted round (the reason the draft's
state is saved beside the target's).

Claims: restored TTFT <= 0.1 x re-prefill TTFT (warm and cold page cache), and the state file no
larger than llama.cpp's own serialization of the same KV plus 0.1% (the token list and a header).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from importlib import resources

from edgerun.bench.scenario import Scenario, claim, count, interleave, register, side_lines
from edgerun.bench.stats import agreement, first_divergence, ratio_spread, spread
from edgerun.errors import ConfigError

QUESTION = "Thanks. To sum up: which of the suggestions above would you try first, and why?"
SIDES = ("restore", "restore-cold", "prefill")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="catalog name or .gguf (default qwen2.5-coder-1.5b)")
    p.add_argument("--draft", default=None, help="also measure this draft model's state: restore vs catch-up prefill")
    p.add_argument("--tokens", type=count, default=3000, help="conversation length in tokens (default 3000)")
    p.add_argument("--ctx", type=count, default=4096, help="context size (default 4096)")
    p.add_argument("-n", "--max-tokens", type=count, default=8, help="tokens of the new reply, compared across sides (default 8)")
    p.add_argument("--repeat", type=count, default=3, help="turns per side (default 3)")
    p.add_argument("--threads", type=count, default=None, help="CPU threads (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--gpu-layers", default="auto", help="auto, 0, or a layer count (default auto)")


def conversation(chat_tokens, limit: int) -> list[dict]:
    """User/assistant turns of the shipped chat set, as many as fit in `limit` tokens."""
    text = resources.files("edgerun.data").joinpath("calib/chat.txt").read_text()
    turns = re.findall(r"^(User|Assistant): (.*?)(?=^(?:User|Assistant): |^# |\Z)", text, re.M | re.S)
    messages: list[dict] = []
    for role, content in turns:
        candidate = messages + [{"role": role.lower(), "content": content.strip()}]
        if len(chat_tokens(candidate)) > limit:
            break
        messages = candidate
    if messages and messages[-1]["role"] == "user":
        messages.pop()
    if not messages:
        raise ConfigError(f"--tokens {limit} holds no turn of the chat set; give more")
    return messages


def _drop_from_page_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(args: argparse.Namespace, say) -> dict:
    import tempfile

    from edgerun.decode.generate import Prefill, Step
    from edgerun.resume import StateCache
    from edgerun.runner import Runner
    from edgerun.runtime.kvstate import KvStore
    from edgerun.runtime.placement import kv_bytes_per_layer
    from edgerun.settings import EngineSettings, SamplerSettings

    engine = EngineSettings().replace(n_ctx=args.ctx, n_threads=args.threads, gpu_layers=args.gpu_layers)
    greedy = SamplerSettings(temperature=0.0)
    with Runner(args.model, engine, draft=args.draft or "none", spec_k=4 if args.draft else None) as runner, \
            tempfile.TemporaryDirectory() as tmp:
        messages = conversation(runner.chat_tokens, args.tokens)
        held = runner.chat_tokens(messages)
        prompt = runner.chat_tokens(messages + [{"role": "user", "content": QUESTION}])
        if len(prompt) + args.max_tokens + 16 > runner.ctx.n_ctx:
            raise ConfigError(f"a {len(prompt)}-token prompt leaves no room in --ctx {runner.ctx.n_ctx}; raise it")
        states = StateCache(runner, KvStore(tmp, max_bytes=1 << 40), min_tokens=1)
        say(f"evaluating the {len(held)}-token conversation once and saving its state")
        runner.ctx.eval(held)
        if runner.draft_ctx is not None:
            runner.draft_ctx.eval(held)
        save_s = []
        for _ in range(args.repeat):  # what a reply's end pays to save it (the file written anew)
            for old in states.store.entries():
                states.store.remove(old.path)
            start = time.perf_counter()
            saved = states.save()
            save_s.append(time.perf_counter() - start)
        target = next(s for s in saved if s.role == "target")
        path = states.store.path(target.name)
        # the reply of the conversation going on in memory: a restored state holds the same KV
        # bytes, so its reply must be this one token for token
        in_memory = [r.token for r in runner.stream(prompt, greedy, max_tokens=args.max_tokens) if isinstance(r, Step)]
        outputs: dict[str, list[list[int]]] = {side: [] for side in SIDES}
        restored: list[int] = []
        restore_s: list[float] = []  # of the TTFT, the restore alone (read, check, llama.cpp's load)

        def side(name: str) -> float:
            runner.ctx.trim(0)
            if runner.draft_ctx is not None:
                runner.draft_ctx.trim(0)
            if name == "restore-cold":
                for s in saved:
                    _drop_from_page_cache(states.store.path(s.name))
            start = time.perf_counter()
            if name != "prefill":
                resumed = states.resume(prompt, saved)
                if resumed.note or not resumed.tokens:
                    raise ConfigError(f"the saved state was not restored ({resumed.note}); the bench cannot measure it")
                restored.append(resumed.tokens)
                restore_s.append(resumed.seconds)
            ttft, tokens, evaluated = None, [], None
            for record in runner.stream(prompt, greedy, max_tokens=args.max_tokens):
                if isinstance(record, Prefill):
                    evaluated = record.evaluated
                elif isinstance(record, Step):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    tokens.append(record.token)
            expected = len(prompt) if name == "prefill" else len(prompt) - restored[-1]
            if evaluated != expected:
                raise ConfigError(f"{name}: evaluated {evaluated} prompt tokens, expected {expected}")
            outputs[name].append(tokens)
            return ttft

        values = interleave({name: (lambda n=name: side(n)) for name in SIDES}, args.repeat, say, unit="s")
        draft = _draft_figures(runner, states, saved, held, args.repeat, say) if runner.draft_ctx is not None else None
        info = runner.info
        kv_bytes = len(held) * info.n_layers * kv_bytes_per_layer(1, info.n_head_kv, info.head_dim)
        payload = states.store.info(path).payload_bytes
        file_bytes = target.bytes
    if any(t != in_memory for name in ("restore", "restore-cold") for t in outputs[name]):
        raise ConfigError("a restored state gave another reply than the conversation kept in memory")
    prefilled = outputs["prefill"][0]
    agree = {"restored_equals_in_memory": True, "prefill_agreement": agreement(in_memory, prefilled),
             "prefill_first_divergence": first_divergence(in_memory, prefilled)}
    warm = ratio_spread(values["prefill"], values["restore"])
    cold = ratio_spread(values["prefill"], values["restore-cold"])
    settings = {"model": args.model, "draft": args.draft, "conversation_tokens": len(held),
                "prompt_tokens": len(prompt), "restored_tokens": restored[0], "ctx": args.ctx,
                "max_tokens": args.max_tokens, "repeat": args.repeat, "threads": runner.settings.n_threads,
                "gpu_layers": args.gpu_layers, "placement": runner.plan.reason}
    sizes = {"state_file_bytes": file_bytes, "llama_state_bytes": payload, "kv_bytes": kv_bytes,
             "file_over_llama_state": file_bytes / payload, "file_over_kv": file_bytes / kv_bytes}
    return {"settings": settings, "ttft_s": values, "sides": {n: spread(v) for n, v in values.items()},
            "outputs": agree, "sizes": sizes, "save_s": spread(save_s), "restore_s": spread(restore_s), "draft": draft, "load_avg_1m_end": os.getloadavg()[0],
            "claims": [claim("restored / re-prefilled TTFT (page cache warm)", warm, "<= 0.1"),
                       claim("restored / re-prefilled TTFT (state read from disk)", cold, "<= 0.1"),
                       claim("state file / llama.cpp's serialized state", file_bytes / payload, "<= 1.001")]}


def _draft_figures(runner, states, saved, held, repeat, say) -> dict:
    """The draft's state restored vs its catch-up prefill of the same tokens, in turns."""
    draft = runner.draft_ctx
    mine = [s for s in saved if s.role == "draft"]

    def restore() -> float:
        draft.trim(0)
        start = time.perf_counter()
        states.restore("draft", held, mine)
        return time.perf_counter() - start

    def catch_up() -> float:
        draft.trim(0)
        start = time.perf_counter()
        draft.sync(held)
        return time.perf_counter() - start

    values = interleave({"draft restore": restore, "draft catch-up": catch_up}, repeat, say, unit="s")
    return {"seconds": values, "sides": {n: spread(v) for n, v in values.items()},
            "restore_over_catch_up": ratio_spread(values["draft catch-up"], values["draft restore"]),
            "state_file_bytes": mine[0].bytes, "tokens": len(held)}


def report(doc: dict) -> str:
    s, z = doc["settings"], doc["sizes"]
    lines = [f"{s['model']}: a {s['conversation_tokens']}-token conversation reopened, {s['prompt_tokens']}-token prompt"
             f" ({s['restored_tokens']} restored), {s['threads']} threads, {s['placement']}, {s['repeat']} turns each",
             "TTFT of the first new token:", *side_lines(doc["sides"], unit="s"),
             f"state file {z['state_file_bytes'] / 1e6:.1f} MB: {z['file_over_llama_state']:.5f} x llama.cpp's"
             f" serialized state, {z['file_over_kv']:.4f} x the KV cache of those tokens;"
             f" saving it took {doc['save_s']['median']:.2f} s"]
    o = doc["outputs"]
    lines.append("restored replies equal the in-memory conversation's token for token; the re-prefilled one"
                 f" agrees on {o['prefill_agreement']:.0%}" + ("" if o["prefill_first_divergence"] is None else
                                                              f" (first differs at token {o['prefill_first_divergence']})"))
    if doc["draft"]:
        d = doc["draft"]
        lines += [f"draft {s['draft']} ({d['state_file_bytes'] / 1e6:.1f} MB state):", *side_lines(d["sides"], unit="s")]
    return "\n".join(lines)


register(Scenario("resume", "a reopened long conversation's first-token latency, KV state restored vs"
                            " re-prefilled (goal <= 0.1)", add_args, measure, report))
