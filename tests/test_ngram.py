"""Prompt-lookup drafting (edgerun/decode/ngram.py) against a brute-force scan."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun.decode.ngram import MATCH_MAX, NGRAM_MAX, NGRAM_MIN, NgramDrafter, NgramPool, POOL_MIN_MATCH, Proposal


def brute_force(seq: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix n-gram, scanning
    every start position; the suffix itself (start len - n) never counts."""
    if k <= 0:
        return []
    for n in range(min(n_max, len(seq) - 1), n_min - 1, -1):
        suffix = seq[len(seq) - n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                return seq[start + n:start + n + k]
    return []


def drafter(tokens, **kw) -> NgramDrafter:
    d = NgramDrafter(**kw)
    d.reset(tokens)
    return d


# ---------------------------------------------------------------- examples

def test_copies_what_followed_the_earlier_occurrence():
    assert drafter([1, 2, 3, 4, 5, 9, 1, 2, 3]).propose(3) == [4, 5, 9]


def test_prefers_the_longest_suffix_ngram():
    # (2, 3) last occurred before 7; the longer (1, 2, 3) occurred before 4: the longer wins
    seq = [1, 2, 3, 4, 0, 2, 3, 7, 1, 2, 3]
    assert drafter(seq).propose(1) == [4]
    assert brute_force(seq, 1) == [4]


def test_prefers_the_latest_occurrence_of_equal_length():
    assert drafter([5, 6, 1, 8, 5, 6, 2, 8, 5, 6]).propose(2) == [2, 8]


def test_empty_when_nothing_repeats():
    assert drafter([1, 2, 3, 4, 5, 6]).propose(4) == []
    assert drafter([]).propose(4) == []
    assert drafter([7, 7]).propose(4) == []  # too short for an earlier 2-gram


def test_single_tokens_are_not_enough():
    # 3 recurs, but a 1-gram is below NGRAM_MIN: no proposal
    assert drafter([3, 1, 2, 3]).propose(2) == []


def test_respects_k():
    d = drafter([1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert d.propose(0) == [] and d.propose(-1) == []
    assert d.propose(1) == [3]
    assert d.propose(4) == [3, 4, 5, 6]
    assert d.propose(100) == [3, 4, 5, 6, 7, 1, 2]  # up to the end of the history


def test_never_proposes_from_the_suffix_itself():
    # a run of one token: the suffix (9, 9) matches itself, but only the earlier, overlapping
    # occurrence may be used, which is followed by just one more 9
    assert drafter([9, 9, 9]).propose(5) == [9]
    # all-distinct histories never propose, however they grow
    d = drafter([])
    for t in range(50):
        d.extend([t])
        assert d.propose(4) == []


def test_extend_picks_up_new_occurrences():
    d = drafter([1, 2, 3])
    assert d.propose(2) == []
    d.extend([1, 2])
    assert d.propose(2) == [3, 1]
    d.extend([4, 1, 2])  # (1, 2) now last occurred before 4
    assert d.propose(2) == [4, 1]


def test_reset_forgets_the_old_history():
    d = drafter([1, 2, 3, 1, 2])
    assert d.propose(1) == [3]
    d.reset([4, 5, 6, 4, 5])
    assert d.propose(1) == [6]
    d.reset([1, 2])
    assert d.propose(1) == []


# ---------------------------------------------------------------- against the brute force

tokens = st.lists(st.integers(0, 3), max_size=60)  # small alphabets: lots of repeats
# the chunks a reply grows by, drawn at their size (drawing 60 tokens to keep 5 is most of an example)
chunks_of_5 = st.lists(st.integers(0, 3), max_size=5)
chunks_of_4 = st.lists(st.integers(0, 3), max_size=4)


@given(seq=st.lists(st.integers(0, 4), max_size=80), k=st.integers(0, 10))
@settings(max_examples=500)
def test_matches_brute_force(seq, k):
    assert drafter(seq).propose(k) == brute_force(seq, k)


@given(seq=tokens, k=st.integers(1, 6), n_min=st.integers(1, 3), extra=st.integers(0, 3))
@settings(max_examples=300)
def test_matches_brute_force_for_other_ngram_sizes(seq, k, n_min, extra):
    n_max = n_min + extra
    got = drafter(seq, n_max=n_max, n_min=n_min).propose(k)
    assert got == brute_force(seq, k, n_max, n_min)


@given(prompt=tokens, steps=st.lists(st.tuples(chunks_of_5, st.integers(0, 8)), max_size=25))
@settings(max_examples=300)
def test_incremental_extend_matches_brute_force(prompt, steps):
    # the speculator's pattern: extend by a few tokens, propose, extend again
    d = drafter(prompt)
    seq = list(prompt)
    for chunk, k in steps:
        d.extend(chunk)
        seq += chunk
        got, fresh = d.lookup(k), drafter(seq).lookup(k)
        # a copy in progress goes on where it matches longer than the latest occurrence does
        assert got == fresh or (got.match > fresh.match and _continues(seq, got))
        assert fresh.tokens == brute_force(seq, k)
        assert len(got.tokens) <= max(k, 0)
        assert d.tokens == seq


@given(prompt=tokens, chunks=st.lists(chunks_of_4, max_size=20), k=st.integers(1, 6))
@settings(max_examples=200)
def test_propose_after_any_extends_equals_a_fresh_drafter(prompt, chunks, k):
    # the lazy index never goes stale: proposing at every step or only at the end agrees with
    # a drafter built from the whole history at once
    d = drafter(prompt)
    for chunk in chunks:
        d.propose(k)
        d.extend(chunk)
    whole = prompt + [t for c in chunks for t in c]
    got, fresh = d.lookup(k), drafter(whole).lookup(k)
    assert got == fresh or (got.match > fresh.match and _continues(whole, got))
    assert fresh.tokens == brute_force(whole, k)


def _continues(seq, got):
    """`got` follows, somewhere before the end, a copy of seq's last got.match tokens."""
    m = got.match
    return any(seq[s - m:s] == seq[len(seq) - m:] and seq[s:s + len(got.tokens)] == got.tokens
               for s in range(m, len(seq)))


def test_a_copy_in_progress_goes_on_where_it_is():
    """Code repeats lines (`config.setdefault(`): the latest occurrence of the suffix is often
    another line than the one being copied. Once a proposal came from a place and the tokens
    since are what followed it there, the next proposal goes on from that place."""
    line = [50, 60, 70, 80, 90]  # a line start that appears twice in the source
    source = [1, *line, 2, *line, 3, 7]
    d = drafter([*source, 99, 1, 50])
    assert d.lookup(2) == Proposal([60, 70], 2)  # from after "1 50": the first line
    d.extend([60, 70, 80])  # both accepted, and the target's own next token
    got = d.lookup(64)
    assert got.tokens[:3] == [90, 2, 50] and got.match == 5
    # a fresh drafter proposes from the latest occurrence: the second line, what follows it
    assert drafter([*source, 99, 1, 50, 60, 70, 80]).lookup(64).tokens[:2] == [90, 3]
    d.extend([90, 4])  # the reply leaves the copy: the next proposal is found afresh
    assert d.lookup(8) == drafter([*source, 99, 1, *line, 4]).lookup(8)


@given(seq=tokens, k=st.integers(1, 8))
@settings(max_examples=300)
def test_proposal_is_a_real_continuation(seq, k):
    # whatever is proposed appears in the history right after an earlier copy of the suffix
    got = drafter(seq).propose(k)
    if not got:
        return
    found = False
    for n in range(NGRAM_MIN, NGRAM_MAX + 1):
        suffix = seq[len(seq) - n:]
        for start in range(0, len(seq) - n):
            if seq[start:start + n] == suffix and seq[start + n:start + n + len(got)] == got:
                found = True
    assert found


# ---------------------------------------------------------------- long proposals, stops, match length

def brute_match(seq: list[int], k: int) -> int:
    """The match length of the brute-force proposal's source: how many tokens before it agree with
    the tokens before the end of the history (capped like the drafter's)."""
    for n in range(min(NGRAM_MAX, len(seq) - 1), NGRAM_MIN - 1, -1):
        suffix = seq[len(seq) - n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                end, m = start + n, n
                while m < MATCH_MAX and end - m - 1 >= 0 and seq[end - m - 1] == seq[len(seq) - m - 1]:
                    m += 1
                return m
    return 0


def test_a_long_copy_proposes_as_far_as_the_earlier_text_goes():
    body = list(range(10, 90))  # 80 distinct tokens, then their first 5 again
    d = drafter(body + [1] + body[:5])
    got = d.lookup(64)
    assert got.tokens == body[5:69] and got.match == 5
    assert d.lookup(200).tokens == body[5:] + [1] + body[:5]  # up to the end of the history


def test_the_match_length_grows_with_the_copy():
    body = list(range(10, 90))
    d = drafter(body + [1])
    for i in range(2, 70):
        d.reset(body + [1] + body[:i])
        assert d.lookup(4).match == min(i, MATCH_MAX)


def test_a_proposal_stops_before_an_end_of_generation_token():
    stop = 99
    d = NgramDrafter(is_stop=lambda t: t == stop)
    d.reset([1, 2, 3, 4, stop, 7, 8, 1, 2])
    assert d.lookup(10).tokens == [3, 4]
    d.reset([5, 1, 2, stop, 7, 1, 2])  # nothing but the end to propose: no proposal
    assert d.lookup(10).tokens == []
    assert NgramDrafter().propose(10) == []
    plain = drafter([1, 2, 3, 4, stop, 7, 8, 1, 2])
    assert plain.propose(10) == [3, 4, stop, 7, 8, 1, 2]


@given(seq=st.lists(st.integers(0, 3), max_size=120), k=st.integers(1, 64))
@settings(max_examples=300)
def test_lookup_matches_brute_force_with_its_match_length(seq, k):
    got = drafter(seq).lookup(k)
    assert got.tokens == brute_force(seq, k)
    assert got.match == (brute_match(seq, k) if got.tokens else 0)
    if got.tokens:
        assert NGRAM_MIN <= got.match <= MATCH_MAX


# ---------------------------------------------------------------- the pool of earlier conversations

def pool_brute_force(pool_seqs: list[list[int]], seq: list[int], k: int) -> list[int]:
    """What followed the longest suffix n-gram of `seq` at its latest occurrence inside one of
    the pool's sequences (newest sequence last), scanning every start."""
    for n in range(min(NGRAM_MAX, len(seq)), NGRAM_MIN - 1, -1):
        suffix = seq[len(seq) - n:]
        for s in reversed(pool_seqs):
            for start in range(len(s) - n, -1, -1):
                if s[start:start + n] == suffix:
                    return s[start + n:start + n + k]
    return []


def test_pool_drafts_what_an_earlier_conversation_had():
    earlier = list(range(100, 100 + POOL_MIN_MATCH))
    pool = NgramPool()
    pool.add(earlier + [8, 9])
    d = drafter([1, 2, *earlier], pool=pool)
    assert d.lookup(3) == Proposal([8, 9], POOL_MIN_MATCH)  # stops where that conversation's tokens end


def test_a_short_pool_match_is_chance_and_not_drafted():
    pool = NgramPool()
    pool.add([5, 6, 7, 8, 9])
    assert drafter([1, 2, 6, 7], pool=pool).lookup(3) == Proposal([])
    assert pool.lookup([1, 2, 6, 7], 3) == Proposal([8, 9], 2)


def test_the_conversation_wins_unless_the_pool_matches_longer():
    shared = list(range(100, 100 + POOL_MIN_MATCH))
    pool = NgramPool()
    pool.add([1, *shared, 40])
    own = [0, *shared, 30, 9, *shared]
    assert drafter(own, pool=pool).propose(1) == [30]                # both match as long: its own
    assert drafter([0, *shared[-2:], 30, 9, 1, *shared], pool=pool).propose(1) == [40]  # the pool's is longer


@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=9), min_size=1, max_size=12))
def test_pool_keeps_its_newest_sequences_whole_and_under_its_limit(seqs):
    pool = NgramPool(limit=24)
    for s in seqs:
        pool.add(s)
    kept = [list(g) for k, g in itertools.groupby(pool.tokens, lambda t: t == -1) if not k]
    assert len(pool) <= 24 and kept == seqs[len(seqs) - len(kept):]  # a tail of them, each whole
    assert kept[-1] == seqs[-1]
    # what is kept is what a fresh pool of those sequences finds (the index was rebuilt right)
    fresh = NgramPool(limit=24)
    for s in kept:
        fresh.add(s)
    assert fresh.tokens == pool.tokens
    for s in kept:
        assert pool.lookup(s[:2], 5) == fresh.lookup(s[:2], 5)


def test_a_sequence_longer_than_the_pool_leaves_its_newest_tokens():
    pool = NgramPool(limit=24)
    pool.add(list(range(100)))
    assert pool.tokens == list(range(82, 100)) and pool.lookup([90, 91], 3).tokens == [92, 93, 94]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), max_size=4),
       st.lists(st.integers(0, 3), min_size=2, max_size=8), st.integers(1, 6))
