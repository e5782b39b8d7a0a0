"""Sampler settings -> a llama.cpp sampler chain (one owner, deterministic free)."""

from __future__ import annotations

import llama_cpp

from edgerun.settings import SamplerSettings

_RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp draws a random seed


def chain_spec(s: SamplerSettings) -> list[tuple[str, tuple]]:
    """The samplers, in llama.cpp's usual order, as (name, args). Pure, for tests and display."""
    spec: list[tuple[str, tuple]] = []
    if s.repeat_penalty != 1.0:
        spec.append(("penalties", (s.repeat_last_n, s.repeat_penalty, 0.0, 0.0)))
    if s.greedy:
        return spec + [("greedy", ())]
    if s.top_k > 0:
        spec.append(("top_k", (s.top_k,)))
    if s.top_p < 1.0:
        spec.append(("top_p", (s.top_p, 1)))
    if s.min_p > 0.0:
        spec.append(("min_p", (s.min_p, 1)))
    spec.append(("temp", (s.temperature,)))
    spec.append(("dist", (_RANDOM_SEED if s.seed is None else s.seed & 0xFFFFFFFF,)))
    return spec


class Sampler:
    """Owns a llama_sampler chain."""

    def __init__(self, settings: SamplerSettings):
        self.settings = settings
        self.ptr = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        for name, args in chain_spec(settings):
            llama_cpp.llama_sampler_chain_add(self.ptr, getattr(llama_cpp, f"llama_sampler_init_{name}")(*args))

    def sample(self, ctx_ptr, idx: int = -1) -> int:
        """Sample from output idx of the last decode and accept the token into the chain's state."""
        return llama_cpp.llama_sampler_sample(self.ptr, ctx_ptr, idx)

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
