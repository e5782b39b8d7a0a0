"""The one decode loop. Every consumer (CLI, TUI, bench, tests) reads the same stream of Steps."""

from __future__ import annotations

import codecs
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from edgerun.decode.sampling import Sampler
from edgerun.runtime.engine import Context
from edgerun.settings import SamplerSettings


@dataclass(frozen=True)
class Step:
    """One generated token, as the user sees it."""

    text: str  # decoded text this token completes (may be "" mid UTF-8 character)
    token: int
    from_draft: bool
    t: float  # seconds since generation started
    finish: str | None = None  # "stop" (end of generation), "length", "cancelled" on the last step


@dataclass(frozen=True)
class Prefill:
    """First record of a stream: how the prompt was evaluated."""

    prompt_tokens: int
    evaluated: int  # tokens actually run (the rest were reused from the KV cache)
    seconds: float


def generate(
    ctx: Context,
    prompt: list[int],
    sampling: SamplerSettings,
    *,
    max_tokens: int,
    cancel: threading.Event | None = None,
) -> Iterator[Prefill | Step]:
    """Evaluate the prompt, then sample up to max_tokens tokens, yielding as each one is ready."""
    model = ctx.model
    start = time.perf_counter()
    evaluated = ctx.prefill(prompt)
    yield Prefill(len(prompt), evaluated, time.perf_counter() - start)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with Sampler(sampling) as sampler:
        for n in range(1, max_tokens + 1):
            token = sampler.sample(ctx.ptr)
            now = time.perf_counter() - start
            if model.is_eog(token):
                yield Step(decoder.decode(b"", final=True), token, False, now, "stop")
                return
            text = decoder.decode(model.piece(token))
            if n == max_tokens or (cancel is not None and cancel.is_set()):
                finish = "length" if n == max_tokens else "cancelled"
                yield Step(text + decoder.decode(b"", final=True), token, False, now, finish)
                ctx.eval([token])  # keep the cache equal to the transcript for the next turn
                return
            yield Step(text, token, False, now)
            ctx.eval([token])
