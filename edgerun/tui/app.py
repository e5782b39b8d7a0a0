"""`edgerun chat`: the Textual app. llama.cpp runs in thread workers that talk to the UI only
through messages; the UI thread never waits on a model."""

from __future__ import annotations

import dataclasses
import operator
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import TypeVar

import psutil
from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer, Header, Static

from edgerun.chat import ChatSession
from edgerun.decode.generate import Step
from edgerun.decode.stats import ReplyStats
from edgerun.errors import EdgerunError
from edgerun.history import History
from edgerun.models import catalog
from edgerun.ngram_pool import PoolFile
from edgerun.resume import StateCache
from edgerun.runner import Runner
from edgerun import paths
from edgerun.runtime.kvstate import KvStore
from edgerun.runtime import devices, llama_log
from edgerun.settings import KV_CACHE_MIN_TOKENS, EngineSettings
from edgerun.tui import hints
from edgerun.tui.compositor import ChatScreen
from edgerun.tui.history_open import open_history
from edgerun.tui.stats import StatsPanel
from edgerun.tui.widgets import ChatInput, Entry, Transcript
from edgerun import user_settings

W = TypeVar("W")

# One UI tick four times a second moves the new text into the transcript and refreshes the stats
# panel, so both land in one screen render: every render is CPU taken from llama.cpp's threads.
REFRESH_S = 0.25
GIL_SWITCH_S = 0.0005
UI_NICE = 10
STOP_WAIT_S = 30.0  # longest wait for a stopped reply's current round before closing its model
VRAM_EVERY = 8    # nvidia-smi is a subprocess: ask it every 8th refresh only
MEMORY_EVERY = 4  # RSS and free RAM (reads of /proc): once a second
SPARK_EVERY = 4   # a tokens/s point on the sparkline: once a second (the numbers: every refresh)


@dataclass(frozen=True)
class LoadRequest:
    model: str
    draft: str | None
    engine: EngineSettings


class ModelLoaded(Message):
    def __init__(self, runner: Runner, request: LoadRequest, pool: PoolFile | None = None) -> None:
        self.runner, self.request, self.pool = runner, request, pool
        super().__init__()


class ModelFailed(Message):
    def __init__(self, error: str) -> None:
        self.error = error
        super().__init__()


class CacheNote(Message):
    """A saved KV state that was not used, or not written: one line for the user."""

    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__()


class ReplyDone(Message):
    def __init__(self, status: str, error: str | None = None) -> None:
        self.status, self.error = status, error
        super().__init__()


class EdgerunApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "edgerun"
    BINDINGS = [
        Binding("escape,ctrl+c", "stop", "Stop", priority=True),
        Binding("ctrl+n", "new_conversation", "New"),
        Binding("f2", "models", "Models"),
        Binding("f3", "settings", "Settings"),
        Binding("f4", "conversations", "Chats"),
        Binding("f5", "toggle_marks", "Draft marks"),
        Binding("ctrl+r", "copy_reply", "Copy reply", show=False),  # not ctrl+y or ctrl+k: the input box has those
        Binding("ctrl+b", "copy_code", "Copy code", show=False),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, model: str | None = None, *, draft: str | None = None,
                 engine: EngineSettings | None = None, live: bool = True, resume: int | None = None,
                 overrides: user_settings.Overrides | None = None, kv_cache: bool = True):
        """overrides: settings given on the command line; they win over the saved ones for this
        run (the status line names them) and are never saved. kv_cache: save each conversation's
        KV state after a reply and restore it when the conversation is reopened."""
        super().__init__()
        llama_log.route_to_file(paths.data_dir() / "edgerun.log")
        self.prefs, self.pref_warnings = user_settings.load()
        self.overrides = overrides or user_settings.Overrides()
        self.model_spec = model or self.prefs.last_model or catalog.load().default_target
        self.draft_spec = draft if draft is not None else self.effective.draft
        self.engine = engine or EngineSettings()
        self.live, self.resume = live, resume
        # the store exists even with the cache off: deleting a conversation removes its states
        self.kv_store = KvStore(max_bytes=self.effective.kv_cache_bytes)
        self.kv_cache = kv_cache and self.kv_store.max_bytes > 0
        self._states: StateCache | None = None  # the loaded runner's, when kv_cache
        self.history: History | None = None
        self.session: ChatSession | None = None
        self.stats: ReplyStats | None = None  # the reply being generated, or the last one
        self.reply_entry: Entry | None = None
        self._incoming: deque[tuple[str, bool]] = deque()  # (text, from_draft) from the worker, for the tick
        self.cancel = threading.Event()
        self._generation_idle = threading.Event()  # clear while a generation worker runs
        self._generation_idle.set()
        self.generating = False
        self.recent: deque[ReplyStats] = deque(maxlen=4)  # for hints that need a while
        self._ticks = 0
        self._process = psutil.Process()  # one handle, not one per refresh
        self._vram: str | None = None
        self._memory = (0, 0)  # (RSS, free RAM) as last read
        self._widgets: dict = {}  # main-screen widgets found so far (a query walks the DOM)
        self.convert_job = None  # the running or last conversion (tui/convert.py), kept across dialogs

    @property
    def effective(self) -> user_settings.UserSettings:
        """The saved settings with the command line's overrides on top: what this run uses."""
        return self.overrides.apply(self.prefs)

    # ----- layout -------------------------------------------------------------------------------

    def get_default_screen(self) -> ChatScreen:
        return ChatScreen(id="_default")

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield Transcript(id="transcript")
            yield StatsPanel(id="stats")
        yield Static("", id="status")
        box = ChatInput(id="input")
        box.cursor_blink = self.live  # a still cursor for screenshots
        yield box
        yield Footer()

    def on_mount(self) -> None:
        # The generation loop runs Python between llama.cpp calls and needs the GIL for it; while
        # the UI thread renders, it would wait up to the default 5 ms switch interval with
        # llama.cpp's threads idle. A 0.5 ms interval makes the UI hand the GIL over sooner.
        sys.setswitchinterval(GIL_SWITCH_S)
        # This thread (the UI) yields the CPU to llama.cpp's threads when both want it; it still
        # gets the few percent it needs. Linux sets nice per thread; it cannot be undone unprivileged.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UI_NICE)
        except (AttributeError, OSError):
            pass
        for warning in self.pref_warnings:
            self.notify(warning, severity="warning")
        self.refresh_stats()
        if self.live:
            self.set_interval(REFRESH_S, self.tick)
        self.query_one("#input").focus()
        open_history(self, self._history_opened)  # an unreadable file asks first, before any model loads

    def _history_opened(self, history: History) -> None:
        self.history = history
        recovered = self.history.recover()
        if recovered:
            self.notify(f"{recovered} reply(ies) were cut off when edgerun last stopped; kept as interrupted")
        self.request_load(self.model_spec, self.draft_spec)

    def on_unmount(self) -> None:
        stopped = self._stop_generation()
        self.workers.cancel_all()
        if self.session is not None and stopped:
            self.session.runner.close()
        if self.history is not None:
            self.history.close()

    # ----- model loading ------------------------------------------------------------------------

    def request_load(self, model: str, draft: str | None) -> None:
        self.set_status(f"loading {model}…")
        self.load_model(LoadRequest(model, draft, self.engine))

    @work(thread=True, exclusive=True, group="load")
    def load_model(self, request: LoadRequest) -> None:
        prefs = self.effective
        try:
            runner = Runner(request.model, request.engine, draft=request.draft, ngram=prefs.ngram,
                            spec_k=prefs.spec_k_value)
        except EdgerunError as exc:
            self.post_message(ModelFailed(str(exc)))
            return
        except Exception as exc:  # noqa: BLE001  the worker must report, not die and take the app down
            self.post_message(ModelFailed(f"loading failed unexpectedly ({type(exc).__name__}: {exc});"
                                          " run `edgerun doctor` or pick another model with F2"))
            return
        pool = PoolFile(runner.path, runner.model.n_vocab) if prefs.ngram and prefs.ngram_pool else None
        self.post_message(ModelLoaded(runner, request, pool))

    async def on_model_loaded(self, event: ModelLoaded) -> None:
        old = self.session
        self._states = (StateCache(event.runner, self.kv_store, min_tokens=KV_CACHE_MIN_TOKENS)
                        if self.kv_cache else None)
        self.session = ChatSession(event.runner, self.history, model_name=event.request.model,
                                   system=self.effective.system_prompt,
                                   conversation_id=old.conversation_id if old else self.resume,
                                   states=self._states, pool=event.pool)
        if old is not None and self._stop_generation():
            old.runner.close()
        self.model_spec, self.draft_spec = event.request.model, event.request.draft
        self.prefs = self.prefs.replace(last_model=event.request.model)
        user_settings.save(self.prefs)
        draft = event.runner.draft_spec or "none"
        self.sub_title = f"{event.runner.info.name} · draft: {draft} · {event.runner.plan.reason}"
        panel = self._main_widget(StatsPanel)
        if panel is not None:
            panel.show_plan(event.runner.plan)
        self._say_ready()
        for note in event.runner.notes:
            self.notify(note, title="note", severity="warning", timeout=10)
        if old is None and self.resume is not None:
            await self.show_conversation(self.resume)

    def _say_ready(self) -> None:
        draft = self.session.runner.draft_spec or "none"
        overridden = self.overrides.describe()
        self.set_status(f"ready: {self.model_spec} (draft {draft})" + (f" · {overridden}" if overridden else ""))

    def on_model_failed(self, event: ModelFailed) -> None:
        self.set_status("no model loaded: press F2 to pick one")
        self.notify(event.error, title="model not loaded", severity="error", timeout=10)

    # ----- chatting -----------------------------------------------------------------------------

    @on(ChatInput.Submitted)
    async def send(self, event: ChatInput.Submitted) -> None:
        if self.session is None:
            self.notify("no model is loaded yet (F2 picks one)", severity="warning")
            return
        if self.generating:
            self.notify("a reply is still being written (Esc stops it)", severity="warning")
            return
        transcript = self._main_widget(Transcript)
        transcript.add(Entry("user", event.text))
        self.reply_entry = Entry("assistant", status="streaming")
        self.reply_entry.marks = self.prefs.show_draft_marks
        transcript.add(self.reply_entry)
        transcript.scroll_end(animate=False)  # and it follows the reply until the user scrolls up
        self.generating = True
        self._generation_idle.clear()
        self.query_one(ChatInput).cursor_blink = False  # a blink is a render: none while llama.cpp works
        self.cancel = threading.Event()
        self.stats = ReplyStats()
        self.generate(event.text, self.stats, self.cancel)

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, text: str, stats: ReplyStats, cancel: threading.Event) -> None:
        try:
            session = self.session
            records = session.reply(text, self.overrides.sampling_for(self.prefs),
                                    max_tokens=self.effective.max_tokens, cancel=cancel, stats=stats)
            for i, record in enumerate(records):
                if i == 0 and session.resumed is not None and session.resumed.note:
                    self.post_message(CacheNote(session.resumed.note))
                if isinstance(record, Step) and record.text:
                    self._incoming.append((record.text, record.from_draft))  # the UI tick takes it
            if session.save_problem:
                self.post_message(CacheNote(session.save_problem))
        except EdgerunError as exc:
            self.post_message(ReplyDone("interrupted", str(exc)))
            return
        except Exception as exc:  # noqa: BLE001  the worker must report, not die and take the app down
            self.post_message(ReplyDone("interrupted", f"the reply stopped on an unexpected error"
                                                       f" ({type(exc).__name__}: {exc}); send it again or start"
                                                       " a new conversation (Ctrl+N)"))
            return
        finally:
            self._generation_idle.set()
        self.post_message(ReplyDone("stopped" if stats.finish == "cancelled" else "done"))

    def on_cache_note(self, event: CacheNote) -> None:
        self.notify(event.text, title="KV cache", severity="warning", timeout=8)

    def forget_states(self, names: list[str]) -> None:
        """Remove the state files of a deleted conversation."""
        for name in names:
            self.kv_store.remove(self.kv_store.path(name))

    def _stop_generation(self) -> bool:
        """Stop the reply being written and wait until llama.cpp has returned (the loop stops after
        the current round): a runner closed under a running decode would crash the process.
        False if it did not return in time; then the runner must be left open."""
        self.cancel.set()
        return self._generation_idle.wait(STOP_WAIT_S)

    def tick(self) -> None:
        with self.batch_update():  # text and stats land in one render
            self._drain_text()
            self.refresh_stats()

    def _drain_text(self) -> None:
        """Move the text the generation worker queued into the reply being written."""
        pieces = []
        while self._incoming:
            pieces.append(self._incoming.popleft())
        if pieces and self.reply_entry is not None:
            self.reply_entry.chunks.extend(pieces)
            self._main_widget(Transcript).changed(self.reply_entry)

    async def on_reply_done(self, event: ReplyDone) -> None:
        self._drain_text()
        self.reply_entry.status = event.status
        self._main_widget(Transcript).changed(self.reply_entry)
        self.generating = False
        self.query_one(ChatInput).cursor_blink = self.live
        self.refresh_stats()
        if event.error:
            self.notify(event.error, title="generation failed", severity="error")
        self.recent.append(self.stats)
        for hint in hints.after_reply(self.recent, self.session.runner.ctx.n_past, self.session.runner.ctx.n_ctx):
            self.notify(hint, title="hint", timeout=8)

    def action_stop(self) -> None:
        if self.generating:
            self.cancel.set()  # the loop stops after the current round; the partial reply stays
        elif self.screen is not self.screen_stack[0]:
            self.pop_screen()

    # ----- stats --------------------------------------------------------------------------------

    def refresh_stats(self) -> None:
        self._ticks += 1
        ctx = self.session.runner.ctx if self.session else None
        if self.live and self._ticks % VRAM_EVERY == 1 and devices.gpu_offload_supported():
            cards = devices.gpus()
            self._vram = ", ".join(f"{(g.total - g.free) / 2**30:.1f}/{g.total / 2**30:.0f} GiB" for g in cards)
        if self.live and (self._ticks % MEMORY_EVERY == 1 or not self.generating):
            self._memory = (self._process.memory_info().rss, devices.free_ram())
        panel = self._main_widget(StatsPanel)
        if panel is None:
            return
        rss, free_ram = self._memory
        panel.show(
            self.stats, n_ctx_used=ctx.n_past if ctx else 0, n_ctx=ctx.n_ctx if ctx else self.engine.n_ctx,
            rss=rss, free_ram=free_ram, vram=self._vram, live=self.generating,
            sample=self._ticks % SPARK_EVERY == 0, resumed=self.session.resumed if self.session else None,
        )

    def set_status(self, text: str) -> None:
        status = self._main_widget(Static, "#status")
        if status is not None:
            status.update(text)

    def _main_widget(self, kind: type[W], selector: str | None = None) -> W | None:
        """A widget of the main screen, found even while another screen is on top; None while the
        main screen is still being built or already torn down (a timer can tick then)."""
        known = self._widgets.get(selector or kind)
        if known is not None and known.is_attached:
            return known
        if not self.screen_stack:
            return None
        found = self.screen_stack[0].query(selector or kind)
        if not found:
            return None
        self._widgets[selector or kind] = widget = found.first(kind)
        return widget

    # ----- conversations and screens ----------------------------------------------------------------

    async def show_conversation(self, conv_id: int) -> None:
        if self.generating:
            self.notify("stop the reply first (Esc), then resume", severity="warning")
            return
        transcript = self._main_widget(Transcript)
        transcript.clear()
        for m in self.history.messages(conv_id):
            transcript.add(Entry(m.role, m.content, status=m.status))
        if self.session is not None:
            self.session = ChatSession(self.session.runner, self.history, model_name=self.model_spec,
                                       system=self.effective.system_prompt, conversation_id=conv_id,
                                       states=self._states, pool=self.session.pool)
        transcript.scroll_end(animate=False)

    async def action_new_conversation(self) -> None:
        if self.generating:
            self.notify("stop the reply first (Esc)", severity="warning")
            return
        self._main_widget(Transcript).clear()
        if self.session is not None:
            self.session.reset()
        self.stats = None
        self.refresh_stats()

    def action_toggle_marks(self) -> None:
        self.prefs = self.prefs.replace(show_draft_marks=not self.prefs.show_draft_marks)
        user_settings.save(self.prefs)
        transcript = self._main_widget(Transcript)
        for entry in transcript.entries:
            entry.marks = self.prefs.show_draft_marks and entry.role == "assistant"
        transcript.render_all()
        self.notify("draft tokens marked" if self.prefs.show_draft_marks else "draft marks off")

    def _last_reply(self) -> Entry | None:
        replies = [e for e in self._main_widget(Transcript).entries if e.role == "assistant"]
        return replies[-1] if replies else None

    def action_copy_reply(self) -> None:
        entry = self._last_reply()
        if entry is None:
            self.notify("nothing to copy yet", severity="warning")
            return
        self.copy_to_clipboard(entry.text)
        self.notify("reply copied")

    def action_copy_code(self) -> None:
        entry = self._last_reply()
        blocks = entry.code_blocks() if entry else []
        if not blocks:
            self.notify("the last reply has no code block", severity="warning")
            return
        self.copy_to_clipboard(blocks[-1])
        self.notify("code block copied")

    def apply_settings(self, prefs) -> None:
        """Save new settings; reload the model when what speculation uses changed. A setting the
        user changes here stops being overridden by the command line."""
        old, before, self.prefs = self.prefs, self.effective, prefs
        user_settings.save(prefs)
        changed = {f.name for f in dataclasses.fields(prefs) if getattr(old, f.name) != getattr(prefs, f.name)}
        self.overrides = self.overrides.without(changed)
        now = self.effective
        if self.session is not None:
            self.session.system = now.system_prompt
        loads = operator.attrgetter("draft", "ngram", "ngram_pool", "spec_k")  # what a load depends on
        if loads(before) != loads(now):
            self.request_load(self.model_spec, now.draft)
        elif self.session is not None:
            self._say_ready()  # the overrides it names may have changed
        still = self.overrides.describe()
        self.notify(f"settings saved ({still} still wins this run)" if still else "settings saved")

    def action_models(self) -> None:
        from edgerun.tui.screens import ModelScreen

        self.push_screen(ModelScreen(self.model_spec, self.draft_spec))

    def action_settings(self) -> None:
        from edgerun.tui.screens import SettingsScreen

        self.push_screen(SettingsScreen(self.prefs))

    def action_conversations(self) -> None:
        from edgerun.tui.screens import ConversationsScreen

        self.push_screen(ConversationsScreen(self.history))

    def action_help(self) -> None:
        from edgerun.tui.screens import HelpScreen

        self.push_screen(HelpScreen(self.BINDINGS))

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        for binding in self.BINDINGS:
            if binding.action not in ("quit",):
                yield SystemCommand(binding.description, f"{binding.description} ({binding.key})",
                                    getattr(self, f"action_{binding.action}"))
