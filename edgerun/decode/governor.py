"""The draft-length controller: each round, choose k (0 = plain decoding) to maximize expected
tokens per second, from measured acceptance and measured costs. Pure functions on a small state
record, answering with a typed Decision; GovernorMemory keeps what was learned across replies.
No model needed to test it."""

from __future__ import annotations

import bisect
import enum
import functools
import math
import statistics
from dataclasses import dataclass, replace

K_MAX = 8            # most drafts of a model draft per round (and what load-time timing covers)
K_MAX_NGRAM = 64     # most drafts of the n-gram drafter: a long exact copy drafts in long rounds
MATCH_BUCKETS = 6    # acceptance kept apart by match length: 2-3, 4-7, 8-15, 16-31, 32-63, 64
EMA = 0.15           # weight of the newest measurement
PRIOR_ALPHA = 0.6    # acceptance assumed before any draft was verified
PRIOR_TRIALS = 1.0   # ... worth this many accept/reject decisions
MATCH_PRIOR_TRIALS = 2.0  # a match class's prior acceptance is worth this many decisions (see predicted_tokens)
PROBE_FIRST = 8      # plain rounds before re-checking a draft that lost
PROBE_MAX = 256      # ... growing up to this while it keeps losing
PROBE_COST_MAX = 0.02  # a re-check may cost at most this share of plain decoding time in draft catch-up
LEAST_DRIFT = 1.1    # least_match's answer holds while the plain step's cost stays within this factor
BLOCK = 4            # llama.cpp's CPU matmul takes a batch's rows this many at a time (see lone_row)
TILE = 16            # ... and, for weights it does not repack, this many rows per chunk (see curve)
WARM_ROUNDS = 3      # drafted rounds measured before costs may rule a GPU draft out (first shapes run cold)
BIAS_ROUNDS = 5      # drafted rounds whose cost against the table's price makes the verify bias (see verify_bias)
COLD_PRIOR = 3.0     # a verify batch without a captured CUDA graph, over the table's price, until measured (see cold_factor)


class Kind(enum.Enum):
    """What a decision is, for code and tests (its reason string is for people only)."""

    NONE = "none"          # nothing to draft with: no drafter, or no proposal fits
    FIXED = "fixed"        # the user fixed k
    MEASURE = "measure"    # k chosen to measure a cost (plain decoding, the draft, a longer k)
    DRAFT = "draft"        # the k with the best expected rate
    PROBE = "probe"        # one draft to re-check a losing draft's acceptance
    PLAIN = "plain"        # plain wins for now; a re-check comes later
    HOPELESS = "hopeless"  # given up: even 100% acceptance cannot beat plain
    COSTLY = "costly"      # given up: a re-check's catch-up would cost over PROBE_COST_MAX


@dataclass(frozen=True)
class Decision:
    """The governor's answer for one round: k drafts (0 = plain) and why."""

    kind: Kind
    k: int
    reason: str = ""  # for display only

    @property
    def gives_up(self) -> bool:
        """The draft is out for the rest of the reply."""
        return self.kind in (Kind.HOPELESS, Kind.COSTLY)


@dataclass(frozen=True)
class Costs:
    """Measured costs to start a governor from, instead of learning them in the first rounds:
    what the runner times at load, or what a test or benchmark injects."""

    verify_s: tuple[tuple[int, float], ...]  # (batch size, seconds): the target decoding n tokens at once
    draft_step_s: float | None = None  # one draft token (0.0 for the n-gram lookup)
    catch_up_s: float | None = None    # draft prefill per token


