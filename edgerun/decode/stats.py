"""Statistics of one reply, folded from the record stream."""

from __future__ import annotations

import resource
from collections import Counter
from dataclasses import dataclass, field

from edgerun.decode.generate import Prefill, Step
from edgerun.decode.speculative import Round


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
    # speculation
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    spec_k: int = 0
    governor: str = ""  # the last round's decision, for display ("" without a drafter)
    accepted_hist: Counter = field(default_factory=Counter)  # accepted length -> rounds (drafting rounds)

    def add(self, record: Prefill | Step | Round) -> None:
        if isinstance(record, Prefill):
            self.prompt_tokens = record.prompt_tokens
            self.prompt_evaluated = record.evaluated
            self.prefill_s = record.seconds
        elif isinstance(record, Round):
            self.rounds += 1
            self.drafted += record.drafted
            self.accepted += record.accepted
            self.draft_s += record.draft_s
            self.verify_s += record.verify_s
            self.spec_k = record.k
            self.governor = "" if record.drafter == "none" else record.decision.reason
            if record.drafted:
                self.accepted_hist[record.accepted] += 1
        elif record.finish == "stop":  # the end-of-generation token is not shown or counted
            self.finish = "stop"
        else:
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

    @property
    def _evaluated_note(self) -> str:
        """The prompt rate counts evaluated tokens only: say so when a cached prefix was reused."""
        skipped = self.prompt_evaluated < self.prompt_tokens
        return f" ({self.prompt_evaluated} evaluated)" if skipped and self.prefill_s > 0 else ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        rounds = sum(self.accepted_hist.values())
        return self.accepted / rounds if rounds else 0.0

    def as_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_evaluated": self.prompt_evaluated,
            "generated_tokens": self.generated_tokens,
            "finish": self.finish,
            "ttft_s": round(self.ttft_s, 6),
            "tpot_s": round(self.tpot_s, 6),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "prompt_tok_s": round(self.prompt_tok_s, 3),
            "peak_rss_bytes": peak_rss_bytes(),
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_len": round(self.mean_accepted_len, 4),
            "accepted_len_histogram": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "spec_k": self.spec_k,
            "governor": self.governor,
        }

    def line(self) -> str:
        text = (
            f"{self.generated_tokens} tokens, {self.decode_tok_s:.1f} tok/s, TTFT {self.ttft_s * 1000:.0f} ms,"
            f" prompt {self.prompt_tokens} tok{self._evaluated_note} at {self.prompt_tok_s:.0f} tok/s,"
            f" peak RSS {peak_rss_bytes() / 2**20:.0f} MiB"
        )
        if self.drafted:
            text += (f"; draft {self.accepted}/{self.drafted} accepted ({self.acceptance_rate:.0%}),"
                     f" mean run {self.mean_accepted_len:.2f}, k={self.spec_k}")
        if self.governor:
            text += f"; governor: {self.governor}"
        return text