def test_pool_lookup_matches_a_scan(pool_seqs, seq, k):
    pool = NgramPool()
    for s in pool_seqs:
        pool.add(s)
    assert pool.lookup(seq, k).tokens == pool_brute_force([s for s in pool_seqs if s], seq, k)


def test_the_pool_never_asks_the_model_about_its_gap():
    def is_stop(t):  # llama.cpp's is_eog on -1 reads out of its vocabulary
        assert t >= 0, "asked about the gap"
        return t == 9

    pool = NgramPool()
    pool.add([1, 2, 3])
    pool.add([4, 6, 8, 9, 5])
    assert pool.lookup([1, 2], 5, is_stop).tokens == [3]        # the sequence ends before the gap
    assert pool.lookup([4, 6], 5, is_stop).tokens == [8]        # cut before the stop token


# ---------------------------------------------------------------- quiet steps

def longest_earlier_suffix(seq: list[int], source: list[int] | None = None) -> int:
    """The longest suffix of seq that occurs in `source` (default: earlier in seq itself, ending
    before its last token), by scanning every length and position."""
    best = 0
    for n in range(1, len(seq) + 1):
        suffix = seq[len(seq) - n:]
        text = seq[:-1] if source is None else source
        if not any(text[e - n:e] == suffix for e in range(n, len(text) + 1)):
            break
        best = n
    return best


