"""Every default in one place. CLI flags, the TUI and the docs read them from here."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from edgerun.errors import ConfigError

THREADS_ENV = "EDGERUN_THREADS"


def physical_cores() -> int:
    """llama.cpp decodes fastest with one thread per physical core (hyper-threads only contend)."""
    import psutil  # ~25 ms at import; every edgerun process reads this module, few call this

    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what Python's platform module says."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def threads_from_env() -> int | None:
    """EDGERUN_THREADS, where set: the threads of llama.cpp (and of edgerun's own native work) when
    --threads does not say, for a machine shared with other work or a container given fewer cores
    than the host has. ggml's threads meet at a spinning barrier after every operation, so more
    threads than the cores left free wait for each other a whole time slice at a time."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{THREADS_ENV}={text!r}: give a thread count of at least 1, or unset it")
    return int(text)


def default_threads() -> int:
    return threads_from_env() or physical_cores()


@dataclass(frozen=True)
class SamplerSettings:
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """The repetition penalty applies: a penalty other than 1 over a window that is not empty."""
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0

    def penalty_window(self, tokens: list[int], last: int | None = None) -> list[int]:
        """The committed tokens the repetition penalty sees, as llama.cpp means repeat_last_n: the
        last N of `tokens` (then `last`), -1 all of them (the whole context), 0 none. The one
        owner of the window in Python; the native round extends it as it decodes
        (native/sampling.hpp, push_history) with the same semantics."""
        n = self.repeat_last_n
        if not self.penalized:
            return []
        if last is None:
            return list(tokens) if n < 0 else tokens[-n:]
        head = tokens if n < 0 else tokens[len(tokens) - min(len(tokens), n - 1):]  # n - 1 may be 0
        return [*head, last]

    def replace(self, **changes) -> "SamplerSettings":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class EngineSettings:
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = dataclasses.field(default_factory=default_threads)
    gpu_layers: str = "auto"  # "auto", or a layer count as text
    max_vram: int | None = None  # bytes of VRAM the plan may use; None: all that is free
    n_seq: int = 1  # sequences sharing the context (the server's slots), each up to n_ctx tokens
    rpc: str = ""  # remote devices: "HOST:PORT[,HOST:PORT...]" of `edgerun rpc-server`s (empty: none)
    rpc_timeout_s: float = 30.0  # a server silent this long in a request counts as lost
    # llama.cpp's repacked CPU weights: faster x86 kernels that round differently. An RPC server's CPU
    # backend has none, so a split matches a local run bit for bit only with this off
    cpu_repack: bool = True

    def replace(self, **changes) -> "EngineSettings":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


MAX_TOKENS = 512
DRAFT = "auto"  # the catalog's recommended draft, where it pays
SPEC_K = "auto"  # draft length: the governor decides
NGRAM = True  # prompt-lookup drafting: 2-3x on replies that copy (edits), ~0.98-0.99x where nothing repeats
# (docs/BENCHMARKS.md, bench ngram); the governor turns it down to plain decoding when it does not pay
# the chat app's n-gram drafter also drafts from earlier conversations with the model (a pool on
# disk, ngram_pool.py): 1.13x on a fresh conversation asking what an earlier one got, 1.02x
# on fresh code (docs/BENCHMARKS.md, bench ngram --pool)
NGRAM_POOL = True
SHOW_DRAFT_MARKS = False  # the chat app highlights accepted draft tokens (F5 toggles)
DEFAULT_SYSTEM_PROMPT: str | None = None  # None: the model's template decides
KV_CACHE_GIB = 4.0  # saved KV states (resumable conversations and prompts): the directory's cap
KV_CACHE_MIN_TOKENS = 128  # a context holding fewer tokens is not saved: evaluating them is quick
HUB_TIMEOUT_S = 5.0  # how long to wait for the hub before falling back to the mirror
PREFILL_SHARE = 0.5  # edgerun serve: the most of the engine's time prompts take while replies decode
PROMPT_CACHE_MIB = 1024  # edgerun serve: KV states of prompts that left their slot, kept in RAM
