"""Speculative decoding on the real models: exactness at temperature 0, the target's
distribution at temperature > 0, KV bookkeeping, and vocabulary checks."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgerun.decode import governor
from edgerun.decode.generate import Step, generate
from edgerun.decode.governor import Costs, Kind
from edgerun.decode.speculative import Round, SpecConfig
from edgerun.errors import VocabMismatch
from edgerun.runner import NGRAM_SIZES, Runner, chat_tokens
from edgerun.runtime.engine import Context, Model
from edgerun.runtime.vocab import check_pair
from edgerun.settings import EngineSettings, SamplerSettings

pytestmark = pytest.mark.slow

GREEDY = SamplerSettings(temperature=0.0)
SETTINGS = EngineSettings(n_ctx=2048, gpu_layers="0")
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "Rewrite with type hints, change nothing else:\ndef area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n",
]


def _user(text):
    return [{"role": "user", "content": text}]


def _run(ctx, tokens, sampling, n, spec_config=None, memory=None):
    records = list(generate(ctx, tokens, sampling, max_tokens=n, spec_config=spec_config, memory=memory))
    steps = [r for r in records if isinstance(r, Step)]
    rounds = [r for r in records if isinstance(r, Round)]
    return [s.token for s in steps], steps, rounds


@pytest.fixture(scope="module")
def small(small_model):
    with Model(small_model) as model, Context(model, SETTINGS) as ctx, Context(model, SETTINGS) as ctx2:
        yield model, ctx, ctx2


def test_target_as_its_own_draft_accepts_everything_and_equals_plain(small):
    model, ctx, draft = small
    tokens = chat_tokens(model, _user(PROMPTS[0]))
    plain, _, _ = _run(ctx, tokens, GREEDY, 48)
    ctx.trim(0)
    spec, steps, rounds = _run(ctx, tokens, GREEDY, 48, SpecConfig(draft=draft, k=4))
    assert spec == plain
    drafted = sum(r.drafted for r in rounds)
    assert drafted > 30 and sum(r.accepted for r in rounds) == drafted
    assert any(s.from_draft for s in steps)


def _gap_and_noise(ctx, prefix, tail=6):
    """At the end of `prefix`: the target's top-two logit gap, and how far its logits move
    between one batched evaluation and token-by-token evaluation of the last `tail` tokens."""
    ctx.trim(0)
    ctx.eval(prefix)
    batched = ctx.logits(-1).astype(np.float64)
    ctx.trim(len(prefix) - tail)
    for token in prefix[-tail:]:
        ctx.eval([token])
    single = ctx.logits(-1).astype(np.float64)
    top = np.sort(single)
    return top[-1] - top[-2], float(np.max(np.abs(batched - single)))


def test_real_pair_at_temperature_zero_equals_plain(target_model, small_model):
    with Runner(target_model, SETTINGS, draft=str(small_model), spec_k=4) as r:
        for prompt in PROMPTS:
            tokens = r.chat_tokens(_user(prompt))
            r.ctx.trim(0)
            plain, _, _ = _run(r.ctx, tokens, GREEDY, 40)
            r.ctx.trim(0)
            spec, _, rounds = _run(r.ctx, tokens, GREEDY, 40, r.spec_config)
            assert sum(x.drafted for x in rounds) > 0
            if spec != plain:
                # batched and single-token evaluation may differ in the last bits: only allowed
                # where the target's top two logits are within that noise
                i = next(i for i, (a, b) in enumerate(zip(spec, plain)) if a != b)
                gap, noise = _gap_and_noise(r.ctx, tokens + plain[:i])
                print(f"{prompt[:30]!r}: diverged at {i}, top-two gap {gap:.4f}, batch noise {noise:.4f}")
                assert gap <= 2 * noise, f"diverged at token {i}: top-two gap {gap:.4f}, batch noise {noise:.4f}"


def _cache_holds(ctx, model, sequence, n_prompt):
    """Whether ctx's KV cache holds exactly sequence[:ctx.n_past]: the logits after one more token
    match a fresh evaluation within the kernels' own rounding (batched vs token by token)."""
    n = ctx.n_past
    ctx.eval([sequence[n]])
    cached = ctx.logits(-1).copy()
    with Context(model, SETTINGS) as fresh:
        fresh.eval(sequence[: n + 1])
        batched = fresh.logits(-1).copy()
        fresh.trim(n_prompt)
        for token in sequence[n_prompt : n + 1]:
            fresh.eval([token])
        stepwise = fresh.logits(-1).copy()
    # a stale or missing KV entry moves logits by whole units; evaluation order only by the
    # kernels' rounding, which the two fresh evaluations measure
    noise = float(np.max(np.abs(batched - stepwise)))
    return float(np.max(np.abs(cached - stepwise))) <= 2 * noise + 0.02 and int(np.argmax(cached)) == int(np.argmax(stepwise))


