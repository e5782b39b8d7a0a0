"""A reply's text as the client sees it: tokens to UTF-8, stop strings, the finish reason."""

from __future__ import annotations

import codecs

from edgerun.runtime.engine import Model


class ReplyText:
    """Turns a reply's tokens into text deltas. Text that could still be the start of a stop string
    is held back until the next token decides it, so a stop string never reaches the client; the
    text before it does."""

    def __init__(self, model: Model, stop: list[str], max_tokens: int):
        self.model, self.stop, self.max_tokens = model, [s for s in stop if s], max_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded, not yet sent
        self.tokens = 0  # completion tokens (an end-of-generation token is not one)
        self.finish: str | None = None  # "stop" or "length" once the reply is over

    def push(self, token: int) -> str:
        """The text this token releases (may be ""); sets `finish` when the reply is over."""
        if self.finish is not None:
            return ""
        if self.model.is_eog(token):
            return self._end("stop", self._decoder.decode(b"", final=True))
        self.tokens += 1
        self._held += self._decoder.decode(self.model.piece(token))
        hits = [self._held.find(s) for s in self.stop if s in self._held]
        if hits:
            self._held = self._held[: min(hits)]
            return self._end("stop", "")
        if self.tokens >= self.max_tokens:
            return self._end("length", self._decoder.decode(b"", final=True))
        keep = self._partial_stop()
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        return out

    def end(self, reason: str) -> str:
        """End the reply from outside (the decode loop ran out of room): the text still held."""
        return self._end(reason, self._decoder.decode(b"", final=True)) if self.finish is None else ""

    def _end(self, reason: str, tail: str) -> str:
        self.finish = reason
        out, self._held = self._held + tail, ""
        return out

    def _partial_stop(self) -> int:
        """The length of the longest end of the held text that begins some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best
