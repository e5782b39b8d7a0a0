"""Speculation around the native round: which drafter proposes, how many tokens (the governor),
the one place a round's plan is built, and committing what the round left in each KV cache."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace

from edgerun import _native
from edgerun.decode import governor
from edgerun.decode.governor import Decision, GovernorMemory, Kind
from edgerun.decode.ngram import NgramDrafter, NgramPool
from edgerun.errors import ConfigError
from edgerun.runtime.engine import Context
from edgerun.settings import SamplerSettings

DEFAULT_P_MIN = 0.2  # stop drafting when the draft gives its own pick under 20%: likely rejected
PLAIN_STEPS = 64  # a plain stretch decodes up to this many tokens per native call
PLAIN_BUDGET_S = 0.05  # ... returning within about this long, so a stop request lands quickly
# The draft lags the target by a token or two after most rounds (the last accepted draft, which it
# proposed but never evaluated). A lag up to this long goes into the round's first draft batch, so
# the governor sees it as drafting cost; a longer one (the prompt, a plain stretch) is prefill.
FEED_MAX = governor.K_MAX + 2
RULES = ("rejection", "match")  # min(1, p/q) acceptance; llama.cpp server's sample-and-compare


def k_limit(target: Context) -> int:
    """The most drafts a round may verify: `last` and k drafts go to llama_decode as one batch,
    and llama.cpp aborts the process on a batch larger than the context's n_batch."""
    return max(0, target.n_batch - 1)


@dataclass(frozen=True)
class SpecConfig:
    """How a runner speculates: configuration only (what the governor learns is GovernorMemory's)."""

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
    # once no drafter will want the target's logits (or the n-gram lookup is the only drafter), a
    # plain stretch ends by launching its newest token's decode, which runs while Python hands out
    # the stretch's tokens (None: when the output layer is on a GPU; on a CPU a decode does not
    # return before it is done)
    overlap: bool | None = None

    def __post_init__(self):
        if self.rule not in RULES:
            raise ConfigError(f"rule must be one of {', '.join(RULES)}, not {self.rule!r}")


class Mode(enum.Enum):
    """What the model draft does for the rest of a reply."""

    DRAFTING = "drafting"    # the governor (or a fixed k) chooses k every round
    PROBE_DUE = "probe due"  # off for now: plain stretches up to the governor's next re-check
    PLAIN = "plain"          # off for good: no model draft, or the governor gave up on it


@dataclass(frozen=True)
class Round:
    """One speculation round's numbers, yielded after its tokens."""

    drafter: str  # "model", "ngram" or "none"
    k: int
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    decision: Decision
    cold: bool = False  # its verify batch had no captured CUDA graph (as runtime.graphs counts them)


NO_DRAFTER = Decision(Kind.NONE, 0, "no drafter")


@dataclass(frozen=True)
class _Planned:
    """What a plan chose, for after() to account the round's result to."""

    drafter: str
    decision: Decision
    catch_up_s: float = 0.0  # the draft's prefill before the round (prefill work, shown in the stats)
    match: int | None = None  # an n-gram proposal's match length (its acceptance class)
    cold: bool = False  # its verify batch has no captured CUDA graph (runtime.graphs)