@pytest.mark.parametrize("stable_shapes", [False, True])
def test_kv_cache_after_many_rejections_matches_a_fresh_evaluation(target_model, small_model, stable_shapes):
    """Both caches, with the draft fed in one batch or token by token (stable_shapes, as on a GPU)."""
    hot = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    with Runner(target_model, SETTINGS, draft=str(small_model), spec_k=5) as r:
        spec = replace(r.spec_config, stable_shapes=stable_shapes)
        tokens = r.chat_tokens(_user("Tell me a story about a dragon and a librarian."))
        out, _, rounds = _run(r.ctx, tokens, hot, 60, spec)
        assert sum(x.drafted - x.accepted for x in rounds) >= 5  # rejected drafts were trimmed
        sequence = tokens + out
        assert r.ctx.tokens == sequence[: r.ctx.n_past]  # the bookkeeping says what the cache holds...
        assert _cache_holds(r.ctx, r.model, sequence, len(tokens))  # ...and the cache holds exactly that
        # the draft's cache: the committed tokens it shares, then its own unverified drafts
        draft = r.draft_ctx
        keep = draft.shared_prefix(sequence)
        assert keep >= len(sequence) - 8
        draft.trim(keep)
        assert _cache_holds(draft, r.draft_model, sequence, len(tokens))


def test_stable_shapes_evaluate_every_draft(small):
    """Fed token by token, the draft also evaluates its last draft: after a fully accepted round
    its cache holds everything the target's does, so the next round feeds one token."""
    model, ctx, draft = small
    tokens = chat_tokens(model, _user(PROMPTS[0]))
    ctx.trim(0)
    plain, _, _ = _run(ctx, tokens, GREEDY, 40)
    ctx.trim(0)
    draft.trim(0)
    spec, _, rounds = _run(ctx, tokens, GREEDY, 40, SpecConfig(draft=draft, k=4, stable_shapes=True))
    assert spec == plain and sum(x.drafted for x in rounds) > 25
    assert rounds[-1].drafted == rounds[-1].accepted and draft.tokens == ctx.tokens


def test_other_vocab_draft_is_refused_before_loading(target_model, other_vocab_model):
    with pytest.raises(VocabMismatch, match="vocab"):
        check_pair(target_model, other_vocab_model)
    with pytest.raises(VocabMismatch):
        Runner(target_model, SETTINGS, draft=str(other_vocab_model))


def test_same_family_pair_passes_the_vocab_check(target_model, small_model):
    check_pair(target_model, small_model)


def test_ngram_drafter_on_a_copy_task_accepts_and_stays_exact(small):
    model, ctx, _ = small
    tokens = chat_tokens(model, _user((Path(__file__).parent / "data" / "code_edit.txt").read_text()))
    ctx.trim(0)
    plain, _, _ = _run(ctx, tokens, GREEDY, 160)
    ctx.trim(0)
    # a fixed k: on a 2-core CPU the governor's call for n-gram drafts is close (a 3-token verify
    # costs about 2.5 plain steps), so how often it drafts follows timing noise; its choices are
    # tested in test_governor.py, the drafter's proposals here
    spec, _, rounds = _run(ctx, tokens, GREEDY, 160, SpecConfig(ngram=True, k=4))
    assert spec == plain
    ngram = [r for r in rounds if r.drafter == "ngram"]
    accepted, drafted = sum(r.accepted for r in ngram), sum(r.drafted for r in ngram)
    assert accepted >= 40 and accepted / drafted > 0.7  # the reply repeats the prompt


