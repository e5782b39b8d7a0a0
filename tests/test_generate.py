"""The decode loop on the real 0.5B model."""

from __future__ import annotations

import threading

import pytest

from edgerun.decode.generate import Prefill, Step, generate
from edgerun.decode.speculative import SpecConfig
from edgerun.errors import EngineError
from edgerun.decode.stats import ReplyStats
from edgerun.runner import Runner
from edgerun.settings import EngineSettings, SamplerSettings

pytestmark = pytest.mark.slow

GREEDY = SamplerSettings(temperature=0.0)


@pytest.fixture(scope="module")
def runner(small_model):
    with Runner(small_model, EngineSettings(n_ctx=2048, gpu_layers="0")) as r:
        yield r


def _reply(runner, messages, sampling=GREEDY, max_tokens=24, cancel=None):
    tokens = runner.chat_tokens(messages)
    records = list(runner.stream(tokens, sampling, max_tokens=max_tokens, cancel=cancel))
    steps = [r for r in records if isinstance(r, Step)]
    return records, steps, "".join(s.text for s in steps)


def _user(text):
    return [{"role": "user", "content": text}]


def test_chat_template_is_applied(runner):
    tokens = runner.chat_tokens(_user("hello there"))
    text = "".join(runner.model.piece(t, special=True).decode() for t in tokens)
    assert "<|im_start|>user\nhello there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    im_start = runner.model.tokenize("<|im_start|>", add_special=False)
    assert len(im_start) == 1  # a special token, not its spelling


def test_greedy_is_deterministic(runner):
    _, a, text_a = _reply(runner, _user("Name three prime numbers."))
    runner.ctx.trim(0)
    _, b, text_b = _reply(runner, _user("Name three prime numbers."))
    assert [s.token for s in a] == [s.token for s in b]
    assert text_a == text_b and text_a.strip()


def test_seeded_sampling_repeats_and_seed_matters(runner):
    hot = SamplerSettings(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0)
    outs = {}
    for seed in (1, 1, 2):
        runner.ctx.trim(0)
        _, steps, _ = _reply(runner, _user("Write a random word."), hot.replace(seed=seed), max_tokens=16)
        outs.setdefault(seed, []).append([s.token for s in steps])
    assert outs[1][0] == outs[1][1]
    assert outs[2][0] != outs[1][0]


def test_stops_at_end_of_generation(runner):
    records, steps, text = _reply(runner, _user("Reply with only the word: yes"), max_tokens=64)
    assert steps[-1].finish == "stop"
    assert runner.model.is_eog(steps[-1].token)
    assert len(steps) < 64 and "yes" in text.lower()
    assert isinstance(records[0], Prefill) and records[0].prompt_tokens > 10


def test_max_tokens_and_stats(runner):
    records, steps, _ = _reply(runner, _user("Count from 1 to 100."), max_tokens=10)
    stats = ReplyStats()
    for r in records:
        stats.add(r)
    assert stats.generated_tokens == 10 and stats.finish == "length"
    assert 0 < stats.ttft_s <= steps[-1].t and stats.decode_tok_s > 0  # no speed threshold: a loaded machine is slow
    assert all(b.t >= a.t for a, b in zip(steps, steps[1:]))


def test_cancel_stops_after_current_token(runner):
    cancel = threading.Event()
    tokens = runner.chat_tokens(_user("Write a long story about a robot."))
    steps = []
    for r in runner.stream(tokens, GREEDY, max_tokens=200, cancel=cancel):
        if isinstance(r, Step):
            steps.append(r)
            if len(steps) == 3:
                cancel.set()
    assert len(steps) == 4 and steps[-1].finish == "cancelled"


def test_next_turn_reuses_the_kv_cache_and_matches_a_fresh_context(runner, small_model):
    runner.ctx.trim(0)
    history = _user("What is 2+2?")
    _, _, first = _reply(runner, history)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And 3+3?"}]
    records, steps, second = _reply(runner, history)
    prefill = records[0]
    assert prefill.evaluated < prefill.prompt_tokens / 2  # the first turn was not evaluated again
    with Runner(small_model, EngineSettings(n_ctx=2048, gpu_layers="0")) as fresh:
        _, fresh_steps, _ = _reply(fresh, history)
    assert [s.token for s in steps] == [s.token for s in fresh_steps]