@dataclass(frozen=True)
class GovernorState:
    alpha: float = PRIOR_ALPHA      # per-token acceptance probability (geometric model)
    accepted_ema: float = PRIOR_ALPHA * PRIOR_TRIALS  # accepted drafts per drafted round
    trials_ema: float = PRIOR_TRIALS  # accept/reject decisions per drafted round
    draft_step_s: float | None = None  # one draft token
    verify_s: tuple[tuple[int, float], ...] = ()  # (batch size, seconds) EMAs, sorted
    plain_rounds: int = 0           # consecutive k = 0 rounds
    probe_every: int = PROBE_FIRST
    k_max: int = K_MAX
    drafted_rounds: int = 0         # rounds with drafts so far (the first ones run cold)
    warm_rounds: int = WARM_ROUNDS  # ... measured before costs may rule the draft out (1 on a CPU)
    catch_up_s: float | None = None  # draft prefill per token: what re-checking costs after a plain stretch
    plain_from_load: bool = False   # the plain step's cost is still the load-time timing: time one in place
    verify_seen: tuple[int, ...] = ()  # batch sizes timed in a reply (the others only at load: a prior)
    hopeful: bool = False  # take a load-time-only timing at its most hopeful (free drafts: n-gram)
    # (match bucket, accepted, rejected, rounds): the n-gram drafter's acceptance by match length,
    # as decayed counts of accept/reject decisions (a Beta posterior; see predicted_tokens)
    by_match: tuple[tuple[int, float, float, int], ...] = ()
    # (accepted, rejected): the counts of the class the next proposal is in (for_match sets them);
    # a round's expected tokens then follow what they predict, not the point estimate alpha
    counts: tuple[float, float] | None = None
    # the latest drafted rounds' verify time over what the table priced them at (see verify_bias)
    verify_ratios: tuple[float, ...] = ()
    # ... and the same of the latest rounds whose batch had no captured CUDA graph (see cold_factor)
    cold_ratios: tuple[float, ...] = ()


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens a round yields with k drafts: 1 + alpha + ... + alpha^k."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_tokens(accepted: float, rejected: float, k_max: int) -> list[float]:
    """Mean tokens a round yields with k = 0..k_max drafts when the per-token acceptance is known
    only through `accepted` and `rejected` decisions (a Beta posterior): 1 + the sum over i <= k
    of the chance that the first i drafts are all accepted, E[alpha^i] = prod over j < i of
    (accepted + j) / (accepted + rejected + j).
    An n-gram proposal is either a copy in progress (nearly every token right, to the copy's
    end) or a chance match (nearly none), and its first rounds cannot tell which: an acceptance
    of 0.8 known from five decisions leaves a fair chance that it is 0.99, and then a long draft
    pays. With the point estimate alone (1 + 0.8 + ... + 0.8^k, never past 5 tokens) a copy
    drafted 3, then 15, then 35 before its rounds said what the first could have; with the
    posterior a copy's second round drafts a batch's worth. Many decisions make the two agree."""
    out, run, total = [1.0], 1.0, 1.0
    for j in range(k_max):
        run *= (accepted + j) / (accepted + rejected + j)
        total += run
        out.append(total)
    return out


def _gains(state: GovernorState, k_max: int) -> list[float]:
    """Expected tokens of a round with k = 0..k_max drafts, as the state believes them."""
    if state.counts is not None:
        return predicted_tokens(*state.counts, k_max)
    return [expected_tokens(state.alpha, k) for k in range(k_max + 1)]


def verify_bias(state: GovernorState) -> float:
    """How far the reply's drafted rounds cost from what the table priced them at: the median of
    the latest BIAS_ROUNDS ratios (1 until three are known), which multiplies the price of every
    batch of two or more. A table timed at load can be far from what a round costs in a reply:
    on a GPU a round waits for the decode left in flight, runs a batch shape that is not captured
    yet, and (unless the graph picks) copies a row of logits a token and samples it, where the
    load-time timing ran a captured shape alone. Sizes are many and each runs rarely, so their
    own timings would learn this one round at a time; the ratio learns it for all of them at
    once. A median moves for no single stall, and a table that catches up brings the ratios
    back to 1."""
    ratios = state.verify_ratios
    return statistics.median(ratios) if len(ratios) >= 3 else 1.0


def cold_factor(state: GovernorState) -> float:
    """How much more a verify batch costs while its shape has no captured CUDA graph (the caller
    says which sizes: runtime.graphs) than the table says: the median of the latest BIAS_ROUNDS
    such rounds' ratios, COLD_PRIOR until three are known. The table is timed on captured shapes
    and learns from rounds that replay one; a cold round runs the kernels one by one or pays the
    capture (on an H100, 1.5B: such rounds of 2-48 tokens cost 1.6-6.9 times the table's price,
    most of them about 3, where rounds that replayed cost 1.0-2.3 times it). Priced so,
    a chance match drafts only where its odds pay for the cold batch, and a size already captured
    at this KV length is preferred to one a token longer that is not."""
    ratios = state.cold_ratios
    return statistics.median(ratios) if len(ratios) >= 3 else COLD_PRIOR


def verify_time(state: GovernorState, n: int) -> float | None:
    """Seconds for the target to decode n tokens in one batch: measured, else a line between the
    nearest measurements around n (beyond the largest, the last segment of their lower convex
    hull), else None.
    The cost is not smooth in n: llama.cpp's CPU kernels take 4 tokens at a time and the rest one
    by one, so 4 tokens can cost less than 3 (measured: 117 vs 134 ms on the 1.5B, 2 threads).
    For a drafter whose drafts are free (`hopeful`: the n-gram lookup), a size timed only at
    load is a prior taken at its most hopeful: no dearer than one token fewer, until the size
    runs in a reply. So one slow load-time sample cannot keep the governor from ever trying a
    size; trying it costs one round's verify, and the reply's own timing decides. A size with
    rows past a block's end is no dearer than its whole blocks and those rows alone, once that
    row's step is known (lone_row): the step is the kernels', not a stall. (given_up and hopeless believe the load-time
    timings as they are.)"""
    return curve(state, n)[n - 1] if n >= 1 else None


