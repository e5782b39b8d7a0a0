"""A loaded model ready to answer: resolve -> validate -> place -> load -> template -> generate."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from edgerun.errors import ConfigError, DoesNotFit, EngineError
from edgerun.decode.constrain import Constraint
from edgerun.decode.generate import Prefill, Step, generate
from edgerun.decode import governor
from edgerun.decode.governor import Costs, GovernorMemory
from edgerun.decode.ngram import NgramPool
from edgerun.decode.speculative import Round, SpecConfig, k_limit
from edgerun.models import catalog, fetch
from edgerun.models.fetch import resolve
from edgerun.models.gguf_check import GGUFInfo, inspect
from edgerun.runtime import chat_template, cost_table, devices, kvstate, placement, rpc, vocab
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings, SamplerSettings

COST_REPS = 3  # timings per shape at load; the fastest counts ...
COST_BUDGET_S = 1.0  # ... but no new round of them once this long has gone (a slow CPU: one round)
NGRAM_SIZES = (16, 32)  # verify batches past K_MAX + 1 timed at load for the n-gram drafter
CATCH_UP_PROBE = 32  # tokens of draft prefill timed at load: what a catch-up costs per token
MIN_CTX = 64  # a chat template alone takes about 30 tokens


def footprint(info: GGUFInfo, settings: EngineSettings) -> placement.Footprint:
    """What a model needs at these context settings (llama.cpp's default f16 KV cache)."""
    n_ctx = min(settings.n_ctx, info.context_length or settings.n_ctx)
    return placement.Footprint(
        layer_bytes=info.layer_bytes,
        input_bytes=info.input_bytes,
        output_bytes=info.output_bytes,
        kv_per_layer=placement.kv_bytes_per_layer(n_ctx * settings.n_seq, info.n_head_kv, info.head_dim),
        compute_bytes=placement.compute_bytes(
            min(settings.n_ubatch, settings.n_batch), info.n_vocab, info.n_embd, info.n_head, n_ctx),
        tied_head=info.tied_head,
        body_compute_bytes=placement.compute_bytes(
            min(settings.n_ubatch, settings.n_batch), 0, info.n_embd, info.n_head, n_ctx),
    )


def remote_devices(settings: EngineSettings) -> list[rpc.RemoteDevice]:
    """The devices of settings.rpc's servers, connected (a server down is one ConfigError), each
    with the speed it measured at (a probe of a few tens of milliseconds per device)."""
    from edgerun.runtime import devspeed

    found = rpc.connect(rpc.parse(settings.rpc), timeout_s=settings.rpc_timeout_s) if settings.rpc else []
    return [dataclasses.replace(d, speed=devspeed.weight_bytes_per_s(d.handle, d.free)) for d in found]


def placement_for(info: GGUFInfo, settings: EngineSettings, draft: GGUFInfo | None = None,
                  memory: devices.Memory | None = None,
                  remote: list[rpc.RemoteDevice] | None = None) -> placement.Plan:
    """The offload plan for a target (and draft) on this machine's free memory now (or on
    `memory`). When nothing fits, the error says which smaller context would (the context is
    shrunk only when asked). With settings.rpc, the target goes over the servers' devices too
    (`remote`: already connected ones)."""
    mem = memory or devices.memory()
    if settings.rpc:
        remote = remote_devices(settings) if remote is None else remote
        ranks = placement.speed_classes([d.speed for d in remote])
        places = [placement.Place(f"{d.name} ({d.endpoint})", d.free, speed=rank, margin=placement.REMOTE_MARGIN)
                  for d, rank in zip(remote, ranks)]
        vram = mem.free_vram if settings.max_vram is None else min(mem.free_vram, settings.max_vram)
        return placement.plan_remote(footprint(info, settings), footprint(draft, settings) if draft else None, places,
                                     free_vram=vram, free_ram=mem.free_ram, gpu_available=mem.gpu)

    def attempt(s: EngineSettings) -> placement.Plan:
        return placement.plan(
            footprint(info, s),
            footprint(draft, s) if draft else None,
            free_vram=mem.free_vram if s.max_vram is None else min(mem.free_vram, s.max_vram),
            free_ram=mem.free_ram,
            gpu_available=mem.gpu,
            requested=s.gpu_layers,
        )

    try:
        return attempt(settings)
    except DoesNotFit as exc:  # a smaller context may fit (other refusals are not about memory)
        n_ctx = settings.n_ctx // 2
        while n_ctx >= 256:
            try:
                attempt(settings.replace(n_ctx=n_ctx))
            except DoesNotFit:
                n_ctx //= 2
                continue
            raise DoesNotFit(f"{exc}; --ctx {n_ctx} would fit") from None
        raise DoesNotFit(f"{exc}; no context fits: pick a smaller model or close other programs") from None


def draft_for(model_spec: str, draft: str | None) -> str | None:
    """Which draft model to load: an explicit one, none, or for "auto" the catalog's recommended
    draft when it is downloaded and a GPU is here (on CPU alone a model draft does not pay: the
    target's batched verify costs nearly as much as the steps it saves)."""
    if draft in (None, "none"):
        return None
    if draft != "auto":
        return draft
    entry = catalog.load().find(model_spec)
    if entry is None or not entry.draft or not devices.gpu_offload_supported():
        return None
    return entry.draft if fetch.is_present(catalog.load().get(entry.draft)) else None


class Runner:
    """Owns the target model and context, the draft's when speculating, and what the governors
    learn across replies (`governors`). Close it (or use `with`) to free them all."""

    def __init__(self, model_spec: str | Path, settings: EngineSettings | None = None, *,
                 draft: str | None = None, ngram: bool = False, spec_k: int | None = None,
                 rule: str = "rejection", costs: dict[str, Costs] | None = None):
        """model_spec, draft: a catalog name, hf:// URI or path. costs: per drafter ("model",
        "ngram"), the costs to govern with instead of timing them at load (tests and benchmarks
        inject them, so no decision depends on how fast the machine was at load)."""
        self.settings = settings or EngineSettings()
        self._kept_costs: dict | None = None  # the key of the cost table close() lowers (_load_costs)
        self.path = resolve(str(model_spec))
        self.draft_spec = draft_for(str(model_spec), draft)
        self.draft_path = resolve(self.draft_spec) if self.draft_spec else None
        if self.draft_path:
            vocab.check_pair(self.path, self.draft_path)
        self.info = inspect(self.path)
        limit = self.info.context_length
        if self.settings.n_ctx < MIN_CTX:
            raise ConfigError(f"context {self.settings.n_ctx} is too small to chat in; use --ctx {MIN_CTX} or more")
        if limit and self.settings.n_ctx > limit:
            raise ConfigError(
                f"context {self.settings.n_ctx} is larger than {self.info.name} supports ({limit});"
                f" use --ctx {limit} or less"
            )
        self.draft_info = inspect(self.draft_path) if self.draft_path else None
        self.remote = remote_devices(self.settings)  # --rpc: connected before anything loads
        self.plan = placement_for(self.info, self.settings, self.draft_info, remote=self.remote)
        self.rpc_watch = rpc.Watch(rpc.parse(self.settings.rpc)) if self.settings.rpc else None
        self._owned: list = []  # closed in reverse on close()
        try:
            self.model = self._own(self._load_target())
            self.ctx = self._own(Context(self.model, self.settings))
            self.draft_ctx = None
            if self.draft_path:
                where = self.plan.draft  # placement_for plans a draft whenever it is given one
                # the draft stays local: with --rpc its devices are named, so no server is among them
                local = rpc.local_gpus() if self.remote else None
                self.draft_model = self._own(Model(self.draft_path, n_gpu_layers=where.gpu_layers, info=self.draft_info,
                                                   devices=local))
                threads = placement.draft_threads(where, self.settings.n_threads)
                self.draft_ctx = self._own(Context(self.draft_model, self.settings.replace(n_threads=threads)))
        except Exception:
            self.close()
            raise
        self.notes: list[str] = []  # one-time notes for the user about this load (the CLI and TUI show them)
        speculating = self.draft_ctx is not None or ngram
        self.spec_config = SpecConfig(draft=self.draft_ctx, ngram=ngram, k=self._fit_k(spec_k, speculating), rule=rule)
        self.governors = GovernorMemory()
        self.ngram_pool: NgramPool | None = None  # earlier conversations' tokens the n-gram drafter may draft from
        if self.plan.gpu_bytes:
            self._warm_up(speculating=speculating)
        if speculating and spec_k is None:
            warm = governor.WARM_ROUNDS if self.plan.gpu_bytes else 1
            for name, known in (costs or self._load_costs()).items():
                self.governors.put(name, governor.from_costs(known, warm_rounds=warm))
            # a draft the load-time costs already rule out: replies decode as plain ones do (their
            # sampler settles before the prompt), so warm that graph here as _warm_up does for them
            model = self.governors.get("model")
            if self.plan.gpu_bytes and not ngram and model and governor.given_up(model):
                self._warm_device_greedy()

    def _load_target(self) -> Model:
        devs = self.plan.devices
        if devs is None:
            return Model(self.path, n_gpu_layers=self.plan.target.gpu_layers, info=self.info,
                         repack=self.settings.cpu_repack)
        # llama.cpp's device order is the plan's: the servers' devices, then the local GPU
        handles = [d.handle for d in self.remote] + rpc.local_gpus()[:len(devs.shares) - len(self.remote)]
        used = [(h, x) for h, x in zip(handles, devs.tensor_split) if x]  # a device given nothing is left out
        model = Model(self.path, n_gpu_layers=devs.gpu_layers, info=self.info, devices=[h for h, _ in used],
                      tensor_split=tuple(x for _, x in used), repack=self.settings.cpu_repack)
        try:
            self.rpc_watch.check()  # a server lost while the weights went out
        except Exception:
            model.close()
            raise
        return model

    def _fit_k(self, spec_k: int | None, speculating: bool) -> int | None:
        """A fixed draft length clamped to what one batch holds (`last` and k drafts go to one
        llama_decode, which aborts on more than n_batch tokens), with a note saying so."""
        cap = k_limit(self.ctx)
        if not speculating or (spec_k is not None and spec_k <= cap) or (spec_k is None and cap >= governor.K_MAX):
            return spec_k
        if cap == 0:
            self.notes.append(f"n_batch {self.ctx.n_batch} leaves no room for draft tokens, so replies decode"
                              " without speculation; raise --n-batch to speculate")
        elif spec_k is not None:
            self.notes.append(f"spec-k {spec_k} needs a batch of {spec_k + 1} tokens but n_batch is"
                              f" {self.ctx.n_batch}: drafting at most {cap} per round (raise --n-batch for more)")
        return spec_k if spec_k is None else min(spec_k, cap)

    def _warm_up(self, *, speculating: bool) -> None:
        """Run each batch shape the replies will use once before the first reply, as llama.cpp's
        own tools do at load: on a GPU the first decode of a new shape pays for graph capture and
        kernel selection (milliseconds, against a step of about one), which would otherwise land
        in the first reply's speed and in a governor's first measurements."""
        token = self.model.bos if self.model.bos >= 0 else 0
        widest = min(governor.K_MAX, k_limit(self.ctx)) + 1 if speculating else 1  # verify: last + drafts
        for n in (1, *range(1, widest + 1)):  # the single-token step twice: it is nearly every step
            self.ctx.eval([token] * n, all_logits=True)
            self.ctx.trim(0)
        if self.spec_config.ngram and self.draft_ctx is None and self.ctx.output_on_gpu:
            # llama.cpp grows its host buffer of outputs when a batch has more than any before, and
            # with the pick in the graph (a greedy n-gram reply's) an output takes four rows of
            # n_vocab (the logits, the sampler's logits and probabilities, its candidates;
            # llama_context::output_reserve): such a reply's first round of 33 drafts cost 142 ms
            # on an H100, 13 ms in the next reply. The longest round an n-gram reply may verify
            # grows it here, once.
            longest = min(governor.K_MAX_NGRAM, k_limit(self.ctx)) + 1
            if self.ctx.greedy_on_device(True):
                self.ctx.eval([token] * longest, all_logits=True)
                self.ctx.trim(0)
                self.ctx.greedy_on_device(False)
        if not speculating:
            self._warm_device_greedy()
        if self.draft_ctx is not None:
            for _ in range(2):
                self.draft_ctx.eval([token])
            self.draft_ctx.trim(0)

    def _warm_device_greedy(self) -> None:
        """A plain greedy reply picks in the graph (generate.py): that is another graph. Left
        attached, a greedy reply starts warm and another reply detaches it once."""
        if self.ctx.greedy_on_device(self.ctx.output_on_gpu):
            token = self.model.bos if self.model.bos >= 0 else 0
            for _ in range(2):
                self.ctx.eval([token])
            self.ctx.trim(0)

    def _load_costs(self) -> dict[str, Costs]:
        """Each governor's load-time costs, from the timings of every verify batch size (and the
        draft's step and catch-up when there is a draft): kept on disk from an earlier start with
        the same model, build, machine and settings (runtime/cost_table.py; CPU-only
        placements), else timed now and kept. Timed before the first reply, so the governors judge
        drafting before paying for it: a draft that cannot win here would otherwise cost its
        prompt prefill and a losing round, more than a short reply wins back, and an n-gram
        drafter would spend its first rounds measuring."""
        key = self._cost_key()
        self._kept_costs = key  # the table close() lowers to what the replies measured
        best = cost_table.load(key) if key is not None else None
        if best is None:
            best = self._time_shapes()
            if key is not None:
                cost_table.save(key, best)  # one that cannot be kept is timed again next start
        verify = tuple((n, t) for (kind, n), t in best.items() if kind == "verify")
        costs = {"ngram": Costs(verify, draft_step_s=0.0)} if self.spec_config.ngram else {}  # a lookup, no decode
        if self.draft_ctx is not None:
            costs["model"] = Costs(verify, draft_step_s=best["draft", 1],
                                   catch_up_s=best["catch_up", CATCH_UP_PROBE] / CATCH_UP_PROBE)
        return costs

    def _cost_key(self) -> dict | None:
        """What the load-time timings depend on, or None where they are not kept (a GPU or an RPC
        server in the placement: there they double as warming each shape up)."""
        if self.plan.gpu_bytes or self.remote:
            return None
        engine = {k: v for k, v in dataclasses.asdict(self.settings).items() if k not in ("rpc_timeout_s", "max_vram")}
        drafting = self.draft_ctx is not None
        return {"model": kvstate.model_identity(self.path), "llama": kvstate.llama_build(),
                "machine": cost_table.machine(), "engine": engine, "shapes": [list(s) for s in self._cost_shapes()],
                "draft": kvstate.model_identity(self.draft_path) if drafting else None,
                "draft_threads": placement.draft_threads(self.plan.draft, self.settings.n_threads) if drafting else None}

    def _time_shapes(self) -> dict[tuple[str, int], float]:
        """Seconds of each shape of _cost_shapes, the fastest of up to COST_REPS samples."""
        token = self.model.bos if self.model.bos >= 0 else 0
        shapes = self._cost_shapes()
        # On a GPU only the third of three same-shape decodes counts: after a shape change CUDA
        # runs the graph uncaptured, captures it on the next call and replays it from then on.
        runs = 3 if self.plan.gpu_bytes else 1
        best = dict.fromkeys(shapes, float("inf"))
        start_all = time.perf_counter()
        # Shapes take turns, so a stall hits one sample of each rather than every sample of one;
        # the fastest sample counts (noise only adds time).
        for _ in range(COST_REPS):
            if time.perf_counter() - start_all > COST_BUDGET_S:
                break
            for key, (ctx, n, all_logits) in shapes.items():
                for _ in range(runs):
                    start = time.perf_counter()
                    ctx.eval([token] * n, all_logits=all_logits)
                    elapsed = time.perf_counter() - start
                    ctx.trim(0)
                best[key] = min(best[key], elapsed)
        return best

    def _cost_shapes(self) -> dict[tuple[str, int], tuple[Context, int, bool]]:
        """What load-time timing decodes: (kind, tokens) -> (context, tokens, logits for every
        position). Verifies score every position, the draft's catch-up only its last."""
        widest = min(governor.K_MAX, k_limit(self.ctx)) + 1  # a verify batch: last + up to k drafts
        shapes = {("verify", n): (self.ctx, n, True) for n in range(1, widest + 1)}
        if self.spec_config.ngram:
            # an exact copy drafts in long rounds: whole blocks of llama.cpp's CPU kernels
            # (governor.BLOCK) up to a batch of 32, so the first reply may go to 63 drafts at once
            # rather than double its way there (a round each) from 9
            shapes |= {("verify", n): (self.ctx, n, True) for n in NGRAM_SIZES if n <= k_limit(self.ctx) + 1}
        if self.draft_ctx is not None:
            shapes |= {("draft", 1): (self.draft_ctx, 1, False),
                       ("catch_up", CATCH_UP_PROBE): (self.draft_ctx, CATCH_UP_PROBE, False)}
        return shapes

    def _own(self, handle):
        self._owned.append(handle)
        return handle

    def close(self) -> None:
        self._lower_kept_costs()
        while self._owned:
            self._owned.pop().close()

    def _lower_kept_costs(self) -> None:
        """Lower the kept load-time costs to the verify sizes this session's replies timed faster
        (cost_table.lower): the governors' own timings of the sizes they ran, once."""
        key, self._kept_costs = self._kept_costs, None
        if key is None:  # none kept, or the load failed before the governors were made
            return
        faster: dict[tuple[str, int], float] = {}
        for name in ("ngram", "model"):
            state = self.governors.get(name)
            if state is not None:
                timed = dict(state.verify_s)
                for n in state.verify_seen:
                    faster[("verify", n)] = min(faster.get(("verify", n), math.inf), timed[n])
        if faster:
            try:
                cost_table.lower(key, faster)
            except (OSError, ValueError):
                pass  # a table that cannot be read or kept is timed again at the next start

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return chat_tokens(self.model, messages, tools)

    def raw_tokens(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=True, parse_special=False)

    def stream(
        self,
        tokens: list[int],
        sampling: SamplerSettings,
        *,
        max_tokens: int,
        cancel: threading.Event | None = None,
        constraint: Constraint | None = None,
    ) -> Iterator[Prefill | Step | Round]:
        """`constraint`: a grammar the reply must match (decode/constrain.py); checked here, before
        the prompt is evaluated."""
        grammar = constraint.start(self.ctx.address) if constraint is not None else None
        records = generate(self.ctx, tokens, sampling, max_tokens=max_tokens, cancel=cancel, grammar=grammar,
                         spec_config=self.spec_config, memory=self.governors, pool=self.ngram_pool)
        return records if self.rpc_watch is None else _watched(records, self.rpc_watch)


def _watched(records: Iterator[Prefill | Step | Round], watch: rpc.Watch) -> Iterator[Prefill | Step | Round]:
    """A reply over remote devices: once a server is lost its replies are zeros, so a record made
    after that is not passed on; the reply ends with the error naming the server."""
    try:
        for record in records:
            watch.check()
            yield record
    except EngineError:
        watch.check()  # a failed decode because a server was lost: say that
        raise


def chat_tokens(model: Model, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The model's chat template applied to messages (and tools), tokenized (special tokens parsed)."""
    bos = model.piece(model.bos, special=True).decode(errors="replace") if model.bos >= 0 else ""
    eos = model.piece(model.eos, special=True).decode(errors="replace") if model.eos >= 0 else ""
    text = chat_template.render(model.info.chat_template, messages, bos=bos, eos=eos, tools=tools)
    # a template that writes BOS itself must not get a second one from the tokenizer
    return model.tokenize(text, add_special=model.add_bos and not (bos and text.startswith(bos)))