def test_a_new_token_leaves_two_quiet_steps_and_a_short_match_more():
    d = drafter([1, 2, 3, 4, 5, 6, 9])
    d.lookup(8)  # 9 never occurred: the longest earlier suffix is empty
    assert d.quiet_steps(2) == 2 and d.quiet_steps(16) == 16
    d.extend([1, 2])
    d.lookup(8)  # (1, 2) occurred, (9, 1, 2) did not: a match of 2
    assert d.quiet_steps(2) == 1 and d.quiet_steps(16) == 14


def test_quiet_steps_are_unknown_past_the_longest_ngram_until_a_lookup_bounds_them():
    seq = [1, 2, 3, 4, 5, 1, 2, 3, 4]
    d = drafter(seq)
    d.lookup(8)  # a 4-gram matched, and nothing before bounded how far the match goes
    assert d.quiet_steps(32) == 1
    d.extend([7])
    d.lookup(8)  # 7 is new: bounded again
    assert d.quiet_steps(32) == 32
    d.extend([1, 2, 3, 4])
    d.lookup(8)  # four tokens since: at most 4 agree, and the bound goes on from 0
    assert d.quiet_steps(32) == 28


@given(prompt=st.lists(st.integers(0, 5), max_size=40), reply=st.lists(st.integers(0, 5), max_size=60),
       pool=st.lists(st.lists(st.integers(0, 5), max_size=30), max_size=3),
       gaps=st.lists(st.integers(1, 6), min_size=1, max_size=30), least=st.integers(2, 20))