class Speculator:
    """Per-reply state: the drafters, the model draft's mode, and the plan of each round. What the
    governors learn goes to `memory`; what the KV caches hold, to the contexts (Context.commit)."""

    def __init__(self, cfg: SpecConfig, target: Context, prompt: list[int], sampling: SamplerSettings,
                 params: _native.SamplerParams, *, memory: GovernorMemory | None = None, seq: int = 0,
                 grammar: _native.Grammar | None = None,
                 pool: NgramPool | None = None):
        self.cfg, self.target, self.sampling, self.params, self.seq = cfg, target, sampling, params, seq
        self.grammar = grammar  # the reply's constraint state: every round picks under it and advances it
        self.memory = memory if memory is not None else GovernorMemory()
        # a pick in llama.cpp's graph would not see the grammar
        greedy = sampling.greedy and not sampling.penalized and grammar is None
        wanted = target.output_on_gpu if cfg.device_greedy is None else cfg.device_greedy
        self.device_greedy = greedy and wanted  # the target may pick in llama.cpp's graph
        self.overlap = target.output_on_gpu if cfg.overlap is None else cfg.overlap
        self.ngram = NgramDrafter(is_stop=target.model.is_eog, pool=pool) if cfg.ngram else None
        if self.ngram:
            self.ngram.reset(prompt)
        self.stable_shapes = cfg.stable_shapes
        if self.stable_shapes is None:
            self.stable_shapes = cfg.draft is not None and cfg.draft.model.n_gpu_layers > 0
        self.k_cap = k_limit(target)
        # a GPU's first batch shapes run cold, so its draft gets a few rounds before costs count;
        # on a CPU the first round already shows the cost
        on_gpu = target.model.n_gpu_layers > 0 or (cfg.draft is not None and cfg.draft.model.n_gpu_layers > 0)
        fresh = governor.GovernorState(warm_rounds=governor.WARM_ROUNDS if on_gpu else 1)
        self.drafters = [name for name, on in (("model", cfg.draft is not None), ("ngram", cfg.ngram)) if on]
        for name in self.drafters:
            state = governor.new_reply(self.memory.get(name) or fresh)
            limit = governor.K_MAX_NGRAM if name == "ngram" else governor.K_MAX
            self.memory.put(name, replace(state, k_max=min(limit, self.k_cap), hopeful=name == "ngram"))
        self.mode = Mode.DRAFTING if cfg.draft is not None else Mode.PLAIN
        self.off_why: Decision | None = None  # the give-up, while the mode is PLAIN for a model draft
        self._planned = _Planned("none", NO_DRAFTER)
        self._least: tuple | None = None  # (key, plain step's cost, answer): see _least_match
        self._returned: float | None = None  # when the last native round returned (perf_counter)

    @property
    def governed(self) -> bool:
        return self.cfg.draft is not None and self.cfg.k is None

    def _choose(self, name: str, available: int | None, remaining: int | None = None, lag: int = 0,
                match: int | None = None, ends: bool = False, cold: frozenset[int] = frozenset()) -> Decision:
        """`lag`: tokens the model draft would prefill before drafting (0 for a short lag, which
        rides along in the round's batch); `ends`: nothing follows the proposal to copy; `cold`:
        verify sizes without a captured CUDA graph (governor.choose). k never
        exceeds what one batch holds, nor the context left: the verify batch writes `last` and k
        drafts from position n_past on."""
        room = min(self.k_cap, self.target.n_ctx - len(self.target.held(self.seq)) - 1)
        ends = ends and available is not None and available <= room  # a batch's or the context's limit is no end
        available = room if available is None else min(available, room)
        if self.cfg.k is not None:
            fit = f" ({room} fit)" if room < self.cfg.k else ""
            return Decision(Kind.FIXED, min(self.cfg.k, available), f"fixed k={self.cfg.k}{fit}")
        return governor.choose(self.memory.get(name), available, lag=lag if lag > FEED_MAX else 0, horizon=remaining,
                               match=match, ends=ends, cold=cold)

    def _set_mode(self, decision: Decision) -> None:
        """The governed model draft's mode after a decision. A give-up holds to the reply's end:
        later plain timings move the costs a little, and a draft switched back on after the
        sampler settled would find no logits."""
        if decision.gives_up:
            self.mode, self.off_why = Mode.PLAIN, decision
        else:
            self.mode = Mode.DRAFTING if decision.k > 0 else Mode.PROBE_DUE

    def _prepare_draft(self, last: int, keep: int) -> tuple[list[int], int, float]:
        """Bring the draft's KV to the committed sequence, of which it holds the first `keep`
        tokens; return (feed, its start position, seconds of catch-up prefill)."""
        draft = self.cfg.draft
        start = time.perf_counter()
        # everything committed before `last` is what the target's cache holds. A short lag rides in
        # the native round's first draft batch with `last`; a long one goes in n_batch chunks here
        committed = self.target.held(self.seq)
        lag = len(committed) - keep
        long_lag = lag > FEED_MAX or lag + 1 > draft.n_batch  # the feed is one llama_decode batch
        if long_lag:
            draft.sync(committed, seq=self.seq)
            keep = len(draft.held(self.seq))
        else:
            draft.trim(keep, self.seq)
        catch_up = time.perf_counter() - start
        if long_lag:  # ... and the governor weighs it against re-checking a losing draft
            self.memory.put("model", governor.caught_up(self.memory.get("model"), lag, catch_up))
        return committed[keep:] + [last], keep, catch_up

    def _plain_steps(self, remaining: int, kept: tuple[bool, int | None]) -> int:
        """How many plain tokens one native call may decode: PLAIN_STEPS, but one while the model
        draft may draft at the next token, and no further than a governor's next re-check of a
        losing draft, nor than where the n-gram drafter could first find a proposal the governor
        may draft (a match of least_match tokens: NgramDrafter.quiet_steps). `kept`: what
        _kept_least said at this plan."""
        steps = PLAIN_STEPS
        if self.cfg.draft is not None and self.mode is Mode.DRAFTING:
            steps = 1
        elif self.mode is Mode.PROBE_DUE:
            state = self.memory.get("model")
            steps = min(steps, max(1, state.probe_every - state.plain_rounds))
        if self.ngram:
            state = self.memory.get("ngram")
            if state.plain_rounds < state.probe_every:  # where a re-check falls due, least_match falls
                steps = min(steps, state.probe_every - state.plain_rounds)
            least = self._least_match(kept)
            if least is not None:
                steps = min(steps, self.ngram.quiet_steps(least))
        return max(1, min(steps, remaining))

    def _kept_least(self) -> tuple[bool, int | None]:
        """(whether the least_match answer kept is still good, that answer): a fixed k drafts on
        any match; the governor's answer holds while its key does and the plain step's cost
        stays within LEAST_DRIFT of what it was."""
        if self.cfg.k is not None:
            return True, self.ngram.n_min
        state, kept = self.memory.get("ngram"), self._least
        if kept is not None and kept[0] == governor.least_match_key(state) and \
                governor.least_match_holds(kept[1], governor.plain_cost(state)):
            return True, kept[2]
        return False, None

    def _least_match(self, kept: tuple[bool, int | None]) -> int | None:
        """The shortest match the n-gram drafter may draft on, worked out again (governor.least_match)
        where the kept answer no longer holds. Only a plain call asks for it so: a copy in progress
        drafts round after round, each a drafted round that changes the key. `kept`: what
        _kept_least said at this plan."""
        good, least = kept
        if not good:
            state = self.memory.get("ngram")
            least = governor.least_match(state)
            self._least = (governor.least_match_key(state), governor.plain_cost(state), least)
        return least

    def _settled(self) -> bool:
        """No drafter will propose again in this reply: none, or a model draft given up."""
        return self.ngram is None and self.mode is Mode.PLAIN

    def settle_sampler(self) -> None:
        """Before the prompt: let the target pick in llama.cpp's graph when this reply will never
        need its logits. Only here: a switch makes llama.cpp build its scheduler anew,
        with new compute buffers, so on a GPU every batch shape runs uncaptured and is captured
        again. On an H200 with the 1.5B + 0.5B pair, a reply that switched mid-reply (once the
        governor gave up on the draft) ran at 0.935 of plain; settling before the prompt gave
        0.972 and 0.975 (docs/BENCHMARKS.md)."""
        if self.governed and self.mode is Mode.DRAFTING:
            off = governor.given_up(self.memory.get("model"), self.k_cap)
            if off is not None:
                self._set_mode(off)
        self.target.greedy_on_device(self.device_greedy and (self._settled() or self._picks_suffice()))

    def _picks_suffice(self) -> bool:
        """Every round of this reply can verify by the pick alone: n-gram proposals only (point
        masses: a draft is accepted while it is the target's greedy pick), so the pick may run in
        llama.cpp's graph for drafted rounds too: no row of logits (600 KB for Qwen's vocabulary)
        is copied back and read by the host at each token."""
        return self.ngram is not None and self.cfg.draft is None

    def plan(self, last: int, remaining: int = 1) -> _native.RoundPlan:
        """The next round's plan: the one place a RoundPlan is built. `remaining`: tokens the reply
        may still produce."""
        plan = _native.RoundPlan()
        committed = self.target.held(self.seq)
        plan.target, plan.seq, plan.last, plan.target_n_past = self.target.address, self.seq, last, len(committed)
        plan.p_min, plan.params, plan.rule, plan.plain_budget_s = self.cfg.p_min, self.params, self.cfg.rule, PLAIN_BUDGET_S
        plan.history = self.sampling.penalty_window(committed, last)
        plan.grammar = self.grammar
        plan.picked = self.target.picks_on_device  # settled before the prompt (settle_sampler)
        kept = (True, None)  # the kept least_match answer (_kept_least), asked once a plan
        if self.ngram:
            self.ngram.extend([last])
            # a proposal runs as far as the earlier text does (up to the most one round may take)
            proposal = self.ngram.lookup(self.cfg.k or governor.K_MAX_NGRAM)
            kept = self._kept_least()
            known, least = kept
            if proposal.tokens and known and (least is None or proposal.match < least):
                # a class that drafts on no proposal, however long, drafts on none: not priced
                short = Decision(Kind.PLAIN, 0, f"no draft on a {proposal.match}-token match")
                self._planned = _Planned("ngram", short, match=proposal.match)
                return self._plain(plan, remaining, kept)
            if proposal.tokens:
                # the governor drafts nothing past the reply's token budget (never shown); a fixed k is the user's
                budget = len(proposal.tokens) if self.cfg.k is not None else min(len(proposal.tokens), max(1, remaining))
                # a proposal shorter than asked for is where the copy (or the reply's budget) ends
                # only the n-gram drafter's rounds are priced cold: a model draft's are at most
                # K_MAX + 1 tokens, and how they run cold was not measured
                cold = self.target.cold_verify_sizes(budget, self.seq)
                decision = self._choose("ngram", budget, match=proposal.match, ends=budget < governor.K_MAX_NGRAM,
                                        cold=cold)
                self._planned = _Planned("ngram", decision, match=proposal.match, cold=decision.k + 1 in cold)
                if decision.k == 0:
                    return self._plain(plan, remaining, kept)
                plan.k, plan.proposals = decision.k, proposal.tokens[: decision.k]
                # drafts verify after a decode of `last` left in flight, if any: its row checks the first
                plan.in_flight = self.target.in_flight(self.seq)
                # ... and the round leaves its own last token's decode in flight, where the reply
                # goes on after it even if every draft holds
                plan.overlap = self.overlap and self.cfg.draft is None and decision.k + 1 < remaining
                return plan
        if self.cfg.draft is None or self.mode is Mode.PLAIN:
            self._planned = _Planned("model", self.off_why) if self.off_why else _Planned("none", NO_DRAFTER)
            return self._plain(plan, remaining, kept)
        keep = self.cfg.draft.shared_prefix(committed, self.seq)  # once per round: O(context)
        decision = self._choose("model", None, remaining, lag=len(committed) - keep)
        if self.governed:
            self._set_mode(decision)
        if decision.k == 0:
            self._planned = _Planned("model", decision)
            return self._plain(plan, remaining, kept)
        self.target.land(self.seq)  # a drafting round decodes `last` itself: drop one left in flight
        feed, n_past, catch_up = self._prepare_draft(last, keep)
        self._planned = _Planned("model", decision, catch_up)
        plan.k, plan.draft, plan.draft_feed, plan.draft_n_past = decision.k, self.cfg.draft.address, feed, n_past
        plan.stable_shapes = self.stable_shapes
        return plan

    def _plain(self, plan: _native.RoundPlan, remaining: int, kept: tuple[bool, int | None]) -> _native.RoundPlan:
        steps = self._plain_steps(remaining, kept)
        plan.plain_steps, plan.in_flight = steps, self.target.in_flight(self.seq)
        # an n-gram lookup needs no logits of earlier steps, and a round of its proposals verifies
        # after a decode left in flight: each single step's decode runs while Python looks up the
        # next proposal (a model draft's round would drop that decode and make it again)
        ahead = self._settled() or (self.ngram is not None and self.cfg.draft is None)
        plan.overlap, plan.cap_ends_reply = self.overlap and ahead, steps >= remaining
        return plan

    def after(self, result: _native.RoundResult) -> Round:
        """Commit what the round left in each KV cache and teach the governors."""
        hidden = self._hidden(result)  # first: the clock at the round's return, the KV as it began
        planned = self._planned
        self.target.commit(self.seq, result.target, drafted=len(result.drafts))
        drafts, accepted, more = result.drafts, result.accepted, result.more
        if planned.drafter == "model" and planned.decision.k > 0:
            self.cfg.draft.commit(self.seq, result.draft)
        if self.ngram:  # what came before the round's last token (the next plan adds that one)
            self.ngram.extend([*drafts[:accepted], result.next, *result.more][:-1])
        steps = 1 + len(more)
        seconds = result.verify_s + hidden
        # a round without drafts is a plain step: every governor learns the plain cost from it.
        # The draft's catch-up (the prompt, or tokens made while it was off) is prefill work, not
        # the per-token cost that decides k: the stats report it, the governor does not count it.
        for name in [planned.drafter] if drafts else self.drafters:
            if name in self.memory:
                self.memory.put(name, governor.update(
                    self.memory.get(name), k=planned.decision.k if drafts else 0, drafted=len(drafts),
                    accepted=accepted, draft_s=result.draft_s, verify_s=seconds / steps, steps=steps,
                    match=planned.match if drafts else None, cold=planned.cold and bool(drafts)))
        return Round(planned.drafter, planned.decision.k, len(drafts), accepted,
                     result.draft_s + planned.catch_up_s, result.verify_s, planned.decision,
                     cold=planned.cold and bool(drafts))

    def _hidden(self, result: _native.RoundResult) -> float:
        """The part of a round's target work its own timing does not show: a round that starts
        from a decode the last one left in flight finds that decode done or nearly so, since it
        ran while the host handled the last round and planned this one. Its time is that gap,
        from the last round's return to this one's call (the host's time, where the host took
        longer than the decode). Without it a plain step on a GPU reads as the wait for the rest
        of its decode: on an H100 with the 1.5B, 0.65-1.1 ms after a proposal was priced against
        2.0-2.1 ms for a step, and plain decoding then outran copies of up to 64 matched tokens
        (docs/ARCHITECTURE.md, "A decode left in flight")."""
        now = time.perf_counter()
        hidden = 0.0
        # before commit, the context still says whether the round began from a decode in flight
        if self._returned is not None and self.target.in_flight(self.seq):
            hidden = max(0.0, now - result.draft_s - result.verify_s - self._returned)
        self._returned = now
        return hidden

    def finish(self) -> None:
        """The reply is over: each KV keeps only what was recorded (a decode left in flight goes;
        the next turn evaluates that token again with its prompt; after a failed round, whatever
        it decoded past the records)."""
        self.target.drop_unrecorded(self.seq)
        if self.cfg.draft is not None:
            self.cfg.draft.drop_unrecorded(self.seq)