def test_ngram_rounds_verify_after_a_decode_left_in_flight(small, monkeypatch):
    """On a GPU each plain step of an n-gram reply ends by launching its token's decode (forced
    here on the CPU), and a round of proposals verifies after it: that decode's logits row checks
    the first proposal, the batch holds only the proposals. A drafted round ends the same way:
    it trims its rejected drafts and launches its last token's decode. The same tokens as without
    the overlap, at T=0 (= plain) and at T=0.7 with one seed, and the KV holds exactly the reply."""
    import llama_cpp

    from edgerun.decode import generate as generate_module

    model, ctx, _ = small
    seen = []  # (k, started in flight, left in flight) of each native round: the real call, watched
    drafted = []  # (drafts, accepted, dropped, left in flight) of each drafted round with the overlap
    real_round = generate_module._native.round

    def watched(plan, rng):
        result = real_round(plan, rng)
        seen.append((plan.k, plan.in_flight, result.target.in_flight))
        if result.drafts and plan.overlap:
            ends = model.is_eog(result.next)  # nothing to decode after the reply's end
            drafted.append((len(result.drafts), result.accepted, result.target.dropped, result.target.in_flight or ends))
        return result

    monkeypatch.setattr(generate_module._native, "round", watched)
    tokens = chat_tokens(model, _user((Path(__file__).parent / "data" / "code_edit.txt").read_text()))
    ctx.trim(0)
    plain, _, _ = _run(ctx, tokens, GREEDY, 96)
    for sampling in (GREEDY, SamplerSettings(temperature=0.7, seed=5)):
        replies = {}
        for overlap in (False, True):
            ctx.trim(0)
            seen.clear()
            replies[overlap], _, _ = _run(ctx, tokens, sampling, 96, SpecConfig(ngram=True, k=4, overlap=overlap))
            assert llama_cpp.llama_memory_seq_pos_max(ctx.mem, 0) == ctx.n_past - 1
            assert any(k > 0 and started for k, started, _ in seen) == overlap, seen
            assert any(left for _, _, left in seen) == overlap
        assert replies[True] == replies[False]
        if sampling is GREEDY:
            assert replies[True] == plain
    # drafted rounds left their last token's decode in flight, those that rejected drafts too
    # (trimmed in the round: their write drops nothing)
    assert drafted and all(left and dropped == 0 for _, _, dropped, left in drafted), drafted
    assert any(accepted < n for n, accepted, _, _ in drafted), drafted
    # asked to stop while a decode is in flight (the next round may start from it), the reply
    # leaves a usable context: the KV holds what was recorded
    cancel = threading.Event()
    ctx.trim(0)
    seen.clear()
    ahead = SpecConfig(ngram=True, k=4, overlap=True)
    steps = []
    for r in generate(ctx, tokens, GREEDY, max_tokens=96, cancel=cancel, spec_config=ahead):
        if isinstance(r, Step):
            steps.append(r)
        if seen and seen[-1][2]:  # the round behind this token left a decode in flight
            cancel.set()
    assert steps[-1].finish == "cancelled" and len(steps) < 96
    assert llama_cpp.llama_memory_seq_pos_max(ctx.mem, 0) == ctx.n_past - 1
    ctx.trim(0)
    assert _run(ctx, tokens, GREEDY, 96, ahead)[0] == plain