def curve(state: GovernorState, n_max: int) -> list[float | None]:
    """verify_time of 1..n_max tokens (index n - 1), computed in one pass: the governor weighs up
    to 65 batch sizes every round."""
    return list(_curve(*_table(state), n_max, verify_bias(state)))


def _table(state: GovernorState) -> tuple:
    """What _curve prices from, besides the bias. The sizes seen in a reply count only for a
    hopeful drafter; leaving them out of the key lets choose() and given_up() share one
    computation (a round asks for the same curve up to three times)."""
    return state.verify_s, state.verify_seen if state.hopeful else (), state.hopeful


@functools.lru_cache(maxsize=256)
def _curve(verify_s: tuple[tuple[int, float], ...], verify_seen: tuple[int, ...], hopeful: bool,
           n_max: int, bias: float = 1.0) -> tuple[float | None, ...]:
    if bias != 1.0:
        unbiased = _curve(verify_s, verify_seen, hopeful, n_max)
        return tuple(t if t is None or n == 1 else t * bias for n, t in enumerate(unbiased, 1))
    table = dict(verify_s)
    if not table:
        return (None,) * n_max
    pts, seen, largest = sorted(table.items()), set(verify_seen), max(table)
    lone = lone_row(table)
    # with a lone row's step known, sizes not timed are priced from whole blocks (and one token),
    # then each row past them alone: a timed 17 says nothing about 32 but through its 16
    blocks = [p for p in pts if p[0] % BLOCK == 0 or p[0] == 1] if lone else pts
    # The same kernels multiply the weights they do not repack (the output layer's Q6_K among
    # them) TILE rows of the batch at a time, reading those weights once per chunk, so a size
    # just past a whole chunk costs more than the line through whole chunks says (1.5B, 2
    # threads: 32, 44, 48 in 431, 628, 603 ms; the line said 572 for 44). Such a size is priced
    # as its whole chunks and each row past them at a small batch's cost per row (8 over 4),
    # up to what the next whole chunk costs, and never below the blocks' price.
    row = (table[2 * BLOCK] - table[BLOCK]) / BLOCK if lone and BLOCK in table and 2 * BLOCK in table else None
    out = []
    for n in range(1, n_max + 1):
        if n not in table:
            whole = n - n % BLOCK
            if lone and whole >= BLOCK and len(blocks) >= 2:
                price = (table[whole] if whole in table else _line_pts(blocks, whole)) + (n - whole) * lone
                if row is not None and n > TILE and n % TILE:
                    lower = n - n % TILE
                    above = table[lower + TILE] if lower + TILE in table else _line_pts(blocks, lower + TILE)
                    price = max(price, min(out[lower - 1] + (n - lower) * row, above))
                out.append(price)
            else:
                out.append(_line_pts(pts, n))
        elif not hopeful or n in seen or n - 1 not in table or n >= largest:
            out.append(table[n])
        elif lone and n % BLOCK and n - n % BLOCK in table:  # no dearer than its blocks and rows alone
            out.append(min(table[n], table[n - n % BLOCK] + n % BLOCK * lone))
        else:
            out.append(min(table[n], table[n - 1]))
    return tuple(out)


def lone_row(table: dict[int, float]) -> float:
    """What a row past the last whole block of BLOCK costs, from sizes timed on both sides of a
    block's end (n and n + r, n a multiple of BLOCK): the median step per row (one stalled
    timing among them moves it little), 0 when no pair is timed or the steps cost nothing. llama.cpp's CPU kernels for repacked weights (Q4_K, Q4_0,
    IQ4_NL) multiply rows in blocks of 4 and each row left over alone, reading all the weights
    again: a 17-token batch costs the 16 and about a third of a plain step more, and the
    governor prices a size it has not timed the same way, so it prefers k = 15, 31, 63 where the
    proposal allows. Where batches cost no such step (a GPU), the timings say 0."""
    steps = [(table[n + r] - table[n]) / r for n in table if n >= BLOCK and n % BLOCK == 0
             for r in range(1, BLOCK) if n + r in table]
    return max(0.0, statistics.median(steps)) if steps else 0.0


def _rate_at(costs: list[float | None], gains: list[float], draft_step_s: float | None, k: int) -> float | None:
    tv = costs[k]
    if tv is None or (k > 0 and draft_step_s is None):
        return None
    cost = tv + k * (draft_step_s or 0.0)
    return gains[k] / cost if cost > 0 else None


