"""Resuming from saved KV states: before a reply, restore the longest saved prefix of its prompt
that the context does not already hold; after it, save what the context holds.

Two ways to find a state. A conversation in the history names its own (the history records
which state files belong to it and how many tokens each covers), so a missing or stale one is
noticed and said. `edgerun run` and `chat --plain` have no conversation: they take the saved
state under this runner's key that shares the longest prefix with the prompt (a long fixed
--system or stdin file).

Whatever goes wrong with a state (gone, another model or context size, another llama.cpp build,
truncated, corrupt, refused by llama.cpp, covering other tokens than recorded) leaves the
context empty and becomes one note; the reply then prefills as it would have without a cache.
The draft model's state is saved and restored beside the target's when the draft holds the
conversation: a draft that lags catches up by prefill before its first round, which on a CPU
costs seconds for a long conversation, against milliseconds to restore."""

from __future__ import annotations

import time
from dataclasses import dataclass

from edgerun.errors import EngineError
from edgerun.runtime.engine import Context, common_prefix
from edgerun.runtime.kvstate import (KvStore, SavedState, StateInfo, StateKey, StateUnusable, file_name, llama_build,
                                     model_identity)

# A restore reads the whole file; below this many tokens of gain over what the context already
# holds (a turn of the same conversation in memory), evaluating them is as quick.
MIN_GAIN = 16
KV_TYPE = "f16"  # llama.cpp's default cache type, which edgerun's contexts use


@dataclass(frozen=True)
class Resumed:
    """What a reply's start took from the KV cache: the tokens and bytes restored and the time it
    took, and why a saved state was not used (one line, for the user), if one was not."""

    tokens: int = 0  # of the prompt, served by the restored state
    bytes: int = 0  # payload read (the target's and the draft's)
    seconds: float = 0.0
    draft_tokens: int = 0
    note: str | None = None

    def line(self) -> str:
        """e.g. "resumed 3,012 tokens from cache in 0.21 s"; "" when nothing was restored."""
        if not self.tokens:
            return ""
        return f"resumed {self.tokens:,} tokens from cache in {self.seconds:.2f} s"

    def as_json(self) -> dict:
        return {"tokens": self.tokens, "bytes": self.bytes, "seconds": round(self.seconds, 6),
                "draft_tokens": self.draft_tokens, "note": self.note}


def state_key(ctx: Context, model_path) -> StateKey:
    return StateKey(model=model_identity(model_path), n_ctx=ctx.n_ctx, n_seq=ctx.n_seq,
                    gpu_layers=ctx.model.n_gpu_layers, kv_type=KV_TYPE, llama=llama_build())


class StateCache:
    """A runner's contexts and the store: restore before a reply, save after it. The runner's
    keys are computed once (a model's identity reads its header)."""

    def __init__(self, runner, store: KvStore, *, min_tokens: int):
        self.runner, self.store, self.min_tokens = runner, store, min_tokens
        self._keys: dict[str, StateKey] = {}

    def contexts(self) -> dict[str, Context]:
        found = {"target": self.runner.ctx}
        if self.runner.draft_ctx is not None:
            found["draft"] = self.runner.draft_ctx
        return found

    def key(self, role: str) -> StateKey:
        if role not in self._keys:
            path = self.runner.path if role == "target" else self.runner.draft_path
            self._keys[role] = state_key(self.contexts()[role], path)
        return self._keys[role]

    # ----- before a reply -----------------------------------------------------------------------

    def resume(self, tokens: list[int], saved: list[SavedState] | None = None) -> Resumed:
        """Restore the target's (and the draft's) saved state for a prompt of `tokens` where it
        covers more than the context holds. `saved`: the conversation's states as the history
        records them; None: the best prefix in the store under this runner's key."""
        start = time.perf_counter()
        restored: dict[str, tuple[StateInfo, int]] = {}
        notes = []
        for role, ctx in self.contexts().items():
            try:
                found = self.restore(role, tokens, saved)
            except StateUnusable as e:
                then = "evaluating the prompt" if role == "target" else "the draft catches up by prefill"
                notes.append(f"saved {role} KV state not used: {e}; {then}")
                continue
            if found is not None:
                restored[role] = found
        return Resumed(tokens=restored["target"][1] if "target" in restored else 0,
                       bytes=sum(info.payload_bytes for info, _ in restored.values()),
                       seconds=time.perf_counter() - start if restored else 0.0,
                       draft_tokens=restored["draft"][1] if "draft" in restored else 0,
                       note="; ".join(notes) or None)

    def restore(self, role: str, tokens: list[int],
                saved: list[SavedState] | None) -> tuple[StateInfo, int] | None:
        """Restore one context's state (role: "target" or "draft"); returns the state and how
        many of `tokens` it serves, or None when none would gain. Raises StateUnusable."""
        ctx = self.contexts()[role]
        key = self.key(role)
        held = ctx.shared_prefix(tokens)
        if saved is None:
            found = self.store.best_prefix(key, tokens)
            if found is None or found[1] < held + MIN_GAIN:
                return None
            path, expect = found[0].path, None
        else:
            mine = [s for s in saved if s.role == role]
            if not mine:
                return None
            record = next((s for s in mine if s.key == key.digest()), mine[0])
            if record.n_tokens < held + MIN_GAIN:
                return None  # the context holds it already (the conversation goes on in memory)
            path, expect = self.store.path(record.name), record.n_tokens
        try:
            info, payload = self.store.read(path, key)
        except StateUnusable as e:
            if e.broken:  # truncated or corrupt: it can never be used
                self.store.remove(path)
            raise
        if expect is not None and info.n_tokens != expect:
            raise StateUnusable(f"it covers {info.n_tokens} tokens, the history says {expect}")
        shared = common_prefix(info.tokens, tokens)
        if shared < held + MIN_GAIN:
            return None  # the prompt leaves the state early (an edited turn): no gain
        try:
            ctx.restore_state(payload, list(info.tokens))
        except EngineError as e:
            raise StateUnusable(str(e)) from None
        self.store.touch(path)
        return info, shared

    # ----- after a reply ------------------------------------------------------------------------

    def save(self, *, upto: int | None = None) -> list[SavedState]:
        """Save what the contexts hold: the target's first `upto` tokens only, when given, and
        the draft's common prefix with the target. A state under min_tokens is not worth a
        file; one already saved (same key, same tokens) is only marked used."""
        target = self.runner.ctx
        if upto is not None:
            target.trim(upto)
        out = []
        for role, ctx in self.contexts().items():
            if role == "draft":  # past the common prefix it holds drafts the target rejected
                ctx.trim(common_prefix(ctx.held(), target.held()))
            tokens = list(ctx.held())
            if len(tokens) < self.min_tokens:
                continue
            key = self.key(role)
            path = self.store.root / file_name(key, tokens)
            if path.is_file():
                self.store.touch(path)
                out.append(SavedState(role, key.digest(), path.name, len(tokens), path.stat().st_size))
                continue
            info = self.store.save(key, tokens, ctx.state_bytes(), label=self._label(role))
            if info is not None:  # None: larger than the whole cap
                out.append(SavedState(role, key.digest(), info.path.name, info.n_tokens, info.size))
        return out

    def _label(self, role: str) -> str:
        path = self.runner.path if role == "target" else self.runner.draft_path
        return path.name
