"""Statistics of one reply, folded from the step stream."""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass

from edgerun.decode.generate import Prefill, Step


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass
class ReplyStats:
    prompt_tokens: int = 0
    prompt_evaluated: int = 0
    prefill_s: float = 0.0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    last_t: float = 0.0
    finish: str | None = None

    def add(self, record: Prefill | Step) -> None:
        if isinstance(record, Prefill):
            self.prompt_tokens = record.prompt_tokens
            self.prompt_evaluated = record.evaluated
            self.prefill_s = record.seconds
            return
        if record.finish == "stop":  # the end-of-generation token is not shown or counted
            self.finish = "stop"
            return
        self.generated_tokens += 1
        if self.generated_tokens == 1:
            self.ttft_s = record.t
        self.last_t = record.t
        self.finish = record.finish

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, over the time after the first (TTFT is prefill's business)."""
        span = self.last_t - self.ttft_s
        return (self.generated_tokens - 1) / span if self.generated_tokens > 1 and span > 0 else 0.0

    @property
    def tpot_s(self) -> float:
        rate = self.decode_tok_s
        return 1.0 / rate if rate else 0.0

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_evaluated / self.prefill_s if self.prefill_s > 0 else 0.0

    def as_json(self) -> dict:
        out = asdict(self)
        del out["last_t"]
        out.update(
            decode_tok_s=round(self.decode_tok_s, 3),
            prompt_tok_s=round(self.prompt_tok_s, 3),
            tpot_s=round(self.tpot_s, 6),
            peak_rss_bytes=peak_rss_bytes(),
        )
        return out

    def line(self) -> str:
        return (
            f"{self.generated_tokens} tokens, {self.decode_tok_s:.1f} tok/s, TTFT {self.ttft_s * 1000:.0f} ms,"
            f" prompt {self.prompt_tokens} tok at {self.prompt_tok_s:.0f} tok/s,"
            f" peak RSS {peak_rss_bytes() / 2**20:.0f} MiB"
        )