def _believed(state: GovernorState) -> GovernorState:
    """The state with every timing taken as it is (load-time ones included)."""
    if not state.hopeful:
        return state  # the sizes seen in a reply count only for a hopeful drafter (see curve)
    return replace(state, verify_seen=tuple(n for n, _ in state.verify_s))


def _line_pts(pts: list[tuple[int, float]], n: int) -> float:
    """The price of a size not in pts (sorted by size) from the sizes around it."""
    if len(pts) == 1:
        (n1, t1), = pts
        return t1 * (1 + 0.25 * (n - n1))  # assume batching is cheap until measured
    i = bisect.bisect_left(pts, (n,))  # pts[:i] are below n, pts[i:] above (n is not in pts)
    if i == len(pts):
        return _beyond(pts, n)
    (na, ta), (nb, tb) = (pts[i - 1], pts[i]) if i > 0 else (pts[0], pts[-1])
    slope = max(0.0, (tb - ta) / (nb - na))
    return ta + slope * (n - na)


def _beyond(pts: list[tuple[int, float]], n: int) -> float:
    """Past the largest size timed: its cost plus the cheapest cost per extra token seen
    (the lower convex hull's flattest segment; once sizes past K_MAX + 1 have run, the flattest
    among segments reaching half the largest size). Hopeful on purpose: on a CPU the
    cost per token falls again for large batches (one thread, 1.5B: 225 ms a token at 9, 145 at
    20, 125 at 40), which no line through small batches shows; a hopeful price gets a larger
    batch tried, explore_cap keeps each try to twice the largest, and its own timing then counts.
    A size llama.cpp's kernels make dear (17: 16 in blocks of 4, then one alone) lies above the
    hull and does not steepen the slope that prices 32 or 64."""
    hull, largest = _lower_hull(pts), pts[-1][0]
    # once batches past load-time timing have run, only the large ones' slopes count: the flat
    # start of a CPU's curve (a few tokens read the weights once) says nothing about 64
    any_segment = largest <= K_MAX + 1
    slope = min(max(0.0, (tb - ta) / (nb - na)) for (na, ta), (nb, tb) in zip(hull, hull[1:])
                if any_segment or 2 * nb >= largest)
    return pts[-1][1] + slope * (n - largest)


