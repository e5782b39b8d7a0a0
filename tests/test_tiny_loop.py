"""The decode loop, speculation (self-draft and n-gram), KV bookkeeping and cancellation on the tiny
random-weight model (conftest's tiny_model): real llama.cpp, a model written by the test session,
through the public Runner API."""

from __future__ import annotations

import threading
from dataclasses import replace

import llama_cpp
import numpy as np
import pytest

from edgerun.decode import governor
from edgerun.decode.generate import Prefill, Step
from edgerun.decode.governor import Costs
from edgerun.decode.speculative import Round
from edgerun.runner import Runner
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings, SamplerSettings

GREEDY = SamplerSettings(temperature=0.0)
HOT = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
ENGINE = EngineSettings(n_ctx=512, n_batch=64, n_threads=1, gpu_layers="0")
PROMPT = [{"role": "user", "content": "def add(a, b): return a + b\ndef add(a, b): return a + b"}]
K = 4  # a fixed draft length: no governor, so no load-time timing decides what a test sees


def _runner(path, **spec) -> Runner:
    return Runner(path, ENGINE, spec_k=K if spec else None, **spec)


@pytest.fixture(scope="module")
def plain(tiny_model):
    with _runner(tiny_model) as r:
        yield r


@pytest.fixture(scope="module")
def self_draft(tiny_model):
    with _runner(tiny_model, draft=str(tiny_model)) as r:
        yield r


@pytest.fixture(scope="module")
def ngram(tiny_model):
    with _runner(tiny_model, ngram=True) as r:
        yield r


def _reply(runner, messages=PROMPT, sampling=GREEDY, max_tokens=48, cancel=None):
    records = list(runner.stream(runner.chat_tokens(messages), sampling, max_tokens=max_tokens, cancel=cancel))
    return records, [r for r in records if isinstance(r, Step)]


def _tokens(steps) -> list[int]:
    return [s.token for s in steps]


def cache_holds(ctx: Context) -> int:
    """How many positions llama.cpp's KV cache holds for sequence 0 (its own count, not ours)."""
    return llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(ctx.ptr), 0) + 1


def assert_cache_is_what_context_says(ctx: Context, model_path) -> None:
    """The context's token list is what the cache holds: as many positions, and the logits after
    re-running its last token match those of a fresh context fed the same tokens from scratch
    (to 0.02: an f16 cache filled by other batch shapes differs by about 0.002; one wrong token
    in the cache moves logits by about 1)."""
    tokens = list(ctx.tokens)
    assert cache_holds(ctx) == len(tokens)
    ctx.sync(tokens, need_logits=True)  # reuses all but the last position
    reused = np.array(ctx.logits())
    with Model(model_path) as model, Context(model, ENGINE) as fresh:
        fresh.eval(tokens)
        np.testing.assert_allclose(reused, fresh.logits(), rtol=0, atol=0.02)


def test_a_reply_is_the_stream_of_one_prefill_then_steps(plain):
    prompt = plain.chat_tokens(PROMPT)
    records, steps = _reply(plain, max_tokens=40)
    assert isinstance(records[0], Prefill) and records[0].prompt_tokens == len(prompt)
    assert len(steps) == 40 and steps[-1].finish == "length" and all(s.finish is None for s in steps[:-1])
    assert not any(s.from_draft for s in steps)
    text = "".join(s.text for s in steps)
    assert text == b"".join(plain.model.piece(t) for t in _tokens(steps)).decode(errors="replace")
    assert len(set(_tokens(steps))) > 5  # the untied random head gives varied tokens, not one repeated


def test_greedy_is_deterministic_and_a_cached_prompt_is_not_evaluated_again(plain):
    first, a = _reply(plain)
    again, b = _reply(plain)
    assert _tokens(a) == _tokens(b)
    assert first[0].evaluated >= 1 and again[0].evaluated == 1  # only the last token, for its logits


def test_seeded_sampling_repeats_and_the_seed_matters(plain):
    a = _tokens(_reply(plain, sampling=HOT)[1])
    b = _tokens(_reply(plain, sampling=HOT)[1])
    c = _tokens(_reply(plain, sampling=HOT.replace(seed=8))[1])
    assert a == b and a != c


def test_text_round_trips_through_the_tiny_vocabulary(plain):
    text = "def f(x):\n    return x * 2  # héllo wörld 🙂"
    tokens = plain.model.tokenize(text, add_special=False)
    assert b"".join(plain.model.piece(t) for t in tokens).decode() == text