def test_the_mirror_of_captured_graphs_counts_every_token_llama_cpp_decoded(small):
    """Where graphs are in play (forced here on the CPU, with the GPU's overlap) the context counts
    each decode's shape: its evals and each native round's, from what the round reports (drafts
    verified with `last` or after its decode in flight, plain steps, the decode it leaves in
    flight). Their tokens add up to what llama.cpp's own counters say it decoded. The first
    round of a size is cold (it ran uncaptured), a size run twice before at that KV length is
    not, and the governor's pricing of cold sizes leaves a T=0 reply what plain decoding makes."""
    import llama_cpp

    from edgerun.runtime.graphs import CapturedGraphs

    model, ctx, _ = small
    tokens = chat_tokens(model, _user((Path(__file__).parent / "data" / "code_edit.txt").read_text()))
    ctx.trim(0)
    plain, _, _ = _run(ctx, tokens, GREEDY, 96)
    try:
        for k in (4, None):  # fixed: the same size again and again; governed: priced by the mirror
            ctx.trim(0)
            ctx.graphs = CapturedGraphs(ctx.n_ctx, kept=10**6)
            llama_cpp.llama_perf_context_reset(ctx.ptr)
            reply, _, rounds = _run(ctx, tokens, GREEDY, 96, SpecConfig(ngram=True, k=k, overlap=True))
            ctx.land(0)  # the last decode left in flight is done (and counted) before the counters are read
            perf = llama_cpp.llama_perf_context(ctx.ptr)
            counted = sum(shape[0] * runs for shape, runs in ctx.graphs.runs().items())
            assert counted == perf.n_p_eval + perf.n_eval, (k, counted, perf.n_p_eval, perf.n_eval)
            assert reply == plain
            drafted = [r for r in rounds if r.drafted]
            assert drafted[0].cold, "a size's first round runs uncaptured"
            if k == 4:
                assert not all(r.cold for r in drafted), "a size run twice before at its KV length replays"
    finally:
        ctx.graphs = None
        ctx.trim(0)


def test_rejection_rule_accepts_more_than_sample_and_compare(target_model, small_model):
    """Same prompts, seeds and sampler at T=0.7 with the real pair: the rejection rule keeps a
    draft token with probability min(1, p/q); sample-and-compare (llama.cpp's server) only when
    the target's own sample equals it, which is rarer."""
    warm = SamplerSettings(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)
    rates = {}
    with Runner(target_model, SETTINGS, draft=str(small_model), spec_k=4) as r:
        for rule in ("rejection", "match"):
            acc = drafted = 0
            for seed, prompt in enumerate(PROMPTS):
                r.ctx.trim(0)
                spec = SpecConfig(draft=r.draft_ctx, k=4, rule=rule)
                _, _, rounds = _run(r.ctx, r.chat_tokens(_user(prompt)), warm.replace(seed=seed + 1), 40, spec)
                acc += sum(x.accepted for x in rounds)
                drafted += sum(x.drafted for x in rounds)
            rates[rule] = acc / drafted
    print(f"acceptance at T=0.7: rejection rule {rates['rejection']:.3f}, sample-and-compare {rates['match']:.3f}")
    assert rates["rejection"] > rates["match"]


def test_the_draft_context_gets_the_threads_its_placement_calls_for(small_model):
    """llama.cpp's own count read back from the draft's context: every thread for a draft on the
    CPU, one for a draft all on the GPU (placement.draft_threads), the target keeps its count."""
    import llama_cpp

    settings = SETTINGS.replace(n_threads=2, gpu_layers="auto")
    with Runner(small_model, settings, draft=str(small_model), spec_k=2) as r:
        expected = 1 if r.plan.draft.all_on_gpu else 2
        assert llama_cpp.llama_n_threads(r.draft_ctx.ptr) == expected, r.plan.draft
        assert llama_cpp.llama_n_threads_batch(r.draft_ctx.ptr) == expected
        assert llama_cpp.llama_n_threads(r.ctx.ptr) == 2


# Costs injected as the governor's starting point, so no assertion depends on how fast this machine
# is: a load-time timing (Runner(costs=...) replaces it) never decides a test. Seconds per batch.
CHEAP_VERIFY = tuple((n, 1e-4) for n in range(1, governor.K_MAX + 2))  # batching is free
# a draft that cannot win however fast or slow the machine's real plain step (which a reply times
# in place of the load-time one): verifies of 100 s and more, draft steps of 10 s
HOPELESS = Costs(((1, 0.03),) + tuple((n, 100.0 * n) for n in range(2, governor.K_MAX + 2)),
                 draft_step_s=10.0, catch_up_s=0.01)
# a plain step "timed" at 1000 s at load: drafting looks good until one real plain step is timed,
# and then no acceptance can win (verifies of 100 s, draft steps of 10 s), however fast the machine
SLOW_PLAIN_AT_LOAD = Costs(((1, 1000.0),) + tuple((n, 100.0) for n in range(2, governor.K_MAX + 2)),
                           draft_step_s=10.0, catch_up_s=1.0)


