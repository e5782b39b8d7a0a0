"""The server's engine: one llama.cpp context shared by up to `parallel` sequences (slots),
driven by one thread that never waits on the event loop.

Each step decodes one batch: the next token of every running reply plus chunks of the pending
prompts, oldest first, within a token budget (continuous batching with chunked prefill), so a long
prompt costs the running streams a few budget-sized steps, not its whole prefill, and while replies
decode the prompts get at most a share of the engine's time (PrefillPacer). A reply alone
on the server goes through the same decode loop as `edgerun run` (generate(), with the n-gram
drafter or the draft model and the governor); when another request arrives it is handed over,
between two rounds, to the batched steps, which decode plainly. A finished reply's slot keeps its KV as a prompt cache: a new request
takes the idle slot whose cache shares the longest prefix with its prompt (of those alike, the
lowest numbered), copies a running slot's prefix when that is longer, or restores a state the
prompt cache kept in RAM when a slot's KV was given to another request (serve/prompt_cache.py).

Each slot is a KV stream of its own, and llama.cpp decodes a batch's rows of consecutive slot
numbers as one ubatch: a batch of slots 0-3 and 5 is two passes over the weights. Taking the lowest
free slot among equal candidates keeps the running slots packed at the bottom."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from edgerun import _native
from edgerun.decode import governor
from edgerun.decode.generate import Prefill, Step, generate, native_errors, native_params, native_rng
from edgerun.decode.speculative import Round
from edgerun.errors import EdgerunError, EngineError
from edgerun.runner import Runner
from edgerun.runtime.engine import common_prefix
from edgerun.serve.metrics import Metrics
from edgerun.serve.prompt_cache import PromptCache
from edgerun.serve.text import ReplyText
from edgerun.settings import PREFILL_SHARE, PROMPT_CACHE_MIB, SamplerSettings

log = logging.getLogger("edgerun.serve")

COPY_GAIN = 32  # share a running slot's prefix only when it saves this many tokens over an idle cache
BANK_STEPS = 4  # decode steps' worth of share that may be saved up: short prompts seldom wait
SMOOTHING = 0.3  # weight of the newest decode-only step in its running duration


class PrefillPacer:
    """Whether the next step may carry prompt chunks, from the measured durations of the steps
    before it (pure: the scheduler feeds it seconds; tests feed it numbers).

    On a compute-bound CPU a 256-token chunk costs about as much as 30 decode steps, so a prompt
    that rides in every step holds the decoding replies to one token per chunk: over its prefill
    their TPOT is what one long stall would have made it. Here a chunk's cost beyond the decode
    step it rides with is paid back by decode-only steps before the next chunk goes, so while
    replies decode the prompts take at most `share` of the time: the replies' TPOT during a
    prefill stays within about 1 / (1 - share) of their plain TPOT, and a prompt that arrives
    among them takes about 1 / share as long to fill. The share grows to the waiting prompts' part
    of the requests (15 prompts waiting beside one reply get 15/16 of the time: a burst of new
    requests is not held back for one stream's sake). With nothing decoding, prompts take every
    step; share 1 gives them every step always."""

    def __init__(self, share: float = PREFILL_SHARE):
        if not 0.0 < share <= 1.0:
            raise ValueError(f"prefill share {share} is not in (0, 1]")
        self.share = share
        self.credit = 0.0  # seconds of prompt time the replies have earned; a chunk goes at >= 0
        self.decode_s: float | None = None  # a decode-only step's duration, smoothed

    def share_for(self, decoding: int, waiting: int) -> float:
        return max(self.share, waiting / (waiting + decoding)) if waiting + decoding else 1.0

    def may_chunk(self, decoding: int, waiting: int) -> bool:
        """`decoding`: replies decoding; `waiting`: prompts not yet filled."""
        return not decoding or self.share_for(decoding, waiting) >= 1.0 or self.credit >= 0.0

    def record(self, seconds: float, *, decoding: int, waiting: int, chunked: bool) -> None:
        """One step done: `decoding` replies' tokens it carried, `chunked` whether it carried prompt
        chunks, `waiting` the prompts not filled before it."""
        if not decoding:
            self.credit = 0.0  # nothing waited on the prompts: no debt, no savings
            return
        if chunked:
            decode = min(seconds, self.decode_s) if self.decode_s is not None else 0.0
        else:
            decode = seconds
            self.decode_s = seconds if self.decode_s is None else self.decode_s + SMOOTHING * (seconds - self.decode_s)
        # keeps prompt_time <= share / (1 - share) * reply_time: credit = share * D - (1 - share) * P
        share = self.share_for(decoding, waiting)
        self.credit += share * decode - (1.0 - share) * (seconds - decode)
        self.credit = min(self.credit, share * BANK_STEPS * (self.decode_s or 0.0))

    def idle(self) -> None:
        """No replies are being batched (the engine is idle or a reply runs alone)."""
        self.credit = 0.0


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prompt cache


@dataclass(frozen=True)
class Done:
    finish: str  # "stop", "length" or "cancelled"
    usage: Usage


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Done | Failed


class Overloaded(EdgerunError):
    """The queue is full."""


@dataclass(eq=False)
class Job:
    """One request, from submission to its last event. `sink` takes each event (from the engine
    thread: it must be thread-safe); `cancel` set by the client side ends the reply at the next step."""

    prompt: list[int]
    sampling: SamplerSettings
    max_tokens: int
    stop: list[str]
    sink: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # the grammar the reply must match (tools, response_format), fresh at submission; then its
    # state after every token the reply has so far
    grammar: _native.Grammar | None = None
    # the engine's side
    seq: int = -1
    last: int | None = None  # the newest pick, not yet in the KV: set once the prompt is in
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    first_at: float | None = None
    text: ReplyText | None = None
    rng: _native.Rng | None = None
    params: _native.SamplerParams | None = None


class Scheduler:
    def __init__(self, runner: Runner, metrics: Metrics, *, queue_limit: int, step_tokens: int,
                 prefill_share: float = PREFILL_SHARE, cache_bytes: int = PROMPT_CACHE_MIB << 20, solo: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.runner, self.ctx, self.model, self.metrics = runner, runner.ctx, runner.model, metrics
        self.parallel = self.ctx.n_seq
        # replies alone keep the target's logits readable: a batched step may take over any round
        self.spec = replace(runner.spec_config, device_greedy=False)
        self.queue_limit, self.solo = queue_limit, solo
        self.step_tokens = max(self.parallel + 1, min(step_tokens, self.ctx.n_batch))
        self.pacer, self._clock = PrefillPacer(prefill_share), clock
        self.prompt_cache = PromptCache(cache_bytes)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []  # in admission order: the oldest pending prompt fills first
        self._idle = dict.fromkeys(range(self.parallel), 0.0)  # free slot -> when it was last used
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="edgerun-engine", daemon=True)
        metrics.kv_cells_total.set(self.ctx.n_cells)

    # ----- the client side ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise Overloaded("the server is shutting down")
            # a request a free slot will take at once does not wait: only those beyond the free
            # slots count against the queue
            if len(self._waiting) >= self.queue_limit + len(self._idle):
                raise Overloaded(f"{len(self._active)} requests are running and {len(self._waiting)} waiting"
                                 " (the queue is full); retry later")
            self._waiting.append(job)
            self.metrics.queued.set(len(self._waiting))
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; replies still running end with an error."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def load(self) -> tuple[int, int]:
        return len(self._active), len(self._waiting)

    # ----- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closing or self._waiting or self._active):
                    self._cond.wait()
                if self._closing:
                    break
                self._admit()
            try:
                self._end_cancelled()
                if self.solo and len(self._active) == 1 and self._active[0].last is None and not self._waiting:
                    self._alone(self._active[0])
                elif self._active:
                    self._step()
            except EdgerunError as exc:
                self._fail_all(str(exc))
            except Exception as exc:  # a bug must not take the server down: end the replies, go on
                log.exception("engine step failed")
                self._fail_all(f"the engine failed ({type(exc).__name__}: {exc}); retry the request")
            self._gauges()
        with self._cond:
            stranded = self._active + list(self._waiting)
            self._active, self._waiting = [], collections.deque()
        for job in stranded:
            job.sink(Failed("the server shut down before the reply was done"))

    def _admit(self) -> None:
        while self._waiting and self._idle:
            job = self._waiting.popleft()
            if job.cancel.is_set():
                continue
            try:
                self._place(job)
            except Exception as exc:  # e.g. a trim llama.cpp refused: this request fails, the server goes on
                log.exception("placing a request failed")
                job.sink(Failed(f"the request could not start ({exc}); retry it"))
                continue
            self._active.append(job)
        self.metrics.queued.set(len(self._waiting))

    def _place(self, job: Job) -> None:
        """Give the job a slot and the longest prefix of its prompt the KV already holds: an idle
        slot's cache, a running slot's prefix (copied) or a state from the prompt cache (restored),
        whichever is longest; what a slot held before is kept in the prompt cache."""
        ctx, prompt = self.ctx, job.prompt
        best = max(self._idle, key=lambda s: (ctx.shared_prefix(prompt, s), -s))
        reuse = ctx.shared_prefix(prompt, best)
        shared, donor = max(((common_prefix(ctx.held(j.seq), prompt), j.seq) for j in self._active), default=(0, -1))
        saved, entry = self.prompt_cache.best(prompt)
        roomiest = min(self._idle, key=lambda s: (len(ctx.held(s)), s))  # the smallest cache makes room
        if shared > reuse + COPY_GAIN and shared >= saved:
            seq, reuse = roomiest, min(shared, len(prompt) - 1)
            self._keep(seq, 0)
            ctx.copy_prefix(donor, seq, reuse)
        elif entry is not None and saved >= reuse + self.prompt_cache.min_gain and self._restore(roomiest, entry):
            seq, reuse = roomiest, min(saved, len(prompt) - 1)
            ctx.trim(reuse, seq)
        else:
            seq, reuse = best, min(reuse, len(prompt) - 1)
            self._keep(seq, reuse)
            ctx.trim(reuse, seq)
        room = ctx.n_ctx - len(prompt) - governor.K_MAX  # as generate() counts it
        job.seq, job.cached = seq, reuse
        job.text = ReplyText(self.model, job.stop, max(1, min(job.max_tokens, room)))
        job.params, job.rng = native_params(job.sampling), native_rng(job.sampling.seed)
        del self._idle[seq]

    def _keep(self, seq: int, keep: int) -> None:
        """Before the slot keeps only `keep` of the tokens it holds: save them all in the prompt
        cache when what is lost is worth it."""
        held = self.ctx.held(seq)
        if len(held) - keep >= self.prompt_cache.min_gain and self.prompt_cache.wants(held):
            self.prompt_cache.put(list(held), self.ctx.state_bytes(seq))
            self.metrics.prompt_cache_bytes.set(self.prompt_cache.bytes)

    def _restore(self, seq: int, entry) -> bool:
        self._keep(seq, 0)
        try:
            self.ctx.restore_state(entry.state, entry.tokens, seq)
        except EngineError:  # the slot is empty then: the prompt is evaluated instead
            log.exception("restoring a cached prompt failed")
            return False
        self.prompt_cache.used(entry)
        self.metrics.prompt_cache_restored.inc(len(entry.tokens))
        return True

    def _end_cancelled(self) -> None:
        for job in [j for j in self._active if j.cancel.is_set()]:
            self._finish(job, "cancelled")

    def _alone(self, job: Job) -> None:
        """The reply as `edgerun run` decodes it, until it ends or another request arrives."""
        self.pacer.idle()
        replies = generate(self.ctx, job.prompt, job.sampling, max_tokens=job.text.max_tokens, cancel=job.cancel,
                           spec_config=self.spec, memory=self.runner.governors, seq=job.seq, rng=job.rng,
                           grammar=job.grammar)
        handed_over = False
        try:
            for item in replies:
                if isinstance(item, Step):
                    self._emit(job, item.token)
                    if job.text.finish or job.cancel.is_set():
                        break
                elif isinstance(item, Round) and self._waiting:
                    handed_over = True
                    break
                elif isinstance(item, Prefill):
                    self.metrics.prompt_tokens.inc(item.evaluated)
        finally:
            replies.close()  # lands a decode the last round left in flight
        if handed_over:
            committed = job.prompt + job.tokens[:-1]
            if self.ctx.held(job.seq) != committed:
                raise EngineError(f"sequence {job.seq} holds {len(self.ctx.held(job.seq))} tokens, the reply"
                                  f" {len(committed)}; retry the request")
            job.last = job.tokens[-1]
        else:
            self._finish(job, None if job.text.finish else ("cancelled" if job.cancel.is_set() else "length"))

    def _step(self) -> None:
        """One batch: every running reply's newest token, then chunks of the pending prompts, the
        oldest first, up to the step's token budget, when the pacer lets prompts in. Prompts that
        arrive together (a burst of clients, or replies that ended in the same step) fill in one
        pass over the weights, not one step each."""
        rows, decoding = [], []
        for job in self._active:
            if job.last is not None:
                rows.append((job.seq, [job.last], True))
                decoding.append(job)
        waiting = sum(1 for job in self._active if job.last is None)
        budget = self.step_tokens - len(rows) if self.pacer.may_chunk(len(rows), waiting) else 0
        filled = []  # (job, row) of the prompts whose last chunk is in this batch
        for job in self._active:
            if budget <= 0:
                break
            if job.last is not None:
                continue
            rest = job.prompt[len(self.ctx.held(job.seq)):]
            chunk, final = rest[:budget], len(rest) <= budget
            if final:
                filled.append((job, len(rows)))
            rows.append((job.seq, chunk, final))
            budget -= len(chunk)
            self.metrics.prompt_tokens.inc(len(chunk))
        start = self._clock()
        try:
            outputs = self.ctx.decode_rows(rows)
        except EdgerunError:
            for seq, _, _ in rows:
                self.ctx.drop_unrecorded(seq)
            raise
        self.pacer.record(self._clock() - start, decoding=len(decoding), waiting=waiting, chunked=len(rows) > len(decoding))
        for job, i in zip(decoding, outputs):
            self._pick(job, i)
        for job, row in filled:
            self._pick(job, outputs[row])

    def _pick(self, job: Job, output: int) -> None:
        history = job.sampling.penalty_window(self.ctx.held(job.seq))
        with native_errors("sampling a token"):
            token = _native.sample_context(self.ctx.address, output, history, job.params, job.rng, job.grammar)
        job.last = token
        self._emit(job, token)
        if job.text.finish:
            self._finish(job)

    def _emit(self, job: Job, token: int) -> None:
        if self.runner.rpc_watch is not None:  # --rpc: a token made after a server was lost is not sent
            self.runner.rpc_watch.check()
        now = time.perf_counter()
        if job.first_at is None:
            job.first_at = now
            self.metrics.ttft.observe(now - job.submitted)
        job.tokens.append(token)
        text = job.text.push(token)
        if not self.model.is_eog(token):
            self.metrics.generated_tokens.inc()
        if text:
            job.sink(Delta(text))

    def _finish(self, job: Job, reason: str | None = None) -> None:
        if reason is not None:
            tail = job.text.end(reason)
            if tail and reason != "cancelled":
                job.sink(Delta(tail))
        n = job.text.tokens
        if job.first_at is not None and n > 1:
            self.metrics.tpot.observe((time.perf_counter() - job.first_at) / (n - 1))
        self.metrics.requests.labels(finish=job.text.finish).inc()
        job.sink(Done(job.text.finish, Usage(len(job.prompt), n, job.cached)))
        self._active.remove(job)
        self._idle[job.seq] = time.monotonic()

    def _fail_all(self, message: str) -> None:
        for job in list(self._active):
            self.ctx.drop_unrecorded(job.seq)
            self.metrics.requests.labels(finish="error").inc()
            job.sink(Failed(message))
            self._active.remove(job)
            self._idle[job.seq] = time.monotonic()

    def _gauges(self) -> None:
        self.metrics.running.set(len(self._active))
        self.metrics.kv_cells_used.set(sum(len(self.ctx.held(s)) for s in range(self.parallel)))
        self.metrics.kv_cells_running.set(sum(len(self.ctx.held(j.seq)) for j in self._active))