@pytest.mark.parametrize("runner_name", ["self_draft", "ngram"])
def test_greedy_speculation_equals_plain_decoding_token_for_token(plain, runner_name, request):
    spec = request.getfixturevalue(runner_name)
    _, want = _reply(plain, max_tokens=64)
    records, got = _reply(spec, max_tokens=64)
    assert _tokens(got) == _tokens(want)
    rounds = [r for r in records if isinstance(r, Round)]
    assert sum(r.accepted for r in rounds) == sum(s.from_draft for s in got) > 0
    if runner_name == "self_draft":  # the target as its own draft: every proposal is the target's pick
        assert all(r.accepted == r.drafted for r in rounds)
        assert sum(r.drafted for r in rounds) > len(got) // 2


LONG = governor.K_MAX_NGRAM  # the n-gram drafter's longest round


@pytest.fixture(scope="module")
def long_ngram(tiny_model):
    """n-gram drafts of up to 64 tokens (a batch of 65 needs n_batch above 64)."""
    with Runner(tiny_model, ENGINE.replace(n_batch=128), ngram=True, spec_k=LONG) as r:
        yield r


def test_long_ngram_drafts_equal_plain_decoding_token_for_token(plain, long_ngram, tiny_model):
    _, want = _reply(plain, max_tokens=300)
    records, got = _reply(long_ngram, max_tokens=300)
    assert _tokens(got) == _tokens(want)
    rounds = [r for r in records if isinstance(r, Round) and r.drafted]
    assert max(r.drafted for r in rounds) == LONG  # proposals run as far as the earlier text goes
    assert max(r.accepted for r in rounds) > governor.K_MAX  # ... and long runs of them are right
    # every accepted draft is shown, but those of the last round past the token budget
    assert 0 <= sum(r.accepted for r in rounds) - sum(s.from_draft for s in got) <= rounds[-1].accepted
    assert_cache_is_what_context_says(long_ngram.ctx, tiny_model)


def test_sampled_long_ngram_drafts_leave_the_cache_as_recorded(long_ngram, tiny_model):
    """Above temperature 0, 64-token point-mass drafts are accepted with p(x) each and rejected
    at the first miss (the distribution itself: test_native_sampling's long-draft test)."""
    records, steps = _reply(long_ngram, sampling=HOT, max_tokens=300)
    rounds = [r for r in records if isinstance(r, Round) and r.drafted]
    assert max(r.drafted for r in rounds) == LONG and sum(r.accepted for r in rounds) > 0
    assert 0 <= sum(r.accepted for r in rounds) - sum(s.from_draft for s in steps) <= rounds[-1].accepted
    assert_cache_is_what_context_says(long_ngram.ctx, tiny_model)


@pytest.mark.parametrize("overlap", [False, True])
def test_long_ngram_drafts_verify_by_the_graphs_pick(plain, long_ngram, tiny_model, overlap, monkeypatch):
    """A greedy n-gram reply may let llama.cpp's graph pick (what a GPU holding the output layer
    does; forced here): rounds of up to 64 proposals then verify by each row's pick (on a GPU no
    logits come back), after a decode left in flight or not. The same tokens as plain decoding."""
    from edgerun.decode import generate as generate_module

    plans = []  # (k, picked, in flight) of each native round: the real call, watched
    real_round = generate_module._native.round

    def watched(plan, rng):
        plans.append((plan.k, plan.picked, plan.in_flight))
        return real_round(plan, rng)

    _, want = _reply(plain, max_tokens=300)
    monkeypatch.setattr(generate_module._native, "round", watched)
    base = long_ngram.spec_config
    long_ngram.spec_config = replace(base, device_greedy=True, overlap=overlap)
    try:
        records, got = _reply(long_ngram, max_tokens=300)
        assert long_ngram.ctx.picks_on_device
        assert _tokens(got) == _tokens(want)
        drafted = [(picked, in_flight) for k, picked, in_flight in plans if k > 0]
        assert drafted and all(picked for picked, _ in drafted)  # every round verified by the pick
        assert any(in_flight for _, in_flight in drafted) == overlap  # ... the in-flight decode's too
        rounds = [r for r in records if isinstance(r, Round) and r.drafted]
        assert max(r.drafted for r in rounds) == LONG and max(r.accepted for r in rounds) > governor.K_MAX
        assert any(r.accepted < r.drafted for r in rounds)  # a rejection picks the row's token
        long_ngram.ctx.greedy_on_device(False)  # the check below reads logits
        assert_cache_is_what_context_says(long_ngram.ctx, tiny_model)
        _reply(long_ngram, max_tokens=8)
        assert long_ngram.ctx.picks_on_device
        _reply(long_ngram, sampling=HOT, max_tokens=8)  # sampling needs the logits: the pick leaves the graph
        assert not long_ngram.ctx.picks_on_device
    finally:
        long_ngram.spec_config = base