def _lower_hull(pts: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The lower convex hull of (batch size, seconds), in order of size."""
    hull: list[tuple[int, float]] = []
    for p in pts:
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])
                                  >= (p[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append(p)
    return hull


def explore_cap(state: GovernorState) -> int:
    """The most drafts the costs known so far may justify: a batch at most twice the largest one
    timed (K_MAX, which load-time timing covers, at least). Beyond the timings the cost is a straight line, and on a CPU the line through small
    batches (which cost little more than one token: the weights are read once) is far too cheap
    for large ones (which compute for every token). Doubling reaches 64 drafts in three rounds,
    each a real measurement, instead of one 64-draft round priced by a guess."""
    largest = max((m for m, _ in state.verify_s), default=1)
    return max(K_MAX, 2 * largest - 1)


def match_bucket(match: int) -> int:
    """The acceptance class of an n-gram proposal whose match is `match` tokens long."""
    return min(MATCH_BUCKETS - 1, max(0, int(math.log2(max(match, 2))) - 1))


def match_prior(bucket: int) -> float:
    """Acceptance assumed for a match-length class before any of its rounds: Laplace's rule of
    succession on its shortest match m (a copy that held for m tokens holds for the next with
    probability (m + 1) / (m + 2)), never below PRIOR_ALPHA; chance 2-3 token matches get PRIOR_ALPHA."""
    m = 2 ** (bucket + 1)
    return PRIOR_ALPHA if bucket == 0 else max(PRIOR_ALPHA, (m + 1) / (m + 2))


def _logit(p: float) -> float:
    p = min(1 - 1e-9, max(1e-9, p))
    return math.log(p / (1 - p))


def _learned(by_match: tuple[tuple[int, float, float, int], ...]) -> dict[int, tuple[float, float]]:
    """The classes with rounds and their counts: class -> (accepted, rejected)."""
    return {b: (accepted, rejected) for b, accepted, rejected, _ in by_match}


def _prior_counts(bucket: int, learned: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """A class's prior as counts worth MATCH_PRIOR_TRIALS decisions: match_prior, lowered in
    log-odds by as much as the nearest class with rounds (`learned`: class -> counts) fell short
    of its own. How often a match of any length goes on is mostly the text's: in new code a
    4-token match is as much chance as the 2-token ones that keep failing, while in an edit the
    short matches hold too. Never raised: a class that did well vouches for longer ones in
    for_match as it is."""
    prior = match_prior(bucket)
    if learned:
        near = min(learned, key=lambda b: (abs(b - bucket), b))
        short = _logit(_mean(learned[near])) - _logit(match_prior(near))
        if short < 0:
            prior = 1 / (1 + math.exp(-(_logit(prior) + short)))
    return prior * MATCH_PRIOR_TRIALS, (1 - prior) * MATCH_PRIOR_TRIALS


def _mean(counts: tuple[float, float]) -> float:
    return counts[0] / (counts[0] + counts[1])


def for_match(state: GovernorState, match: int | None) -> GovernorState:
    """The state with the acceptance learned for proposals of this match length (the class's
    prior while it has no rounds yet); the state as it is when match is None."""
    if match is None:
        return state
    bucket = match_bucket(match)
    learned = _learned(state.by_match)
    counts = learned.get(bucket)
    if counts is None:
        # a class without rounds yet: a longer match is at least as likely right as a shorter
        # one, so an exact copy that held for 8 tokens vouches for the same copy at 16 before a
        # round of 16 has run (a short reply has few rounds to learn each class in)
        counts = max([_prior_counts(bucket, learned), *(c for b, c in learned.items() if b < bucket)], key=_mean)
    return replace(state, alpha=_mean(counts), counts=counts)


def rate(state: GovernorState, k: int) -> float | None:
    """Expected tokens per second with k drafts (None while a cost is unknown)."""
    return _rate_at(curve(state, k + 1), _gains(state, k), state.draft_step_s, k)


def choose(state: GovernorState, available: int | None = None, *, lag: int = 0,
           horizon: int | None = None, match: int | None = None, ends: bool = False,
           cold: frozenset[int] = frozenset()) -> Decision:
    """k for the next round and why. `available` caps k (an n-gram drafter's proposal length);
    `lag`: tokens the draft must prefill before it can draft (its prompt, a plain stretch);
    `horizon`: tokens the reply may still produce, over which drafting must win that back;
    `match`: the n-gram proposal's match length (its acceptance class); `ends`: the proposal is
    all there is to copy (the earlier text, or the reply's budget, ends after it), so drafts
    left out of this round cost a round of their own (see _best); `cold`: verify batch sizes
    (drafts + 1) whose CUDA graph is not captured for this round, priced at cold_factor."""
    state = for_match(state, match)
    k_cap = state.k_max if available is None else min(state.k_max, available)
    k_cap = min(k_cap, explore_cap(state))
    if k_cap == 0:
        return Decision(Kind.NONE, 0, "no draft available: plain step")
    plain = rate(state, 0)
    if plain is None:
        return Decision(Kind.MEASURE, 0, "measuring plain decoding")
    measured = _draft_measured(state)
    end = available if ends and available is not None and available <= state.k_max else None
    best_k, best = _best(state, k_cap, plain, end, cold) if measured else (0, plain)
    off = None
    if measured:  # a drafter that is not hopeful takes every timing as it is: given_up would find this best k again
        off = given_up(state, k_cap) if state.hopeful else _off_for_good(state, k_cap, plain, best_k)
    if off:
        return off
    if state.plain_from_load and not state.hopeful:
        # a timing taken at load, between other shapes, can be far off (on a GPU: 2.9 ms measured
        # vs 1.8 ms in a reply). Drafting never times a plain step, so one wrong number there
        # would keep a losing draft on for the whole session: time one real step first. A
        # hopeful drafter (the n-gram lookup) times one at every token it has nothing to propose
        # for, or decides k = 0 on: it drafts at once (on a code edit the first round is a copy).
        return Decision(Kind.MEASURE, 0, "timing a plain step")
    if not measured:
        return Decision(Kind.MEASURE, min(2, k_cap), "measuring the draft")
    if best_k == 0 and state.plain_rounds >= state.probe_every:
        return Decision(Kind.PROBE, 1, f"re-checking the draft (plain wins: {plain:.1f} tok/s)")
    if best_k == 0:
        return Decision(Kind.PLAIN, 0, f"draft off: plain {plain:.1f} tok/s beats any k (acceptance {state.alpha:.0%})")
    if lag and state.catch_up_s and horizon is not None:
        # the catch-up is paid now; drafting wins (1/plain - 1/best) seconds per token from then on
        cost, win = lag * state.catch_up_s, horizon * (1 / plain - 1 / best)
        if cost >= win:
            return Decision(Kind.PLAIN, 0, f"draft off: catching up {lag} tokens costs {cost:.2f} s, more than"
                                           f" k={best_k} would win in the {horizon} tokens left ({win:.2f} s)")
    table = dict(state.verify_s)
    if best_k < k_cap and best_k + 2 not in table and not lone_row(table):
        # the cost of a longer draft is only extrapolated so far: measure it once (where a row
        # past a block's end is priced from timings, one more draft is that row: no try)
        return Decision(Kind.MEASURE, best_k + 1,
                        f"trying k={best_k + 1} (k={best_k} expected {best:.1f} vs plain {plain:.1f} tok/s)")
    return Decision(Kind.DRAFT, best_k,
                    f"k={best_k}: {best:.1f} vs plain {plain:.1f} tok/s expected (acceptance {state.alpha:.0%})")


def least_match(state: GovernorState) -> int | None:
    """The shortest match on which choose may draft an n-gram proposal now (None: on none),
    priced as a proposal at its longest: no more drafts than k_max, none cold, more to copy after
    it. Never above the shortest match choose drafts on (what it leaves out, giving up on the
    drafter, only ever says k = 0), so a proposal matching less is never one choose would draft.
    The n-gram path decodes plain up to where a match that long could first appear
    (NgramDrafter.quiet_steps). One _best per match class, from the shortest."""
    plain = rate(state, 0)
    if plain is None or (state.plain_from_load and not state.hopeful):
        return None  # choose times a plain step first, whatever the proposal
    if not _draft_measured(state) or state.plain_rounds >= state.probe_every:
        return 2  # a round that measures the draft, or a re-check, on any proposal
    k_cap = min(state.k_max, explore_cap(state))
    for bucket in range(MATCH_BUCKETS):
        match = 2 ** (bucket + 1)
        if _best(for_match(state, match), k_cap, plain)[0] > 0:
            return match
    return None


def least_match_key(state: GovernorState) -> tuple:
    """What least_match depends on but the plain step's cost, which moves a little at every plain
    step (the caller keeps the answer while that cost stays within LEAST_DRIFT): a key to keep
    least_match's answer by within a reply (it costs up to six _best calls). The rest of what
    it reads changes only with a drafted round (update: its size's cost, the bias ratios, the
    match classes), with the first timing of a size, when the plain step is first timed in
    place, and when a re-check falls due."""
    return (state.drafted_rounds, state.verify_seen, state.plain_from_load, state.plain_rounds >= state.probe_every)


def plain_cost(state: GovernorState) -> float | None:
    """The plain step's cost as the state has it (None before any timing): verify_s is sorted by
    size, so it is the first entry's if any (asked at every plan of an n-gram reply)."""
    first = state.verify_s[0] if state.verify_s else None
    return first[1] if first is not None and first[0] == 1 else None


def least_match_holds(then: float | None, now: float | None) -> bool:
    """A least_match answer worked out at plain cost `then` still holds at `now` (LEAST_DRIFT)."""
    return then is not None and now is not None and then / LEAST_DRIFT <= now <= then * LEAST_DRIFT


def given_up(state: GovernorState, k_cap: int = K_MAX) -> Decision | None:
    """The decision to give up on the draft (kind HOPELESS or COSTLY) when the measured costs rule
    drafting out without a re-check, or None. Plain decoding wins at the acceptance believed now,
    and a re-check cannot change that: even 100% acceptance loses (hopeless), or the draft's
    catch-up after a plain stretch would cost more than PROBE_COST_MAX of decoding time. Only a
    drafted round moves the acceptance, so a reply that gives up can decode plain to its end. A
    plain step timed at load is, if anything, too slow (noise only adds time), and that makes
    drafting look better: giving up on it is safe."""
    state = _believed(state)
    plain = rate(state, 0)
    if plain is None or not _draft_measured(state):
        return None
    return _off_for_good(state, k_cap, plain, _best(state, k_cap, plain)[0])


def _off_for_good(state: GovernorState, k_cap: int, plain: float, best_k: int) -> Decision | None:
    """given_up, with the plain rate and the best k already computed."""
    if best_k > 0:
        return None
    if hopeless(state, k_cap, plain):
        return Decision(Kind.HOPELESS, 0, f"draft off: even 100% acceptance cannot beat plain {plain:.1f} tok/s here")
    share = catch_up_share(state, plain)
    if share > PROBE_COST_MAX:
        return Decision(Kind.COSTLY, 0, f"draft off: plain {plain:.1f} tok/s wins, and re-checking the draft would"
                                        f" cost {share:.0%} of decoding time in catch-up")
    return None


def _draft_measured(state: GovernorState) -> bool:
    """The draft's step and two verify sizes are timed, past the cold first rounds."""
    return state.draft_step_s is not None and len(state.verify_s) >= 2 and state.drafted_rounds >= state.warm_rounds


def _best(state: GovernorState, k_cap: int, plain: float, end: int | None = None,
          cold: frozenset[int] = frozenset()) -> tuple[int, float]:
    """The k with the highest expected rate, and that rate (0 and plain when no k beats plain).
    `end`: the proposal's length when nothing follows it to copy. Then k drafts short of the
    end leave the rest (end - k - 1 drafts, since the round's own pick takes one) to a round of
    their own, and k is judged over both rounds: a copy ending 21 tokens on drafted 15, 3 and 1
    (1.5B, 2 threads: three rounds, 348, 145 and 133 ms measured) where one round of 21 was
    priced at about 470 ms. `cold`: sizes priced at cold_factor. The table's best k stays if it
    pays at its cold price: a copy's long rounds pay the capture once and replay it from the third
    round on, where a captured shorter size would cap them. Else the best by cold prices (a size
    captured already, or plain)."""
    reach = k_cap if end is None else max(k_cap, end)
    costs, gains = curve(state, reach + 1), _gains(state, reach)
    step = state.draft_step_s
    best_k, best = _argmax(costs, gains, step, plain, end, 1, k_cap)
    if best_k + 1 in cold:
        factor = cold_factor(state)
        costs = [t * factor if t is not None and n in cold else t for n, t in enumerate(costs, 1)]
        if not _argmax(costs, gains, step, plain, end, best_k, best_k)[0]:
            best_k, best = _argmax(costs, gains, step, plain, end, 1, k_cap)
    return best_k, best


def _argmax(costs: list[float | None], gains: list[float], draft_step_s: float | None, plain: float,
            end: int | None, lo: int, hi: int) -> tuple[int, float]:
    """_best over k = lo..hi at these prices."""
    best_k, best = 0, plain
    for k in range(lo, hi + 1):
        r = _rate_at(costs, gains, draft_step_s, k)
        if r is not None and end is not None and k < end and costs[end - k - 1] is not None:
            # the rest's round comes only if all k drafts are accepted (chance `held`), and then it
            # yields what the first end - 1 drafts would beyond the first k, the target's pick too
            held, rest = gains[k] - gains[k - 1], end - k - 1
            step = draft_step_s or 0.0
            r = (gains[end - 1] + held) / (costs[k] + k * step + held * (costs[rest] + rest * step))
        if r is not None and r > best:
            best_k, best = k, r
    return best_k, best


def new_reply(state: GovernorState) -> GovernorState:
    """Carry the measured costs into a new reply, but not the acceptance: how often a draft is
    right depends on the text (a code edit repeats its prompt, a story does not). The n-gram
    drafter's acceptance by match length stays: it is already conditioned on how much of the
    text around the proposal repeats."""
    fresh = GovernorState(k_max=state.k_max, warm_rounds=state.warm_rounds, hopeful=state.hopeful)
    return replace(fresh, draft_step_s=state.draft_step_s, verify_s=state.verify_s,
                   drafted_rounds=state.drafted_rounds, catch_up_s=state.catch_up_s,
                   plain_from_load=state.plain_from_load, verify_seen=state.verify_seen,
                   by_match=state.by_match, verify_ratios=state.verify_ratios, cold_ratios=state.cold_ratios)


def catch_up_share(state: GovernorState, plain: float) -> float:
    """The share of plain decoding time a re-check costs: after a plain stretch the draft must
    prefill every token it missed, at catch_up_s each, against 1/plain seconds per plain token.
    Longer stretches between re-checks do not help: the catch-up grows with them. 0 while unknown."""
    return (state.catch_up_s or 0.0) * plain


def caught_up(state: GovernorState, tokens: int, seconds: float) -> GovernorState:
    """Fold one draft catch-up (tokens prefilled in seconds) into the state."""
    if tokens <= 0:
        return state
    return replace(state, catch_up_s=_cost_ema(state.catch_up_s, seconds / tokens))


def hopeless(state: GovernorState, k_cap: int, plain: float) -> bool:
    """True when the measured costs alone rule drafting out: with every draft accepted, no k
    beats plain decoding. Then re-checking acceptance cannot help, so the governor stops probing."""
    costs, every = curve(_believed(state), k_cap + 1), [k + 1.0 for k in range(k_cap + 1)]
    return all((_rate_at(costs, every, state.draft_step_s, k) or 0.0) <= plain for k in range(1, k_cap + 1))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


def _cost_ema(old: float | None, new: float) -> float:
    """Estimate of a duration. Noise in timings is one-sided (a stall, another process, a cold
    first call only ever add time), so a faster sample moves the estimate halfway at once and a
    slower one moves it by EMA, capped at twice the estimate."""
    if old is None:
        return new
    if new < old:
        return new  # a faster run shows what the hardware can do; the slower one had a stall
    return _ema(old, min(new, 2 * old))


def update(state: GovernorState, *, k: int, drafted: int, accepted: int, draft_s: float, verify_s: float,
           steps: int = 1, match: int | None = None, cold: bool = False) -> GovernorState:
    """Fold one round's measurements into the state. `steps`: plain tokens the round decoded
    (verify_s is then the time of one of them); `match`: the n-gram proposal's match length;
    `cold`: the verify batch had no captured CUDA graph. A cold round's time teaches cold_factor
    only: the table, its bias and the sizes seen in the reply are about captured batches."""
    table = dict(state.verify_s)
    n = drafted + 1
    ratios, cold_ratios, seen = state.verify_ratios, state.cold_ratios, state.verify_seen
    if drafted > 0:
        priced = _curve(*_table(state), n)[n - 1]  # the table's price, without the bias
        if priced and cold:
            cold_ratios = (*cold_ratios, verify_s / priced)[-BIAS_ROUNDS:]
        elif priced:
            ratios = (*ratios, verify_s / priced)[-BIAS_ROUNDS:]
    if not (cold and drafted > 0):
        table[n] = _cost_ema(table.get(n), verify_s)
        seen = seen if n in seen else tuple(sorted((*seen, n)))
    by_match = state.by_match
    if drafted > 0 and match is not None:
        by_match = _fold_match(state, match, accepted, 0 if accepted == drafted else 1)
    alpha, accepted_ema, trials_ema = state.alpha, state.accepted_ema, state.trials_ema
    draft_step = state.draft_step_s
    if drafted > 0:
        # geometric model: accepted successes, then one failure unless every draft was accepted.
        # alpha = successes / decisions (the maximum-likelihood estimate for runs cut off at k),
        # each averaged over recent rounds. A mean of per-round ratios a/(a+1) is biased low
        # (k=8, alpha=0.8 settles near 0.62), and the governor would then draft too little.
        failures = 0 if accepted == drafted else 1
        accepted_ema = _ema(accepted_ema, accepted)
        trials_ema = _ema(trials_ema, accepted + failures)
        alpha = accepted_ema / trials_ema
        draft_step = _cost_ema(draft_step, draft_s / drafted)
    drafted_rounds = state.drafted_rounds + (1 if drafted > 0 else 0)
    if k == 0:
        plain_rounds, probe_every = state.plain_rounds + steps, state.probe_every
    else:
        plain_rounds = 0
        # a probe that found the draft still losing waits twice as long for the next one
        losing = state.plain_rounds >= state.probe_every
        probe_every = min(PROBE_MAX, state.probe_every * 2) if losing else state.probe_every
    return replace(state, alpha=alpha, accepted_ema=accepted_ema, trials_ema=trials_ema, draft_step_s=draft_step,
                   drafted_rounds=drafted_rounds, plain_from_load=state.plain_from_load and drafted > 0,
                   verify_s=tuple(sorted(table.items())), verify_seen=seen, by_match=by_match, verify_ratios=ratios,
                   cold_ratios=cold_ratios, plain_rounds=plain_rounds, probe_every=probe_every)


def _fold_match(state: GovernorState, match: int, accepted: int, failures: int) -> tuple:
    """by_match with one drafted round of this match length folded in: its decisions added to
    the class's counts (a class seen for the first time starts from its prior, worth
    MATCH_PRIOR_TRIALS decisions), what the class knew before weighing 1 - EMA, so a session's
    old rounds fade. A chance match in fresh code that drafts 3 and has none accepted adds one
    rejection to a prior worth two: the class is off after a round or two."""
    bucket = match_bucket(match)
    rows = {b: (a, r, n) for b, a, r, n in state.by_match}
    a, r, n = rows.get(bucket) or (*_prior_counts(bucket, _learned(state.by_match)), 0)
    keep = 1 - EMA
    rows[bucket] = (keep * a + accepted, keep * r + failures, n + 1)
    return tuple((b, *row) for b, row in sorted(rows.items()))



def from_costs(costs: Costs, *, warm_rounds: int) -> GovernorState:
    """A state that starts judged: the costs known, the cold first rounds counted as done, and
    the plain step to be timed once in place (a load-time timing can be far off)."""
    return GovernorState(verify_s=tuple(sorted(costs.verify_s)), draft_step_s=costs.draft_step_s,
                         catch_up_s=costs.catch_up_s, drafted_rounds=warm_rounds, warm_rounds=warm_rounds,
                         plain_from_load=True)


class GovernorMemory:
    """What the governors learned, per drafter ("model", "ngram"), kept across the replies of a
    session: the one owner of that state. The runner holds one and passes it to every reply;
    a reply's Speculator starts from it (governor.new_reply) and stores what each round taught."""

    def __init__(self, states: dict[str, GovernorState] | None = None):
        self._states: dict[str, GovernorState] = dict(states or {})

    def get(self, drafter: str) -> GovernorState | None:
        return self._states.get(drafter)

    def put(self, drafter: str, state: GovernorState) -> None:
        self._states[drafter] = state

    def __contains__(self, drafter: str) -> bool:
        return drafter in self._states

    def __repr__(self) -> str:
        return f"GovernorMemory({sorted(self._states)})"