def test_utf8_split_across_tokens_is_decoded_whole(runner):
    runner.ctx.trim(0)
    _, steps, text = _reply(runner, _user("Write the Chinese word for 'speed' and nothing else."), max_tokens=16)
    assert "\ufffd" not in text
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text)


def test_a_greedy_pick_inside_the_graph_matches_the_hosts(runner):
    """On a GPU a plain greedy reply lets llama.cpp pick each token in its graph (one id copied
    back instead of the logits); the CPU backend runs the same sampler, so the path is checked
    here: the same tokens as the host's argmax, and the logits are back once it is detached."""
    tokens = runner.chat_tokens(_user("Write a Python function that reverses a string."))
    replies = {}
    for on_device in (False, True):
        runner.ctx.trim(0)
        spec = SpecConfig(device_greedy=on_device)
        steps = [r for r in generate(runner.ctx, tokens, GREEDY, max_tokens=40, spec_config=spec) if isinstance(r, Step)]
        replies[on_device] = [s.token for s in steps]
        assert runner.ctx.picks_on_device == on_device
        if on_device:
            with pytest.raises(EngineError, match="no logits"):
                runner.ctx.logits()
    assert replies[True] == replies[False] and len(replies[True]) == 40
    hot = SamplerSettings(temperature=0.8, seed=3)  # sampling needs the logits: detached again
    runner.ctx.trim(0)
    assert any(isinstance(r, Step) for r in generate(runner.ctx, tokens, hot, max_tokens=4,
                                                    spec_config=SpecConfig(device_greedy=True)))
    assert not runner.ctx.picks_on_device
    assert runner.ctx.logits().shape == (runner.model.n_vocab,)


@pytest.mark.parametrize("device_greedy", [False, True])
def test_a_decode_left_in_flight_changes_nothing(runner, device_greedy, monkeypatch):
    """On a GPU a plain stretch ends by launching its newest token's decode, which runs while
    Python hands out the tokens (forced here on the CPU): the same tokens, the KV holds exactly
    the recorded tokens after the reply, and a reply stopped mid-way leaves a usable context."""
    import llama_cpp

    from edgerun.decode import generate as generate_module

    in_flight = []  # what each native round reported: the real call, watched
    real_round = generate_module._native.round

    def watched(plan, rng):
        result = real_round(plan, rng)
        in_flight.append(result.target.in_flight)
        return result

    monkeypatch.setattr(generate_module._native, "round", watched)
    tokens = runner.chat_tokens(_user("Count from 1 to 40, separated by commas."))
    replies = {}
    for overlap in (False, True):
        runner.ctx.trim(0)
        in_flight.clear()
        spec = SpecConfig(overlap=overlap, device_greedy=device_greedy)
        records = list(generate(runner.ctx, tokens, GREEDY, max_tokens=60, spec_config=spec))
        replies[overlap] = [r.token for r in records if isinstance(r, Step)]
        assert llama_cpp.llama_memory_seq_pos_max(runner.ctx.mem, 0) == runner.ctx.n_past - 1
        assert any(in_flight) == overlap, in_flight  # the overlap did happen (and only when asked)
    assert replies[True] == replies[False] and len(replies[True]) == 60
    cancel = threading.Event()
    spec = SpecConfig(overlap=True, device_greedy=device_greedy)
    for r in generate(runner.ctx, tokens, GREEDY, max_tokens=60, cancel=cancel, spec_config=spec):
        if isinstance(r, Step) and r.token == replies[True][5]:
            cancel.set()
    assert llama_cpp.llama_memory_seq_pos_max(runner.ctx.mem, 0) == runner.ctx.n_past - 1
    steps = [r for r in generate(runner.ctx, tokens, GREEDY, max_tokens=60, spec_config=spec) if isinstance(r, Step)]
    assert [s.token for s in steps] == replies[True]
