"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the current
suffix n-gram. Needs no model, costs microseconds per round, and pays off when the reply repeats
its input (code edits, quoting) or an earlier turn of the conversation (the prompt holds them all).

A proposal runs as far as the earlier text goes, up to k tokens, and stops before an
end-of-generation token: a round whose drafts are all accepted samples one more token anyway,
and where the text ended that token is the end again, so drafting the end itself only makes the
batch a row larger (and a reply's first tokens, which often match the end of the user's message,
would otherwise propose nothing but the end). With it comes the match length: how
many tokens before the proposal agree with the tokens before now. A long match is a long exact
copy in progress, whose next tokens are far more likely right than those after a chance 2-gram;
the governor keeps its acceptance estimate per match length (governor.match_bucket).

A copy in progress goes on from where it is: the drafter remembers where its last proposal came
from, and while the tokens since then are what followed there, the next proposal continues at
that place. The latest occurrence of the suffix n-gram is often elsewhere (code repeats lines
like `config.setdefault("`, and the reply itself is indexed too), and a proposal from there
matches a few tokens and runs a few; of the two, the longer match is proposed.

Between lookups, how long a match can grow is bounded: every match is part of the longest
suffix of the tokens that occurred earlier, and that suffix grows by at most one token a step.
So with it L tokens long now, no proposal matching m tokens or more can come in the next
m - L - 1 steps (quiet_steps), which plain decoding may take in one native call. The index gives
L exactly while it is shorter than n_max (the longest suffix n-gram found is then the longest
suffix that occurred at all); past that the bound goes on from the last exact one, one a step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

NGRAM_MAX = 4
NGRAM_MIN = 2
MATCH_MAX = 64  # the match length is counted up to this many tokens
POOL_TOKENS = 1 << 16  # tokens an NgramPool keeps (its index: about 3 entries per token)
# the shortest match the pool's proposals need: a few tokens in common with unrelated text are
# chance, and drafts from them are mostly rejected verify work; a copy runs longer
POOL_MIN_MATCH = 8
_GAP = -1  # between two sequences of a pool: no token, so no match spans it; no proposal runs past it


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # what followed the earlier occurrence ([] when nothing matched)
    match: int = 0     # tokens before it that agree with the tokens before now (>= the n-gram's size)
    start: int = field(default=-1, compare=False)  # where in its source's tokens it starts


class _Index:
    """Where each n-gram (n_min..n_max tokens) of `tokens` last ended, grown as tokens arrive, so
    a lookup is a few dict lookups instead of a scan. An n-gram across a _GAP is indexed too: no
    lookup key holds one, so it never matches (checking for it cost every token a third more)."""

    def __init__(self, tokens: list[int], n_max: int, n_min: int):
        self.tokens, self.n_max, self.n_min = tokens, n_max, n_min
        self.last_end: dict[tuple[int, ...], int] = {}
        self.seen: set[int] = set()  # the single tokens up to `indexed` (a match's first token: see _Reach)
        self.indexed = 0  # n-grams ending at or before this position are in the index

    def index_until(self, end: int) -> None:
        tokens, last_end, seen = self.tokens, self.last_end, self.seen
        for e in range(self.indexed + 1, end + 1):
            seen.add(tokens[e - 1])
            for n in range(self.n_min, min(self.n_max, e) + 1):
                last_end[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end)

    def find(self, seq: list[int], k: int) -> Proposal:
        """Up to k tokens after the latest indexed occurrence of seq's longest suffix n-gram, and
        how many tokens before it agree with seq's."""
        for n in range(min(self.n_max, len(seq)), self.n_min - 1, -1):
            end = self.last_end.get(tuple(seq[-n:]))
            if end is None:
                continue
            return Proposal(self.tokens[end : end + k], self._agreeing(seq, end, n), end)
        return Proposal([])

    def _agreeing(self, seq: list[int], end: int, m: int = 0) -> int:
        """How many tokens before `end` agree with seq's last ones (the first m known to), up to
        MATCH_MAX."""
        while m < MATCH_MAX and m < end and m < len(seq) and self.tokens[end - m - 1] == seq[-m - 1]:
            m += 1
        return m

    def continued(self, seq: list[int], end: int, k: int) -> Proposal:
        """Up to k tokens from `end` on, if the tokens before `end` agree with seq's last
        n_min or more (the match counted as find() counts it); an empty proposal if not."""
        if not 0 < end < len(self.tokens) or end > self.indexed:
            return Proposal([])
        m = self._agreeing(seq, end)
        return Proposal(self.tokens[end : end + k], m, end) if m >= self.n_min else Proposal([])


class _Reach:
    """An upper bound on the longest suffix of the drafter's tokens that occurs in one index: how
    long a match from there can be (see the module's docstring). Unknown until a lookup finds it
    shorter than the index's n_max."""

    def __init__(self):
        self.length: int | None = None  # the bound at `at` tokens
        self.at = 0

    def see(self, index: _Index, seq: list[int], found: Proposal) -> None:
        """Take the bound from a lookup of seq's suffix in `index` (its match: a cut proposal keeps it)."""
        if found.match == 0:  # no n_min-gram: the last token alone, if it occurred
            length = index.n_min - 1 if seq[-1] in index.seen else 0
        elif found.match < index.n_max:  # the next longer suffix n-gram never occurred
            length = found.match
        elif self.length is not None:
            length = max(found.match, self.length + len(seq) - self.at)
        else:
            length = None
        self.length, self.at = length, len(seq)

    def steps(self, least: int, now: int) -> int:
        """Steps from `now` tokens on before a match of `least` tokens or more could be found."""
        if self.length is None:
            return 1
        return max(1, least - (self.length + now - self.at))


