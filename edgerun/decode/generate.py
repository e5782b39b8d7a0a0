"""The one decode loop. Every consumer (CLI, TUI, bench, tests) reads the same stream:
a Prefill record, then Steps (one per token) with a Round record after each round's tokens."""

from __future__ import annotations

import codecs
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from edgerun import _native
from edgerun.decode import governor
from edgerun.decode.governor import GovernorMemory
from edgerun.decode.ngram import NgramPool
from edgerun.decode.speculative import Round, SpecConfig, Speculator
from edgerun.errors import ConfigError, EngineError
from edgerun.runtime.engine import Context
from edgerun.settings import SamplerSettings


@dataclass(frozen=True)
class Step:
    """One generated token, as the user sees it."""

    text: str  # decoded text this token completes (may be "" mid UTF-8 character)
    token: int
    from_draft: bool  # an accepted draft proposal (vs the target's own pick)
    t: float  # seconds since generation started
    finish: str | None = None  # "stop" (end of generation), "length", "cancelled" on the last step


@dataclass(frozen=True)
class Prefill:
    """First record of a stream: how the prompt was evaluated."""

    prompt_tokens: int
    evaluated: int  # tokens actually run (the rest were reused from the KV cache)
    seconds: float


@contextlib.contextmanager
def native_errors(what: str, fix: str = "start a new conversation, or run with -v to see llama.cpp's log"):
    """The boundary to the native extension: what it raises (std::runtime_error and
    std::invalid_argument arrive as RuntimeError and ValueError; an argument pybind11 cannot
    convert as TypeError) becomes an EngineError that says what failed and what to do."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError) as exc:
        raise EngineError(f"llama.cpp failed while {what} ({exc}); {fix}") from exc


def native_params(s: SamplerSettings) -> _native.SamplerParams:
    p = _native.SamplerParams()
    with native_errors("taking the sampler settings", "check temperature, top-k, top-p and min-p"):
        p.temperature, p.top_k, p.top_p, p.min_p = s.temperature, s.top_k, s.top_p, s.min_p
        p.repeat_penalty, p.repeat_last_n = s.repeat_penalty, s.repeat_last_n
    return p


def native_rng(seed: int | None) -> _native.Rng:
    with native_errors("seeding the sampler", "use a seed from 0 to 2**64 - 1"):
        return _native.Rng(seed if seed is not None else random.getrandbits(64))


def first_pick(ctx: Context, history: list[int], params: _native.SamplerParams, rng: _native.Rng,
               grammar: _native.Grammar | None = None) -> int:
    """The token the prompt's last logits choose (under the grammar, which then stands after it)."""
    with native_errors("sampling the first token"):
        return _native.sample_context(ctx.address, -1, history, params, rng, grammar)


def native_round(plan: _native.RoundPlan, rng: _native.Rng) -> _native.RoundResult:
    """One native speculation round (see native/round.hpp)."""
    with native_errors("decoding a round of tokens"):
        return _native.round(plan, rng)


class _Emitter:
    """Turns tokens into Steps: UTF-8 reassembly, EOG, token budget and cancellation."""

    def __init__(self, ctx: Context, max_tokens: int, cancel: threading.Event | None, start: float):
        self.model, self.max_tokens, self.cancel, self.start = ctx.model, max_tokens, cancel, start
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.count = 0
        self.done = False

    def step(self, token: int, from_draft: bool) -> Step:
        now = time.perf_counter() - self.start
        if self.model.is_eog(token):
            self.done = True
            return Step(self.decoder.decode(b"", final=True), token, from_draft, now, "stop")
        self.count += 1
        text = self.decoder.decode(self.model.piece(token))
        finish = None
        if self.count >= self.max_tokens:
            finish = "length"
        elif self.cancel is not None and self.cancel.is_set():
            finish = "cancelled"
        if finish:
            self.done = True
            text += self.decoder.decode(b"", final=True)
        return Step(text, token, from_draft, now, finish)


def generate(
    ctx: Context,
    prompt: list[int],
    sampling: SamplerSettings,
    *,
    max_tokens: int,
    cancel: threading.Event | None = None,
    spec_config: SpecConfig | None = None,
    memory: GovernorMemory | None = None,
    seq: int = 0,
    rng: _native.Rng | None = None,
    grammar: _native.Grammar | None = None,
    pool: NgramPool | None = None,
) -> Iterator[Prefill | Step | Round]:
    """Evaluate the prompt, then decode up to max_tokens tokens, yielding each as it is ready.
    `memory`: what the governors learned in earlier replies (the runner's), updated in place.
    `seq`: the context's sequence to decode in. `rng`: the sampler's random stream (default: one
    seeded from sampling.seed), which a caller that goes on decoding the reply itself passes in.
    `grammar`: a constraint's state (decode/constrain.py) before the reply's first token; every
    token is picked under it, drafted ones too, and it advances along each token yielded.
    `pool`: tokens from outside the conversation the n-gram drafter may also draft from.
    Closed between rounds, the context holds the prompt and every token yielded but the last."""
    if not prompt:  # e.g. `--raw ""` with a model that adds no BOS: no logits to pick from
        raise ConfigError("the prompt has no tokens, so there is nothing to continue; give some text")
    # the reply ends ("length") where the context would overflow: a verify batch writes the
    # newest token and up to K_MAX drafts past the last recorded one
    room = ctx.n_ctx - len(prompt) - governor.K_MAX
    if room < 1:
        raise ConfigError(f"the prompt has {len(prompt)} tokens and the context holds {ctx.n_ctx}, leaving no room"
                          " for a reply; start a new conversation or raise --ctx")
    max_tokens = min(max_tokens, room)
    start = time.perf_counter()
    params = native_params(sampling)
    rng = rng or native_rng(sampling.seed)
    speculator = Speculator(spec_config or SpecConfig(), ctx, prompt, sampling, params, memory=memory, seq=seq,
                            grammar=grammar, pool=pool)
    speculator.settle_sampler()  # before the prompt: its last output is the first pick
    evaluated = ctx.prefill(prompt, seq)
    yield Prefill(len(prompt), evaluated, time.perf_counter() - start)
    emit = _Emitter(ctx, max_tokens, cancel, start)
    last = first_pick(ctx, sampling.penalty_window(ctx.held(seq)), params, rng, grammar)
    yield emit.step(last, False)
    try:
        while not emit.done:
            result = native_round(speculator.plan(last, remaining=max_tokens - emit.count), rng)
            # the bookkeeping first: the round may have left its newest token's decode in flight
            record = speculator.after(result)
            for token in result.drafts[: result.accepted]:
                yield emit.step(token, True)
                if emit.done:
                    break
            own = [result.next, *result.more]  # the target's picks; more: a plain run's later tokens
            for token in own:
                if emit.done:
                    break
                yield emit.step(token, False)
            yield record
            last = own[-1]
    finally:
        speculator.finish()
