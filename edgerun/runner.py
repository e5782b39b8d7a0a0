"""A loaded model ready to answer: resolve -> validate -> place -> load -> template -> generate."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from edgerun.errors import ConfigError
from edgerun.decode.generate import Prefill, Step, generate
from edgerun.models.fetch import resolve
from edgerun.models.gguf_check import GGUFInfo, inspect
from edgerun.runtime import chat_template, devices, placement
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings, SamplerSettings


def placement_for(info: GGUFInfo, settings: EngineSettings) -> placement.Plan:
    kv = placement.kv_bytes_per_layer(settings.n_ctx, info.n_head_kv, info.head_dim)
    return placement.plan(
        info.layer_bytes, info.other_bytes, kv, devices.free_vram(),
        gpu_available=devices.gpu_offload_supported(), requested=settings.gpu_layers,
    )


class Runner:
    """Owns one model and its context. Close it (or use `with`) to free both."""

    def __init__(self, spec: str | Path, settings: EngineSettings | None = None):
        self.settings = settings or EngineSettings()
        self.path = resolve(str(spec))
        self.info = inspect(self.path)
        limit = self.info.context_length
        if limit and self.settings.n_ctx > limit:
            raise ConfigError(
                f"context {self.settings.n_ctx} is larger than {self.info.name} supports ({limit});"
                f" use --ctx {limit} or less"
            )
        self.plan = placement_for(self.info, self.settings)
        self.model = Model(self.path, n_gpu_layers=self.plan.gpu_layers, info=self.info)
        try:
            self.ctx = Context(self.model, self.settings)
        except Exception:
            self.model.close()
            raise

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        m = self.model
        text = chat_template.render(
            self.info.chat_template, messages,
            bos=m.piece(m.bos, special=True).decode(errors="replace") if m.bos >= 0 else "",
            eos=m.piece(m.eos, special=True).decode(errors="replace") if m.eos >= 0 else "",
        )
        # a template that writes BOS itself must not get a second one from the tokenizer
        return m.tokenize(text, add_special=m.add_bos and not _starts_with_bos(m, text))

    def raw_tokens(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=True, parse_special=False)

    def stream(
        self,
        tokens: list[int],
        sampling: SamplerSettings,
        *,
        max_tokens: int,
        cancel: threading.Event | None = None,
    ) -> Iterator[Prefill | Step]:
        return generate(self.ctx, tokens, sampling, max_tokens=max_tokens, cancel=cancel)


def _starts_with_bos(model: Model, text: str) -> bool:
    if model.bos < 0:
        return False
    bos = model.piece(model.bos, special=True).decode(errors="replace")
    return bool(bos) and text.startswith(bos)