@settings(max_examples=300, deadline=None)
def test_no_proposal_that_long_comes_within_the_quiet_steps(prompt, reply, pool, gaps, least):
    """The promise plain stretches rest on: after a lookup, for quiet_steps(least) - 1 tokens
    (whatever they are), no lookup proposes a match of `least` or more (the pool's only from
    POOL_MIN_MATCH on); and the bound behind it is never below the longest earlier suffix."""
    shared = NgramPool()
    for seq in pool:
        shared.add(seq)
    d = drafter(prompt, pool=shared if pool else None)
    at, cuts = 0, itertools.cycle(gaps)
    while at < len(reply):
        d.lookup(64)
        tokens = d.tokens
        assert d._reach.length is None or d._reach.length >= longest_earlier_suffix(tokens)
        if pool:
            assert d._pool_reach.length is None or d._pool_reach.length >= longest_earlier_suffix(tokens, shared.tokens)
        quiet = d.quiet_steps(least)
        assert quiet >= 1
        for j in range(1, quiet):  # the tokens a stretch would decode, looked up one by one
            if at + j > len(reply):
                break
            ahead = drafter(tokens + reply[at:at + j], pool=d.pool)
            assert longest_earlier_suffix(ahead.tokens) < least
            got = ahead.lookup(64)
            assert not got.tokens or got.match < least
        step = next(cuts)
        d.extend(reply[at:at + step])
        at += step
