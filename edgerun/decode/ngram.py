"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the current
suffix n-gram. Needs no model, costs microseconds per round, and pays off when the reply repeats
its input (code edits, quoting)."""

from __future__ import annotations

from collections.abc import Iterable

NGRAM_MAX = 4
NGRAM_MIN = 2


class NgramDrafter:
    """An index from n-gram to where it last ended, kept up to date as tokens arrive, so a
    proposal is a few dict lookups instead of a scan of the history."""

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN):
        self.n_max, self.n_min = n_max, n_min
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
        seq = self.tokens
        if k <= 0 or len(seq) < self.n_min + 1:
            return []
        self._index_until(len(seq) - 1)
        for n in range(min(self.n_max, len(seq) - 1), self.n_min - 1, -1):
            end = self._last_end.get(tuple(seq[-n:]))
            if end is not None:
                return seq[end : end + k]
        return []