def _favour_the_draft(state):
    """The state made to favour drafting whatever was measured: near-free drafts and verifies."""
    plain = dict(state.verify_s)[1]
    return replace(state, alpha=0.99, draft_step_s=plain * 1e-6,
                   verify_s=tuple((n, t if n == 1 else plain * 1.01) for n, t in state.verify_s))


def test_an_ngram_runner_knows_its_costs_before_the_first_reply(small_model):
    """With --ngram the runner times every verify batch at load, and a reply starts from what the
    governor knows: the first match is drafted at the length the costs favour, not spent on
    measuring rounds (the costs are injected, so the machine's speed decides nothing)."""
    code = (Path(__file__).parent / "data" / "code_edit.txt").read_text()
    with Runner(small_model, SETTINGS, draft="none", ngram=True) as r:
        state = r.governors.get("ngram")
        assert "model" not in r.governors
        sizes = set(range(1, governor.K_MAX + 2)) | set(NGRAM_SIZES)  # and whole blocks for long copies
        assert state.draft_step_s == 0.0 and dict(state.verify_s).keys() == sizes
        r.governors.put("ngram", governor.from_costs(Costs(CHEAP_VERIFY, draft_step_s=0.0), warm_rounds=1))
        _, _, rounds = _run(r.ctx, r.chat_tokens(_user(code)), GREEDY, 64, r.spec_config, r.governors)
        drafted = [x for x in rounds if x.drafter == "ngram" and x.drafted]
        # a measuring round that tries a longer k still drafts; one that only times plain decoding does not
        idle = [x.decision for x in rounds if x.decision.kind is Kind.MEASURE and x.decision.k == 0]
        assert drafted and len(idle) <= 1, [x.decision for x in rounds]


def test_the_runner_times_a_model_drafts_costs_at_load(small_model):
    with Runner(small_model, SETTINGS, draft=str(small_model)) as r:
        state = r.governors.get("model")
        assert state.draft_step_s > 0 and state.catch_up_s > 0
        assert dict(state.verify_s).keys() == set(range(1, governor.K_MAX + 2)) and state.plain_from_load


def test_a_draft_that_cannot_win_is_judged_at_load_and_never_run(small_model):
    """The model as its own draft: a draft step costs a target step, so no k can beat plain
    decoding. With those costs known at load, the first reply must not spend a single draft
    decode (not even the draft's prompt prefill), and its rounds say why."""
    with Runner(small_model, SETTINGS, draft=str(small_model), costs={"model": HOPELESS}) as r:
        assert governor.given_up(r.governors.get("model")).kind is Kind.HOPELESS
        tokens, _, rounds = _run(r.ctx, r.chat_tokens(_user(PROMPTS[0])), GREEDY, 32, r.spec_config, r.governors)
        assert len(tokens) == 32
        assert r.draft_ctx.n_past == 0 and sum(x.drafted for x in rounds) == 0, [x.decision for x in rounds]
        assert {x.decision.kind for x in rounds} == {Kind.HOPELESS}
        # once the governor gave up on the draft, plain steps may pick in llama.cpp's graph (what
        # a GPU does; forced here), with the same tokens as the host's argmax
        plain, _, _ = _run(r.ctx, r.chat_tokens(_user(PROMPTS[1])), GREEDY, 40, SpecConfig())
        assert not r.ctx.picks_on_device
        forced = replace(r.spec_config, device_greedy=True)
        switches, records = _sampler_switches(r, r.chat_tokens(_user(PROMPTS[1])), 40, forced)
        picked = [x.token for x in records if isinstance(x, Step)]
        assert picked == plain and r.ctx.picks_on_device
        # the costs ruled the draft out before the reply began: the sampler settled before the
        # prompt, once, and never mid-reply (a switch rebuilds llama.cpp's scheduler)
        assert [on for on, seen in switches if seen] == [] and [on for on, _ in switches] == [True], switches
        _run(r.ctx, r.chat_tokens(_user(PROMPTS[1])), GREEDY.replace(temperature=0.5), 4, forced, r.governors)
        assert not r.ctx.picks_on_device  # sampling needs the logits


