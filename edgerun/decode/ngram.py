"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the current
suffix n-gram. Needs no model, costs microseconds per round, and pays off when the reply repeats
its input (code edits, quoting) or an earlier turn of the conversation (the prompt holds them all).

A proposal runs as far as the earlier text goes, up to k tokens, and stops after an
end-of-generation token (nothing after one is ever kept). With it comes the match length: how
many tokens before the proposal agree with the tokens before now. A long match is a long exact
copy in progress, whose next tokens are far more likely right than those after a chance 2-gram;
the governor keeps its acceptance estimate per match length (governor.match_bucket)."""

from __future__ import annotations

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
                 is_stop: Callable[[int], bool] | None = None):
        self.n_max, self.n_min, self.is_stop = n_max, n_min, is_stop
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
        """The proposal (up to k tokens, cut after a stop token) and its match length."""
        seq = self.tokens
        if k <= 0 or len(seq) < self.n_min + 1:
            return Proposal([])
        self._index_until(len(seq) - 1)
        for n in range(min(self.n_max, len(seq) - 1), self.n_min - 1, -1):
            end = self._last_end.get(tuple(seq[-n:]))
            if end is None:
                continue
            tokens = seq[end : end + k]
            if self.is_stop is not None:
                stop = next((i for i, t in enumerate(tokens) if self.is_stop(t)), None)
                if stop is not None:
                    tokens = tokens[: stop + 1]
            return Proposal(tokens, self._match_length(end, n))
        return Proposal([])

    def _match_length(self, end: int, n: int) -> int:
        """How many tokens before `end` equal those before the end of the history (n known)."""
        seq, m = self.tokens, n
        while m < MATCH_MAX and end - m - 1 >= 0 and seq[end - m - 1] == seq[len(seq) - m - 1]:
            m += 1
        return m