def _before_gap(found: Proposal) -> Proposal:
    """The proposal up to a pool sequence's end (its gap; before is_stop sees it: -1 is no token
    of the model)."""
    if _GAP in found.tokens:
        return Proposal(found.tokens[: found.tokens.index(_GAP)], found.match, found.start)
    return found


def _cut(found: Proposal, is_stop: Callable[[int], bool] | None) -> Proposal:
    """The proposal up to its first stop token (see the module's docstring)."""
    if is_stop is not None:
        stop = next((i for i, t in enumerate(found.tokens) if is_stop(t)), None)
        if stop is not None:
            return Proposal(found.tokens[:stop], found.match, found.start)
    return found


class NgramDrafter:
    """Proposals from the conversation's own tokens, or from `pool` (earlier conversations) where
    that matches longer. `is_stop`: tokens that end a reply (a proposal stops before one)."""

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN,
                 is_stop: Callable[[int], bool] | None = None, pool: NgramPool | None = None):
        self.n_max, self.n_min, self.is_stop, self.pool = n_max, n_min, is_stop, pool
        self.reset([])

    def reset(self, tokens: Iterable[int]) -> None:
        self.tokens: list[int] = list(tokens)
        self._index = _Index(self.tokens, self.n_max, self.n_min)
        # where the last proposal came from: (the index it came from, its start, len(tokens) then)
        self._source: tuple[_Index, int, int] | None = None
        self._reach, self._pool_reach = _Reach(), _Reach()  # in the conversation, in the pool

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix n-gram last time; [] if none."""
        return self.lookup(k).tokens

    def lookup(self, k: int) -> Proposal:
        """The proposal (up to k tokens, cut before a stop token) and its match length: from the
        conversation, or from the pool where that matches longer."""
        seq = self.tokens
        if k <= 0 or len(seq) < self.n_min + 1:
            return Proposal([])
        # the suffix itself (ending at len(tokens)) stays out, so a lookup finds an earlier one
        self._index.index_until(len(seq) - 1)
        own, at = self._index.find(seq, k), self._index
        self._reach.see(at, seq, own)
        going = self._going_on(seq, k)
        if going is not None and going[0].match > own.match:
            own, at = going
        own = _cut(own, self.is_stop)
        if self.pool is not None and own.match < MATCH_MAX:
            other = self.pool.lookup(seq, k, self.is_stop)
            self._pool_reach.see(self.pool._index, seq, other)  # a cut keeps the match
            if other.tokens and other.match >= POOL_MIN_MATCH and other.match > own.match:
                own, at = other, self.pool._index
        self._source = (at, own.start, len(seq)) if own.tokens else None
        return own

    def quiet_steps(self, least: int) -> int:
        """Steps from now (at least one) before a proposal matching `least` tokens or more could
        come, as the last lookup bounded the matches: plain decoding may take them in one go."""
        now = len(self.tokens)
        steps = self._reach.steps(least, now)
        if self.pool is not None:
            steps = min(steps, self._pool_reach.steps(max(least, POOL_MIN_MATCH), now))
        return steps

    def _going_on(self, seq: list[int], k: int) -> tuple[Proposal, _Index] | None:
        """The last proposal's source, moved past the tokens that came since (when they are what
        followed there): the copy in progress, and the index it is in."""
        if self._source is None:
            return None
        index, start, then = self._source
        end = start + len(seq) - then
        found = index.continued(seq, end, k)
        if not found.tokens:
            return None
        found = _before_gap(found)
        return (found, index) if found.tokens else None


class NgramPool:
    """Tokens from outside the conversation (earlier conversations), indexed as the drafter
    indexes its own. Keeps the newest `limit` tokens: once over it, the oldest sequences go whole
    down to three quarters of it (of one longer sequence, its newest tokens stay), so the index is rebuilt once per quarter of new tokens, not
    after every reply."""

    def __init__(self, limit: int = POOL_TOKENS, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN):
        self.limit = limit
        self._index = _Index([], n_max, n_min)

    @property
    def tokens(self) -> list[int]:
        return self._index.tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, tokens: Iterable[int]) -> None:
        new = list(tokens)
        if not new:
            return
        index = self._index
        index.tokens += [_GAP, *new]
        if len(index.tokens) > self.limit:
            keep = index.tokens[-(self.limit * 3 // 4):]
            cut = keep.index(_GAP) if _GAP in keep else 0  # one sequence longer than that: its tail
            index = self._index = _Index(keep[cut:], index.n_max, index.n_min)
        index.index_until(len(index.tokens))

    def to_bytes(self) -> bytes:
        """The pool as a file holds it: int32 token ids, little-endian, -1 between sequences."""
        return np.asarray(self.tokens, dtype="<i4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, n_vocab: int, limit: int = POOL_TOKENS) -> NgramPool:
        """A pool from to_bytes(). An id that is no token of the model (negative, or not below
        `n_vocab`: llama.cpp aborts on such an id in a batch) ends the sequence it is in."""
        ids = np.frombuffer(data[: len(data) - len(data) % 4], dtype="<i4")
        bad = np.flatnonzero((ids < 0) | (ids >= n_vocab))
        pool = cls(limit)
        for run in np.split(ids, bad):
            pool.add(run[1:].tolist() if run.size and not 0 <= run[0] < n_vocab else run.tolist())
        return pool

    def lookup(self, seq: list[int], k: int, is_stop: Callable[[int], bool] | None = None) -> Proposal:
        """What followed the longest suffix n-gram of `seq` in the pool, up to k tokens (and not
        past the end of the sequence it is in)."""
        return _cut(_before_gap(self._index.find(seq, k)), is_stop)