def test_a_round_from_a_decode_in_flight_costs_the_governor_its_host_gap_too(ngram, monkeypatch):
    """A round that starts from a decode the last round left in flight finds it (nearly) done:
    that decode ran while the host handled the last round. The governor is taught the round's
    time plus that gap (its wall time), not the native call's alone, which on a GPU showed a
    plain step at a third of its cost. Forced here on the CPU, with a clock that the host's
    work between rounds moves by a known gap; without the overlap the native timing is taught
    as it is."""
    from edgerun.decode import generate as generate_module
    from edgerun.decode import speculative

    clock, gap = [1000.0], 0.25
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock[0])
    calls = []  # (started in flight, native seconds, tokens of plain steps) of each round
    real_round = generate_module._native.round

    def watched(plan, rng):
        clock[0] += gap  # the host's work between two rounds
        result = real_round(plan, rng)
        clock[0] += result.draft_s + result.verify_s
        calls.append((plan.in_flight, result.verify_s, 1 + len(result.more)))
        return result

    taught = []  # the seconds each governor update was given (a step's, or a drafted round's)
    real_update = governor.update

    def watched_update(state, **kw):
        taught.append(kw["verify_s"])
        return real_update(state, **kw)

    monkeypatch.setattr(generate_module._native, "round", watched)
    monkeypatch.setattr(speculative.governor, "update", watched_update)
    base = ngram.spec_config
    try:
        for overlap in (False, True):
            ngram.spec_config = replace(base, overlap=overlap)
            calls.clear()
            taught.clear()
            _reply(ngram, max_tokens=64)
            assert len(taught) == len(calls)  # one governor (the n-gram one), one update a round
            assert any(started for started, _, _ in calls[1:]) == overlap
            for i, ((started, native, steps), seconds) in enumerate(zip(calls, taught)):
                wall = native + (gap if started and i > 0 else 0.0)
                assert seconds * steps == pytest.approx(wall, abs=1e-9), (i, started, native, steps, seconds)
    finally:
        ngram.spec_config = base


def test_governed_ngram_drafts_equal_plain_decoding(plain, tiny_model):
    """The governor as a user gets it, from injected costs where batching is free (so it drafts
    long as soon as acceptance allows); what it then learns in the reply moves k, never the tokens."""
    free = Costs(tuple((n, 1e-4) for n in range(1, governor.K_MAX + 2)), draft_step_s=0.0)
    with Runner(tiny_model, ENGINE.replace(n_batch=128), ngram=True, costs={"ngram": free}) as r:
        _, want = _reply(plain, max_tokens=160)
        records, got = _reply(r, max_tokens=160)
        assert _tokens(got) == _tokens(want)
        assert any(x.drafted for x in records if isinstance(x, Round))


def test_sampled_self_draft_accepts_nearly_everything(self_draft):
    """Above temperature 0 the rejection rule accepts a draft with probability min(1, p/q); with
    p == q that is 1, so only the float difference between one decode and a batch can reject."""
    records, steps = _reply(self_draft, sampling=HOT, max_tokens=64)
    rounds = [r for r in records if isinstance(r, Round)]
    drafted, accepted = sum(r.drafted for r in rounds), sum(r.accepted for r in rounds)
    assert drafted > 20 and accepted >= 0.9 * drafted
    assert len(steps) == 64


@pytest.mark.parametrize("runner_name", ["plain", "self_draft", "ngram"])
def test_after_a_reply_the_context_says_what_the_cache_holds(tiny_model, runner_name, request):
    runner = request.getfixturevalue(runner_name)
    prompt = runner.chat_tokens(PROMPT)
    _, steps = _reply(runner, max_tokens=40)
    reply = list(runner.ctx.tokens)[len(prompt):]
    # the cache holds the prompt, then the reply: all but its newest token (not decoded yet), or
    # past its end the accepted drafts of the last round that the token budget cut off
    assert runner.ctx.tokens[: len(prompt)] == prompt
    n = min(len(reply), len(steps))
    assert reply[:n] == _tokens(steps)[:n] and len(steps) - 1 <= len(reply) <= len(steps) + K
    assert_cache_is_what_context_says(runner.ctx, tiny_model)
    if runner.draft_ctx is not None:
        assert_cache_is_what_context_says(runner.draft_ctx, tiny_model)