def _sampler_switches(r, tokens, n, spec_config, each=None):
    """Run a greedy reply on the runner's context and record each call of its real
    greedy_on_device: (on, whether a record of the reply had been yielded by then). `each` sees
    the records so far after each one."""
    ctx, calls, records = r.ctx, [], []
    real = ctx.greedy_on_device

    def spy(on):
        calls.append((on, bool(records)))
        return real(on)

    ctx.greedy_on_device = spy
    try:
        for record in generate(ctx, tokens, GREEDY, max_tokens=n, spec_config=spec_config, memory=r.governors):
            records.append(record)
            if each:
                each(records)
    finally:
        del ctx.greedy_on_device
    return calls, records


def test_a_draft_given_up_mid_reply_leaves_the_sampler_alone(small_model):
    """Load-time costs that make the draft look good (a plain step 'timed' at 1000 s) keep it in
    play until a real plain step is timed; then the costs rule it out mid-reply. From there the
    reply decodes plain to its end, even when later costs would favour the draft (made near free
    right after the give-up), and its sampler stays as it was before the prompt: switching it
    rebuilds llama.cpp's scheduler and, on a GPU, recaptures every graph."""
    with Runner(small_model, SETTINGS, draft=str(small_model), costs={"model": SLOW_PLAIN_AT_LOAD}) as r:
        assert governor.given_up(r.governors.get("model")) is None
        plain, _, _ = _run(r.ctx, r.chat_tokens(_user(PROMPTS[0])), GREEDY, 64, SpecConfig())
        forced = replace(r.spec_config, device_greedy=True)
        favoured = []

        def favour_the_draft_once_given_up(records):
            if not favoured and isinstance(records[-1], Round) and records[-1].decision.gives_up:
                r.governors.put("model", _favour_the_draft(r.governors.get("model")))
                assert governor.given_up(r.governors.get("model")) is None  # the draft now looks good
                favoured.append(len(records))

        switches, records = _sampler_switches(r, r.chat_tokens(_user(PROMPTS[0])), 64, forced,
                                              each=favour_the_draft_once_given_up)
        rounds = [x for x in records if isinstance(x, Round)]
        assert favoured and any(isinstance(x, Round) for x in records[favoured[0]:]), "rounds after the give-up"
        assert [x.token for x in records if isinstance(x, Step)] == plain
        first, last = rounds[0].decision, rounds[-1].decision
        assert (first.kind, first.k) == (Kind.MEASURE, 0) and last.kind is Kind.HOPELESS, rounds
        assert sum(x.drafted for x in rounds) == 0 and r.draft_ctx.n_past == 0, [x.decision for x in rounds]
        assert [on for on, seen in switches if seen] == [] and not r.ctx.picks_on_device, switches


def test_a_draft_given_up_stays_off_when_later_timings_favour_it(small_model):
    """Given up before the prompt (costs no acceptance can beat), the reply's sampler picks in
    the graph (forced here), so no logits exist for a verify. If timings later in the reply made
    the draft look good (here: made near free mid-reply), drafting must still stay off to the
    reply's end."""
    with Runner(small_model, SETTINGS, draft=str(small_model), costs={"model": HOPELESS}) as r:
        plain, _, _ = _run(r.ctx, r.chat_tokens(_user(PROMPTS[1])), GREEDY, 32, SpecConfig())
        forced = replace(r.spec_config, device_greedy=True)
        records = []
        for record in generate(r.ctx, r.chat_tokens(_user(PROMPTS[1])), GREEDY, max_tokens=32,
                               spec_config=forced, memory=r.governors):
            records.append(record)
            if isinstance(record, Round) and sum(isinstance(x, Round) for x in records) == 1:
                r.governors.put("model", _favour_the_draft(r.governors.get("model")))
                assert governor.given_up(r.governors.get("model")) is None  # the draft now looks good
        rounds = [x for x in records if isinstance(x, Round)]
        assert [x.token for x in records if isinstance(x, Step)] == plain
        assert sum(x.drafted for x in rounds) == 0 and r.draft_ctx.n_past == 0, [x.decision for x in rounds]
        assert all(x.decision.kind is Kind.HOPELESS for x in rounds)
