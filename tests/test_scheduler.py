"""The serve engine's pacing of prompts among decoding replies: PrefillPacer fed numbers, and the
scheduler's steps driven one by one on the tiny model with the pacer's state set by hand."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgerun.serve.scheduler import BANK_STEPS, PrefillPacer


def test_nothing_decoding_lets_every_step_carry_prompts():
    pacer = PrefillPacer(0.5)
    for seconds in (5.0, 3.0, 9.0):
        pacer.record(seconds, decoding=0, waiting=1, chunked=True)
        assert pacer.may_chunk(0, 1) and pacer.may_chunk(1, 1)


def test_a_chunk_is_paid_back_by_decode_steps_before_the_next():
    """Share 0.5, decode steps of 0.1 s: a 2.6 s chunk step is 2.5 s beyond its decode step, so
    the replies get 2.5 s of decode-only steps (less the banked 0.2 s and the chunk step's own
    0.1 s) before prompts ride again."""
    pacer = PrefillPacer(0.5)
    for _ in range(10):
        pacer.record(0.1, decoding=1, waiting=1, chunked=False)
    assert pacer.credit == pytest.approx(0.5 * BANK_STEPS * 0.1)
    pacer.record(2.6, decoding=1, waiting=1, chunked=True)
    held = 0
    while not pacer.may_chunk(1, 1):
        pacer.record(0.1, decoding=1, waiting=1, chunked=False)
        held += 1
    assert held == round((2.5 * 0.5 - 0.05 - 0.2) / 0.05)  # 20 steps: 2.0 s of decoding
    pacer.idle()
    assert pacer.credit == 0.0


def test_share_one_never_holds_a_prompt_back():
    pacer = PrefillPacer(1.0)
    pacer.record(0.1, decoding=1, waiting=1, chunked=False)
    for _ in range(5):
        pacer.record(10.0, decoding=1, waiting=1, chunked=True)
        assert pacer.may_chunk(1, 1)


def test_a_burst_of_prompts_beside_few_replies_gets_their_part_of_the_time():
    """Fifteen prompts waiting beside one decoding reply get 15/16 of the time: the bank saved
    before the 2.6 s chunk step covers its cost, where one waiting prompt would wait 20 steps."""
    pacer = PrefillPacer(0.5)
    assert pacer.share_for(4, 1) == 0.5 and pacer.share_for(1, 15) == pytest.approx(15 / 16)
    for _ in range(10):
        pacer.record(0.1, decoding=1, chunked=False, waiting=15)
    pacer.record(2.6, decoding=1, chunked=True, waiting=15)
    held = 0
    while not pacer.may_chunk(decoding=1, waiting=15):
        pacer.record(0.1, decoding=1, chunked=False, waiting=15)
        held += 1
    assert held == 0 and pacer.credit == pytest.approx(15 / 16 * 0.4 + 15 / 16 * 0.1 - 2.5 / 16)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="not in"):
        PrefillPacer(share)


@given(share=st.floats(0.05, 0.95), decoding=st.integers(1, 16), waiting=st.integers(1, 16),
       decode=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=200),
       chunk=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=200))
def test_prompts_never_take_more_than_their_share(share, decoding, waiting, decode, chunk):
    """A scheduler that obeys may_chunk: the prompts' time beyond the decode steps they ride with
    stays within s / (1 - s) of the replies' time (s the share for these counts), give or take
    the one chunk step that may overdraw the credit."""
    pacer = PrefillPacer(share)
    s = pacer.share_for(decoding, waiting)
    assert s == max(share, waiting / (waiting + decoding))
    prompt_s = reply_s = 0.0
    for i, d in enumerate(decode):
        if pacer.may_chunk(decoding, waiting):
            extra = chunk[i % len(chunk)]
            pacer.record(d + extra, decoding=decoding, chunked=True, waiting=waiting)
            # what the pacer counts as the replies' part is its smoothed decode step, at most d + extra
            part = min(d + extra, pacer.decode_s) if pacer.decode_s is not None else 0.0
            prompt_s, reply_s = prompt_s + d + extra - part, reply_s + part
        else:
            pacer.record(d, decoding=decoding, chunked=False, waiting=waiting)
            reply_s += d
    assert prompt_s <= s / (1 - s) * reply_s + max(chunk) + max(decode) + 1e-9


def test_the_scheduler_holds_prompt_chunks_back_while_the_pacer_says_so(tiny_model):
    """Three replies decoding and a long prompt waiting: a step the pacer holds back gives the
    replies their tokens and the prompt nothing; the next one it allows carries a chunk."""
    from edgerun.runner import Runner
    from edgerun.serve.metrics import Metrics
    from edgerun.serve.scheduler import Job, Scheduler
    from edgerun.settings import EngineSettings, SamplerSettings

    with Runner(tiny_model, EngineSettings(n_ctx=512, n_threads=1, n_seq=4)) as runner:
        # a clock that never moves: every step takes no time, so only the credit set here decides
        sched = Scheduler(runner, Metrics(), queue_limit=4, step_tokens=40, solo=False, clock=lambda: 0.0)

        def job(prompt: list[int]) -> Job:
            j = Job(prompt, SamplerSettings(temperature=0.0), 64, [], sink=lambda _event: None)
            sched.submit(j)
            return j

        short = [job(list(range(10 + 3 * i, 20 + 3 * i))) for i in range(3)]
        sched._admit()
        sched._step()
        long = job(list(range(100, 190)))
        sched._admit()
        sched.pacer.credit = -1.0
        for n in (1, 2):
            sched._step()
            assert len(runner.ctx.held(long.seq)) == 0 and all(len(j.tokens) == 1 + n for j in short)
        sched.pacer.credit = 0.0
        sched._step()
        assert len(runner.ctx.held(long.seq)) == 37 and all(len(j.tokens) == 4 for j in short)


def test_a_prompt_that_left_its_slot_comes_back_from_the_prompt_cache(tiny_model):
    """One slot: a second conversation takes it, the first comes back. Its prompt is restored
    from RAM (one token evaluated, for its logits) and its reply at T=0 is the one it had."""
    from edgerun.runner import Runner
    from edgerun.serve.metrics import Metrics
    from edgerun.serve.scheduler import Job, Scheduler
    from edgerun.settings import EngineSettings, SamplerSettings

    with Runner(tiny_model, EngineSettings(n_ctx=512, n_threads=1, n_seq=1)) as runner:
        metrics = Metrics()
        sched = Scheduler(runner, metrics, queue_limit=4, step_tokens=256, solo=False)
        evaluated = lambda: metrics.registry.get_sample_value("edgerun_prompt_tokens_evaluated_total")

        def served(prompt: list[int]) -> Job:
            job = Job(prompt, SamplerSettings(temperature=0.0), 12, [], sink=lambda _event: None)
            sched.submit(job)
            sched._admit()
            while job in sched._active:
                sched._step()
            return job

        first = list(range(40, 140))  # 100 tokens
        a = served(first)
        b = served(list(range(150, 250)))
        assert b.cached == 0 and len(sched.prompt_cache) == 1
        before = evaluated()
        again = served(first)
        assert again.cached == len(first) - 1 and evaluated() - before == 1
        assert again.tokens == a.tokens
        assert metrics.registry.get_sample_value("edgerun_prompt_cache_restored_tokens_total") >= len(first)
        assert len(sched.prompt_cache) == 2  # the second conversation's state, kept when it left the slot
