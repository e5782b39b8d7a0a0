"""Speculation around the native round: which drafter proposes, how many tokens (the governor),
and keeping both KV caches' bookkeeping equal to what llama.cpp holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from edgerun.decode import governor
from edgerun.decode.ngram import NgramDrafter
from edgerun.runtime.engine import Context

DEFAULT_P_MIN = 0.2  # stop drafting when the draft gives its own pick under 20%: likely rejected


@dataclass(frozen=True)
class SpecConfig:
    draft: Context | None = None  # a same-vocab draft model's context
    ngram: bool = False           # prompt-lookup drafter (tried first: it costs nothing)
    k: int | None = None          # fixed draft length; None lets the governor choose
    p_min: float = DEFAULT_P_MIN
    rule: str = "rejection"       # or "match": llama.cpp server's sample-and-compare
    # what the governor measured, kept across replies of a session (costs do not change per reply)
    governors: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Round:
    """One speculation round's numbers, yielded after its tokens."""

    drafter: str  # "model", "ngram" or "none"
    k: int
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    decided: str


class Speculator:
    """Per-reply state: drafters, one governor state per drafter, and round arguments."""

    def __init__(self, cfg: SpecConfig, target: Context, prompt: list[int]):
        self.cfg, self.target = cfg, target
        self.ngram = NgramDrafter() if cfg.ngram else None
        if self.ngram:
            self.ngram.reset(prompt)
        self.gov = cfg.governors
        for name in ("model", "ngram"):
            self.gov[name] = governor.new_reply(self.gov.get(name, governor.GovernorState()))
        self._pending: tuple[str, int, str] = ("none", 0, "")
        self._catch_up_s = 0.0

    def _choose(self, name: str, available: int | None) -> tuple[int, str]:
        if self.cfg.k is not None:
            k = self.cfg.k if available is None else min(self.cfg.k, available)
            return k, f"fixed k={self.cfg.k}"
        return governor.choose(self.gov[name], available)

    def _prepare_draft(self, last: int) -> tuple[list[int], int]:
        """Bring the draft's KV to the committed sequence; return (feed, its start position)."""
        draft = self.cfg.draft
        start = time.perf_counter()
        # everything committed before `last` is what the target's cache holds; a long catch-up
        # (the prompt) goes in n_batch chunks, and the native round feeds `last` itself
        draft.sync(self.target.tokens)
        self._catch_up_s = time.perf_counter() - start  # drafting's cost too: the governor counts it
        return [last], draft.n_past

    def round_args(self, last: int) -> dict:
        """Arguments for _native.round (minus history, params, rule, rng)."""
        args = dict(target=self.target.address, draft=0, draft_feed=[], draft_n_past=0, last=last,
                    target_n_past=self.target.n_past, k=0, p_min=self.cfg.p_min, proposals=[])
        if self.ngram:
            self.ngram.extend([last])
            proposals = self.ngram.propose(self.cfg.k or governor.K_MAX)
            if proposals:
                k, why = self._choose("ngram", len(proposals))
                self._pending = ("ngram", k, why)
                return args | dict(k=k, proposals=proposals[:k])
        if self.cfg.draft is not None:
            k, why = self._choose("model", None)
            self._pending = ("model", k, why)
            if k > 0:
                feed, n_past = self._prepare_draft(last)
                return args | dict(k=k, draft=self.cfg.draft.address, draft_feed=feed, draft_n_past=n_past)
            return args
        self._pending = ("none", 0, "no drafter")
        return args

    def after(self, last: int, result: dict) -> Round:
        """Record what the round left in each KV cache and teach the governor."""
        result = result | {"draft_s": result["draft_s"] + self._catch_up_s}
        self._catch_up_s = 0.0
        drafts, accepted = result["drafts"], result["accepted"]
        drafter, k, why = self._pending
        if drafter == "model" and k > 0:
            # the draft's cache now holds the target's old tokens, `last`, and what it evaluated
            self.cfg.draft.tokens = self.target.tokens + [last] + drafts[: result["draft_evaluated"]]
        self.target.tokens.append(last)  # in place: no copy of the whole context per token
        self.target.tokens.extend(drafts[:accepted])
        if self.ngram:
            self.ngram.extend(drafts[:accepted])
        # a round without drafts is a plain step: every governor learns the plain cost from it
        for name in ([drafter] if drafts else self.gov):
            if name in self.gov:
                self.gov[name] = governor.update(
                    self.gov[name], k=k if drafts else 0, drafted=len(drafts), accepted=accepted,
                    draft_s=result["draft_s"], verify_s=result["verify_s"], decided=why,
                )
        return Round(drafter, k, len(drafts), accepted, result["draft_s"], result["verify_s"], why)
