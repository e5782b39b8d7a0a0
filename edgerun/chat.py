"""A conversation with a loaded model, persisted as it streams. The TUI and the plain REPL both
drive this; neither talks to the runner or the database directly."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from edgerun.decode.generate import Prefill, Step
from edgerun.decode.speculative import Round
from edgerun.decode.stats import ReplyStats
from edgerun.errors import EngineError
from edgerun.history import History
from edgerun.ngram_pool import PoolFile
from edgerun.resume import Resumed, StateCache
from edgerun.runner import Runner
from edgerun.settings import SamplerSettings

FLUSH_EVERY_S = 0.2  # how often streamed text reaches the database (a kill loses at most this much)


class ChatSession:
    """Messages of one conversation plus the runner that answers them. With `states`, the
    conversation's KV state is saved after each reply and restored before the next one when the
    context does not hold it (a conversation reopened, or edgerun started again)."""

    def __init__(self, runner: Runner, history: History, *, model_name: str, system: str | None = None,
                 conversation_id: int | None = None, states: StateCache | None = None,
                 pool: PoolFile | None = None):
        self.runner, self.history, self.states, self.pool = runner, history, states, pool
        self._pooled = 0  # the conversation's tokens already in the pool (`pool`: where replies go)
        if pool is not None:
            runner.ngram_pool = pool.pool
        self.model_name, self.system = model_name, system
        self.conversation_id = conversation_id
        self.resumed: Resumed | None = None  # what the last reply's start restored (set before its first record)
        self.save_problem: str | None = None  # why the last reply's state (or the pool) was not saved
        self.messages: list[dict] = []
        if conversation_id is not None:
            self.messages = [{"role": m.role, "content": m.content} for m in history.messages(conversation_id)]

    def _prompt(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def reply(self, user_text: str, sampling: SamplerSettings, *, max_tokens: int,
              cancel: threading.Event, stats: ReplyStats | None = None) -> Iterator[Prefill | Step | Round]:
        """Stream the model's answer to user_text, saving both sides as they happen. `stats`
        (updated as records arrive) lets another thread watch the reply live."""
        if self.conversation_id is None:
            self.conversation_id = self.history.new_conversation(
                self.model_name, draft=self.runner.draft_spec, system=self.system)
        self.history.add_message(self.conversation_id, "user", user_text)
        self.messages.append({"role": "user", "content": user_text})
        msg_id = self.history.begin_reply(self.conversation_id)
        stats = stats if stats is not None else ReplyStats()
        parts: list[str] = []
        reply_tokens: list[int] = []
        unsaved: list[str] = []
        last_flush = time.monotonic()
        status = "interrupted"
        try:
            tokens = self.runner.chat_tokens(self._prompt())
            if self.states is not None:
                self.resumed = self.states.resume(tokens, self.history.kv_states(self.conversation_id))
            for record in self.runner.stream(tokens, sampling, max_tokens=max_tokens, cancel=cancel):
                stats.add(record)
                if isinstance(record, Step) and record.finish != "stop":
                    reply_tokens.append(record.token)
                if isinstance(record, Step) and record.text:
                    parts.append(record.text)
                    unsaved.append(record.text)
                    if time.monotonic() - last_flush >= FLUSH_EVERY_S:
                        self.history.append_reply(msg_id, "".join(unsaved))
                        unsaved.clear()
                        last_flush = time.monotonic()
                yield record
            status = "stopped" if stats.finish == "cancelled" else "done"
        finally:
            if unsaved:
                self.history.append_reply(msg_id, "".join(unsaved))
            resumed = {"resumed": self.resumed.as_json()} if self.resumed and self.states else {}
            self.history.finish_reply(msg_id, status, stats.as_json() | resumed)
            self.messages.append({"role": "assistant", "content": "".join(parts)})
        if self.states is not None:  # not after an error: the context's state is in doubt then
            self.save_state()
        if self.pool is not None:
            self.save_problem = self._remember(tokens, reply_tokens) or self.save_problem

    def _remember(self, prompt: list[int], reply: list[int]) -> str | None:
        """Give the pool what this turn added to the conversation (a reopened one: all of it)."""
        start = self._pooled if self._pooled <= len(prompt) else 0
        self._pooled = len(prompt) + len(reply)
        return self.pool.remember(prompt[start:] + reply)

    def save_state(self) -> None:
        """Save what the context holds as this conversation's state; the states it replaces
        (the same conversation, fewer tokens) are removed. A state that cannot be written (a
        full disk) costs only the next resume's speed: `save_problem` says so."""
        self.save_problem = None
        try:
            saved = self.states.save()
        except (OSError, EngineError) as e:
            self.save_problem = f"the conversation's KV state was not saved ({e}); reopening it will prefill"
            return
        for name in self.history.record_kv_states(self.conversation_id, saved) if saved else ():
            self.states.store.remove(self.states.store.path(name))

    def reset(self) -> None:
        """Start a new conversation (the old one stays in the history)."""
        self.conversation_id = None
        self.messages = []
        self.resumed = None
        self._pooled = 0