class _CancelAfter:
    """Sets the cancel event once `n` steps were seen (the consumer's side, as the TUI does)."""

    def __init__(self, n: int):
        self.n, self.event = n, threading.Event()

    def watch(self, records):
        seen = 0
        for r in records:
            if isinstance(r, Step):
                seen += 1
                if seen == self.n:
                    self.event.set()
            yield r


@pytest.mark.parametrize("runner_name", ["plain", "self_draft", "ngram"])
def test_a_cancelled_reply_stops_and_leaves_a_cache_the_next_reply_can_use(tiny_model, runner_name, request):
    runner = request.getfixturevalue(runner_name)
    stop = _CancelAfter(10)
    prompt = runner.chat_tokens(PROMPT)
    stream = runner.stream(prompt, GREEDY, max_tokens=200, cancel=stop.event)
    steps = [r for r in stop.watch(stream) if isinstance(r, Step)]
    assert steps[-1].finish == "cancelled"
    assert 10 <= len(steps) <= 10 + K + 1  # the round in progress finishes its own tokens
    assert_cache_is_what_context_says(runner.ctx, tiny_model)
    if runner.draft_ctx is not None:
        assert_cache_is_what_context_says(runner.draft_ctx, tiny_model)
    # the next turn extends the cancelled one; it equals a fresh runner's answer to the same tokens
    turn = prompt + _tokens(steps) + runner.chat_tokens([{"role": "user", "content": "again"}])
    got = [r for r in runner.stream(turn, GREEDY, max_tokens=24) if isinstance(r, Step)]
    with _runner(tiny_model) as fresh:
        want = [r for r in fresh.stream(turn, GREEDY, max_tokens=24) if isinstance(r, Step)]
    assert _tokens(got) == _tokens(want)


def test_a_reply_ends_where_the_context_ends(tiny_model):
    with Runner(tiny_model, ENGINE.replace(n_ctx=128), draft=str(tiny_model), spec_k=K) as r:
        prompt = r.chat_tokens(PROMPT)
        steps = [s for s in r.stream(prompt, GREEDY, max_tokens=1000) if isinstance(s, Step)]
        assert steps[-1].finish == "length" and len(prompt) + len(steps) < r.ctx.n_ctx  # llama.cpp pads to 256
        assert cache_holds(r.ctx) <= r.ctx.n_ctx


def _watch_rounds(monkeypatch) -> list[tuple[int, int, int]]:
    """(k, plain_steps, tokens made) of each native round from now on: the real call, watched."""
    from edgerun.decode import generate as generate_module

    plans, real_round = [], generate_module._native.round

    def watched(plan, rng):
        result = real_round(plan, rng)
        plans.append((plan.k, plan.plain_steps, result.accepted + 1 + len(result.more)))
        return result

    monkeypatch.setattr(generate_module._native, "round", watched)
    return plans


def test_ngram_replies_decode_plain_stretches_where_no_proposal_can_come(plain, ngram, tiny_model, monkeypatch):
    """Between proposals the n-gram path decodes several plain tokens in one native call, up to
    where the drafter could first find a match the governor drafts on; with a fixed k any match
    drafts, so a stretch is two tokens, after one that never occurred before. The same tokens
    as plain decoding, and no token of a stretch but its last could have been drafted on. The
    governor as a user gets it (costs timed at load) stretches too."""
    from edgerun.decode.ngram import NgramDrafter

    _, want = _reply(plain, max_tokens=200)
    plans = _watch_rounds(monkeypatch)
    records, got = _reply(ngram, max_tokens=200)
    assert _tokens(got) == _tokens(want)
    assert len([r for r in records if isinstance(r, Round)]) == len(plans)
    assert sum(r.drafted for r in records if isinstance(r, Round)) > 0
    stretches = [(at, made) for at, (k, steps, made) in zip(np.cumsum([0] + [p[2] for p in plans]), plans)
                 if k == 0 and steps > 1]
    assert stretches and all(made <= 2 for _, made in stretches)
    text = ngram.chat_tokens(PROMPT) + _tokens(got)
    first = len(text) - len(got)  # the reply's first token, picked from the prompt's logits
    for at, made in stretches:
        for j in range(1, made):  # the stretch's tokens but its last: none was looked up
            d = NgramDrafter()
            d.reset(text[: first + 1 + at + j])
            assert d.lookup(K).tokens == []
    plans.clear()
    with Runner(tiny_model, ENGINE, ngram=True) as governed:
        _, got = _reply(governed, max_tokens=200)
    assert _tokens(got) == _tokens(want)
    assert any(k == 0 and steps > 1 for k, steps, _ in plans)
