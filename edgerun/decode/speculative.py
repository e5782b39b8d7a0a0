"""Speculation around the native round: which drafter proposes, how many tokens (the governor),
and keeping both KV caches' bookkeeping equal to what llama.cpp holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from edgerun.decode import governor
from edgerun.decode.ngram import NgramDrafter
from edgerun.runtime.engine import Context

DEFAULT_P_MIN = 0.2  # stop drafting when the draft gives its own pick under 20%: likely rejected
PLAIN_STEPS = 64  # a plain stretch decodes up to this many tokens per native call
PLAIN_BUDGET_S = 0.05  # ... returning within about this long, so a stop request lands quickly
# The draft lags the target by a token or two after most rounds (the last accepted draft, which it
# proposed but never evaluated). A lag up to this long goes into the round's first draft batch, so
# the governor sees it as drafting cost; a longer one (the prompt, a plain stretch) is prefill.
FEED_MAX = governor.K_MAX + 2


def k_limit(target: Context) -> int:
    """The most drafts a round may verify: `last` and k drafts go to llama_decode as one batch,
    and llama.cpp aborts the process on a batch larger than the context's n_batch."""
    return max(0, target.n_batch - 1)


@dataclass(frozen=True)
class SpecConfig:
    draft: Context | None = None  # a same-vocab draft model's context
    ngram: bool = False           # prompt-lookup drafter (tried first: it costs nothing)
    k: int | None = None          # fixed draft length; None lets the governor choose
    p_min: float = DEFAULT_P_MIN
    rule: str = "rejection"       # or "match": llama.cpp server's sample-and-compare
    # the draft decodes one token at a time, every one with logits (None: when it runs on a GPU,
    # where a batch shape change costs a CUDA graph capture; see native/round.hpp)
    stable_shapes: bool | None = None
    # with no drafter and greedy sampling without penalty, llama.cpp picks each token in its graph
    # and copies back the id, not n_vocab logits (None: when the output layer is on a GPU, where
    # that saves the copy and the host's read of them: about 1% of a 0.5B step on an H200)
    device_greedy: bool | None = None
    # once no drafter will want the target's logits, a plain stretch ends by launching its newest
    # token's decode, which runs while Python hands out the stretch's tokens (None: when the
    # output layer is on a GPU; on a CPU a decode does not return before it is done)
    overlap: bool | None = None
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

    def __init__(self, cfg: SpecConfig, target: Context, prompt: list[int], *, greedy: bool = False):
        """greedy: the reply samples greedily without penalty, so plain steps may pick in
        llama.cpp's graph (cfg.device_greedy decides where that pays)."""
        self.cfg, self.target = cfg, target
        wanted = target.output_on_gpu if cfg.device_greedy is None else cfg.device_greedy
        self.device_greedy = greedy and wanted
        self.overlap = target.output_on_gpu if cfg.overlap is None else cfg.overlap
        self._in_flight = False  # the target's newest token is decoded, its pick not yet read
        self.ngram = NgramDrafter() if cfg.ngram else None
        if self.ngram:
            self.ngram.reset(prompt)
        self.gov = cfg.governors
        # a GPU's first batch shapes run cold, so its draft gets a few rounds before costs count;
        # on a CPU the first round already shows the cost
        on_gpu = target.model.n_gpu_layers > 0 or (cfg.draft is not None and cfg.draft.model.n_gpu_layers > 0)
        fresh = governor.GovernorState(warm_rounds=governor.WARM_ROUNDS if on_gpu else 1)
        self.stable_shapes = cfg.stable_shapes
        if self.stable_shapes is None:
            self.stable_shapes = cfg.draft is not None and cfg.draft.model.n_gpu_layers > 0
        self.k_cap = k_limit(target)
        for name in ("model", "ngram"):
            state = governor.new_reply(self.gov.get(name, fresh))
            self.gov[name] = replace(state, k_max=min(state.k_max, self.k_cap))
        self._pending: tuple[str, int, str] = ("none", 0, "")
        self._catch_up_s = 0.0
        self._gave_up: str | None = None  # why the model draft is out for the rest of this reply

    def _choose(self, name: str, available: int | None, remaining: int | None = None,
                lag: int = 0) -> tuple[int, str]:
        """`lag`: tokens the model draft would prefill before drafting (0 for a short lag, which
        rides along in the round's batch). k never exceeds what one batch holds, nor the context
        left: the verify batch writes `last` and k drafts from position n_past on."""
        room = min(self.k_cap, self.target.n_ctx - self.target.n_past - 1)
        available = room if available is None else min(available, room)
        if self.cfg.k is not None:
            return min(self.cfg.k, available), f"fixed k={self.cfg.k}" + (f" ({room} fit)" if room < self.cfg.k else "")
        return governor.choose(self.gov[name], available, lag=lag if lag > FEED_MAX else 0, horizon=remaining)

    def _prepare_draft(self, last: int, keep: int) -> tuple[list[int], int]:
        """Bring the draft's KV to the committed sequence, of which it holds the first `keep`
        tokens; return (feed, its start position)."""
        draft = self.cfg.draft
        start = time.perf_counter()
        # everything committed before `last` is what the target's cache holds. A short lag rides in
        # the native round's first draft batch with `last`; a long one goes in n_batch chunks here
        lag = len(self.target.tokens) - keep
        if lag > FEED_MAX or lag + 1 > draft.n_batch:  # the feed is one llama_decode batch
            draft.sync(self.target.tokens)
            keep = draft.n_past
        else:
            draft.trim(keep)
        self._catch_up_s = time.perf_counter() - start  # prefill work: the stats show it
        if lag > FEED_MAX or lag + 1 > draft.n_batch:  # ... and the governor weighs it against re-checking a losing draft
            self.gov["model"] = governor.caught_up(self.gov["model"], lag, self._catch_up_s)
        return self.target.tokens[keep:] + [last], keep

    def _check_given_up(self) -> None:
        """Ask whether the governor rules the governed model draft out (governor.given_up): before
        the prompt, and after a round's choice drafted nothing (a give-up means k=0; the costs move
        only between rounds). A give-up holds to the reply's end: later plain timings move the
        costs a little, and a draft switched back on after the sampler settled would find no logits."""
        if self._gave_up is None and self.cfg.draft is not None and self.cfg.k is None:
            self._gave_up = governor.given_up(self.gov["model"], self.k_cap)

    def _until_probe(self) -> int | None:
        """Plain tokens until the governor re-checks the model draft; 0 or less: a re-check is due,
        or the draft is given up for this reply; None: no governed model draft."""
        if self.cfg.draft is None or self.cfg.k is not None:
            return None
        if self._gave_up is not None:
            return 0
        state = self.gov["model"]
        return state.probe_every - state.plain_rounds

    def _plain_steps(self, remaining: int) -> int:
        """How many plain tokens one native call may decode: one while an n-gram match could start
        at any token; up to the governor's next re-check of a losing draft; else PLAIN_STEPS."""
        if self.ngram:
            return 1
        steps = PLAIN_STEPS
        until_probe = self._until_probe()
        if until_probe is not None and until_probe > 0:
            steps = min(steps, until_probe)
        return max(1, min(steps, remaining))

    def _settled(self) -> bool:
        """No drafter will propose again in this reply: none, or a model draft the governor gave up on."""
        until_probe = self._until_probe()
        return self.ngram is None and (self.cfg.draft is None or (until_probe is not None and until_probe <= 0))

    def settle_sampler(self) -> None:
        """Before the prompt: let plain steps pick in llama.cpp's graph when this reply will never
        need the target's logits. Only here: a switch makes llama.cpp build its scheduler anew,
        with new compute buffers, so on a GPU every batch shape runs uncaptured and is captured
        again. On an H200 with the 1.5B + 0.5B pair, a reply that switched mid-reply (once the
        governor gave up on the draft) ran at 0.935 of plain; settling before the prompt gave
        0.972 and 0.975 (docs/BENCHMARKS.md)."""
        self._check_given_up()
        self.target.greedy_on_device(self.device_greedy and self._settled())

    def _plain(self, args: dict, remaining: int) -> dict:
        steps = self._plain_steps(remaining)
        overlap = self.overlap and steps > 1 and self._settled()
        return args | dict(plain_steps=steps, in_flight=self._in_flight, overlap=overlap,
                           cap_ends_reply=steps >= remaining)

    def _land(self) -> None:
        """Drop a decode left in flight (a drafting round decodes `last` itself)."""
        if self._in_flight:
            self.target.forget_unrecorded()
            self._in_flight = False

    def finish(self) -> None:
        """The reply is over: the target's KV keeps only what was recorded (a decode left in
        flight goes; the next turn evaluates that token again with its prompt)."""
        self.target.forget_unrecorded()
        self._in_flight = False

    def round_args(self, last: int, remaining: int = 1) -> dict:
        """Arguments for _native.round (minus history, params, rule, rng). `remaining`: tokens the
        reply may still produce."""
        args = dict(target=self.target.address, draft=0, draft_feed=[], draft_n_past=0, last=last,
                    target_n_past=self.target.n_past, k=0, p_min=self.cfg.p_min, proposals=[],
                    plain_steps=1, plain_budget_s=PLAIN_BUDGET_S)
        if self.ngram:
            self.ngram.extend([last])
            proposals = self.ngram.propose(self.cfg.k or governor.K_MAX)
            if proposals:
                k, why = self._choose("ngram", len(proposals))
                self._pending = ("ngram", k, why)
                return args | dict(k=k, proposals=proposals[:k])
        if self._gave_up is not None:
            self._pending = ("model", 0, self._gave_up)
            return self._plain(args, remaining)
        if self.cfg.draft is not None:
            keep = self.cfg.draft.shared_prefix(self.target.tokens)  # once per round: O(context)
            k, why = self._choose("model", None, remaining, lag=len(self.target.tokens) - keep)
            self._pending = ("model", k, why)
            if k > 0:
                self._land()
                feed, n_past = self._prepare_draft(last, keep)
                return args | dict(k=k, draft=self.cfg.draft.address, draft_feed=feed, draft_n_past=n_past,
                                   stable_shapes=self.stable_shapes)
            self._check_given_up()  # only a round that drafts nothing can be the one that gives up
            return self._plain(args, remaining)
        self._pending = ("none", 0, "no drafter")
        return self._plain(args, remaining)

    def after(self, last: int, result: dict) -> Round:
        """Record what the round left in each KV cache and teach the governor."""
        catch_up, self._catch_up_s = self._catch_up_s, 0.0
        self._in_flight = result.get("in_flight", False)
        drafts, accepted, more = result["drafts"], result["accepted"], result["more"]
        drafter, k, why = self._pending
        if drafter == "model" and k > 0:
            # the draft's cache now holds the target's old tokens, `last`, and what it evaluated
            self.cfg.draft.tokens = self.target.tokens + [last] + drafts[: result["draft_evaluated"]]
        self.target.tokens.append(last)  # in place: no copy of the whole context per token
        self.target.tokens.extend(drafts[:accepted])
        if more:  # a plain run also evaluated `next` and all but the newest of the rest
            self.target.tokens.append(result["next"])
            self.target.tokens.extend(more[:-1])
        if self.ngram:
            self.ngram.extend(drafts[:accepted])
        steps = 1 + len(more)
        # a round without drafts is a plain step: every governor learns the plain cost from it.
        # The draft's catch-up (the prompt, or tokens made while it was off) is prefill work, not
        # the per-token cost that decides k: the stats report it, the governor does not count it.
        for name in ([drafter] if drafts else self.gov):
            if name in self.gov:
                self.gov[name] = governor.update(
                    self.gov[name], k=k if drafts else 0, drafted=len(drafts), accepted=accepted,
                    draft_s=result["draft_s"], verify_s=result["verify_s"] / steps, decided=why, steps=steps,
                )
        return Round(drafter, k, len(drafts), accepted, result["draft_s"] + catch_up, result["verify_s"], why)
