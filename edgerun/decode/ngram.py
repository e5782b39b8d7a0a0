"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the current
suffix n-gram. Needs no model, costs microseconds per round, and pays off when the reply repeats
its input (code edits, quoting) or an earlier turn of the conversation (the prompt holds them all).

A proposal runs as far as the earlier text goes, up to k tokens, and stops after an
end-of-generation token (nothing after one is ever kept). With it comes the match length: how
many tokens before the proposal agree with the tokens before now. A long match is a long exact
copy in progress, whose next tokens are far more likely right than those after a chance 2-gram;
the governor keeps its acceptance estimate per match length (governor.match_bucket)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

NGRAM_MAX = 4
NGRAM_MIN = 2
MATCH_MAX = 64  # the match length is counted up to this many tokens


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # what followed the earlier occurrence ([] when nothing matched)
    match: int = 0     # tokens before it that agree with the tokens before now (>= the n-gram's size)


class NgramDrafter:
    """An index from n-gram to where it last ended, kept up to date as tokens arrive, so a
    proposal is a few dict lookups instead of a scan of the history. `is_stop`: tokens that end
    a reply (a proposal stops after one)."""

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN,
                 is_stop: Callable[[int], bool] | None = None, pool: NgramPool | None = None):
        self.n_max, self.n_min, self.is_stop, self.pool = n_max, n_min, is_stop, pool
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def reset(self, tokens: Iterable[int]) -> None:
        self.tokens = list(tokens)
        self._last_end.clear()
        self._indexed = 0

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(tokens)

    def _index_until(self, end: int) -> None:
        # the suffix itself (ending at len(tokens)) stays out, so a lookup finds an earlier one
        for e in range(self._indexed + 1, end + 1):
            for n in range(self.n_min, self.n_max + 1):
                if e - n >= 0:
                    self._last_end[tuple(self.tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix n-gram last time; [] if none."""
        return self.lookup(k).tokens

    def lookup(self, k: int) -> Proposal:
        """The proposal (up to k tokens, cut after a stop token) and its match length: from the
        conversation, or from the pool where that matches longer."""
        seq = self.tokens
        if k <= 0 or len(seq) < self.n_min + 1:
            return Proposal([])
        own = self._own(k)
        if self.pool is not None and own.match < MATCH_MAX:
            other = self.pool.lookup(seq, k, self.is_stop)
            if other.tokens and other.match >= POOL_MIN_MATCH and other.match > own.match:
                return other
        return own

    def _own(self, k: int) -> Proposal:
        seq = self.tokens
        self._index_until(len(seq) - 1)
        for n in range(min(self.n_max, len(seq) - 1), self.n_min - 1, -1):
            end = self._last_end.get(tuple(seq[-n:]))
            if end is None:
                continue
            return Proposal(_cut(seq[end : end + k], self.is_stop), self._match_length(end, n))
        return Proposal([])

    def _match_length(self, end: int, n: int) -> int:
        """How many tokens before `end` equal those before the end of the history (n known)."""
        seq, m = self.tokens, n
        while m < MATCH_MAX and end - m - 1 >= 0 and seq[end - m - 1] == seq[len(seq) - m - 1]:
            m += 1
        return m


def _cut(tokens: list[int], is_stop: Callable[[int], bool] | None) -> list[int]:
    """`tokens` up to and with the first stop token."""
    if is_stop is not None:
        stop = next((i for i, t in enumerate(tokens) if is_stop(t)), None)
        if stop is not None:
            return tokens[: stop + 1]
    return tokens


POOL_TOKENS = 1 << 16  # tokens an NgramPool keeps (its index: about 3 entries per token)
# the shortest match the pool's proposals need: a few tokens in common with unrelated text are
# chance, and drafts from them are mostly rejected verify work; a copy runs longer
POOL_MIN_MATCH = 8
_GAP = -1  # between two sequences of a pool: no n-gram spans it, no proposal runs past it


class NgramPool:
    """Tokens from outside the conversation (earlier conversations' replies), indexed as the
    drafter indexes its own: the drafter's fallback when the conversation has no match. Keeps the
    newest `limit` tokens."""

    def __init__(self, limit: int = POOL_TOKENS, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN):
        self.limit, self.n_max, self.n_min = limit, n_max, n_min
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, tokens: Iterable[int]) -> None:
        new = list(tokens)
        if not new:
            return
        start = len(self.tokens) + 1
        self.tokens += [_GAP, *new]
        if len(self.tokens) > self.limit:  # drop the oldest sequences whole, then index afresh
            keep = self.tokens[-self.limit:]
            cut = keep.index(_GAP) if _GAP in keep else len(keep)
            self.tokens, self._last_end, start = keep[cut:], {}, 1
        for e in range(start + self.n_min, len(self.tokens) + 1):
            for n in range(self.n_min, self.n_max + 1):
                gram = tuple(self.tokens[e - n : e])
                if e - n >= 0 and _GAP not in gram:
                    self._last_end[gram] = e

    def to_bytes(self) -> bytes:
        """The pool as a file holds it: int32 token ids, little-endian, -1 between sequences."""
        return array("i", self.tokens).tobytes() if sys.byteorder == "little" else _swapped(self.tokens)

    @classmethod
    def from_bytes(cls, data: bytes, n_vocab: int, limit: int = POOL_TOKENS) -> NgramPool:
        """A pool from to_bytes(). An id that is no token of the model (negative, or not below
        `n_vocab`: llama.cpp aborts on such an id in a batch) ends the sequence it is in."""
        ids = array("i")
        ids.frombytes(data[: len(data) - len(data) % 4])
        if sys.byteorder != "little":
            ids.byteswap()
        pool = cls(limit)
        run: list[int] = []
        for t in ids:
            if 0 <= t < n_vocab:
                run.append(t)
            else:
                pool.add(run)
                run = []
        pool.add(run)
        return pool

    def lookup(self, seq: list[int], k: int, is_stop: Callable[[int], bool] | None = None) -> Proposal:
        """What followed the longest suffix n-gram of `seq` in the pool, up to k tokens."""
        for n in range(min(self.n_max, len(seq)), self.n_min - 1, -1):
            end = self._last_end.get(tuple(seq[-n:]))
            if end is None:
                continue
            tokens = self.tokens[end : end + k]
            if _GAP in tokens:
                tokens = tokens[: tokens.index(_GAP)]
            tokens = _cut(tokens, is_stop)
            m = n
            while (m < MATCH_MAX and end - m - 1 >= 0 and m < len(seq)
                   and self.tokens[end - m - 1] == seq[len(seq) - m - 1]):
                m += 1
            return Proposal(tokens, m)
        return Proposal([])


def _swapped(tokens: list[int]) -> bytes:
    a = array("i", tokens)
    a.byteswap()
    return a.tobytes()
