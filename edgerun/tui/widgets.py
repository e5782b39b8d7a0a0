"""Widgets of the chat screen: the input box, one transcript entry, and the stats panel."""

from __future__ import annotations

import re
from collections import deque

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Sparkline, Static, TextArea

from edgerun.decode.stats import ReplyStats
from edgerun.runtime import placement

CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


class ChatInput(TextArea):
    """Multi-line input: Enter sends, Ctrl+J (or Shift+Enter) adds a line, Up/Down on the first/
    last line walk the history of sent messages."""

    BINDINGS = [
        Binding("enter", "submit", "Send", show=True, priority=True),
        Binding("ctrl+j,shift+enter", "newline", "New line", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            self.text = text
            super().__init__()

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, **kwargs)
        self.sent: list[str] = []
        self._recall = 0

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            self.sent.append(text)
            self._recall = len(self.sent)
            self.post_message(self.Submitted(text))
            self.clear()

    def action_newline(self) -> None:
        self.insert("\n")

    def _walk(self, step: int) -> None:
        if not self.sent:
            return
        self._recall = max(0, min(len(self.sent), self._recall + step))
        self.text = self.sent[self._recall] if self._recall < len(self.sent) else ""
        self.move_cursor(self.document.end)

    def action_cursor_up(self, select: bool = False) -> None:
        if self.cursor_location[0] == 0 and not select:
            self._walk(-1)
        else:
            super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if self.cursor_location[0] == self.document.line_count - 1 and not select:
            self._walk(+1)
        else:
            super().action_cursor_down(select)


class Entry(Vertical):
    """One message of the transcript. Assistant replies stream in as markdown; with draft marks
    on, the reply shows as text with accepted draft tokens highlighted instead."""

    def __init__(self, role: str, text: str = "", *, status: str = "done") -> None:
        super().__init__(classes=f"entry {role}")
        self.role, self.status = role, status
        self.chunks: list[tuple[str, bool]] = [(text, False)] if text else []
        self._stream = None

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.chunks)

    def compose(self):
        yield Static(self._label(), classes="role")
        yield Markdown(self.text)
        yield Static("", classes="marked")

    def _label(self) -> str:
        name = {"user": "You", "assistant": "Assistant", "system": "System"}.get(self.role, self.role)
        suffix = {"stopped": " (stopped)", "interrupted": " (interrupted)", "streaming": " …"}.get(self.status, "")
        return name + suffix

    async def append(self, pieces: list[tuple[str, bool]]) -> None:
        self.chunks.extend(pieces)
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write("".join(text for text, _ in pieces))
        if self.has_class("marks"):
            self._render_marks()

    async def finish(self, status: str) -> None:
        self.status = status
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.query_one(".role", Static).update(self._label())

    def show_marks(self, on: bool) -> None:
        self.set_class(on, "marks")
        if on and self.is_mounted:
            self._render_marks()

    def on_mount(self) -> None:
        if self.has_class("marks"):
            self._render_marks()

    def _render_marks(self) -> None:
        text = Text()
        for chunk, drafted in self.chunks:
            text.append(chunk, style="bold green" if drafted else "")
        self.query_one(".marked", Static).update(text)

    def code_blocks(self) -> list[str]:
        return CODE_BLOCK.findall(self.text)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _shape(text: str) -> tuple[int, int]:
    lines = text.splitlines()
    return len(lines), max(map(len, lines), default=0)


class StatsPanel(Vertical):
    """Live numbers of the reply being generated (or the last one), refreshed by the app."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rates: deque[float] = deque([0.0], maxlen=60)
        self._shown: dict[str, str] = {}

    def _set(self, widget_id: str, text: str) -> None:
        # Every screen update is CPU taken from llama.cpp: skip unchanged text, and re-lay out the
        # screen only when the text's shape (line count, longest line) changed. The numbers are
        # fixed-width, so while a reply streams their updates only repaint.
        old = self._shown.get(widget_id)
        if old != text:
            self._shown[widget_id] = text
            self.query_one(f"#{widget_id}", Static).update(text, layout=old is None or _shape(old) != _shape(text))

    def compose(self):
        yield Static("tokens/s", classes="title")
        yield Sparkline(list(self.rates), id="rate-spark")
        yield Static("", id="speed")
        yield Static("", id="context")
        yield Static("", id="memory")
        yield Static("", id="spec")
        yield Static("", id="placement")

    def show_plan(self, plan: placement.Plan) -> None:
        """Where the models live: layers and bytes per device (set once per model load)."""
        text = f"target  {plan.target.describe()}"
        if plan.draft:
            text += f"\ndraft   {plan.draft.describe()}"
        self._set("placement", text)

    def show(self, stats: ReplyStats | None, *, n_ctx_used: int, n_ctx: int, rss: int, free_ram: int,
             vram: str | None, live: bool) -> None:
        s = stats or ReplyStats()
        if live and s.generated_tokens > 1:
            self.rates.append(s.decode_tok_s)
            self.query_one("#rate-spark", Sparkline).data = list(self.rates)
        self._set(
            "speed", f"decode  {s.decode_tok_s:6.1f} tok/s\nTTFT    {s.ttft_s * 1000:6.0f} ms\n"
            f"TPOT    {s.tpot_s * 1000:6.1f} ms\nprompt  {s.prompt_tok_s:6.0f} tok/s\ntokens  {s.generated_tokens:6d}"
        )
        pct = n_ctx_used / n_ctx if n_ctx else 0.0
        self._set("context", f"context {n_ctx_used}/{n_ctx} ({pct:.0%})")
        mem = f"RSS     {_mib(rss)}\nfree    {_mib(free_ram)}"
        self._set("memory", mem + (f"\nVRAM    {vram}" if vram else ""))
        if s.drafted:
            hist = " ".join(f"{k}:{v}" for k, v in sorted(s.accepted_hist.items()))
            spec = (f"accepted {s.acceptance_rate:.0%} ({s.accepted}/{s.drafted})\nmean run {s.mean_accepted_len:.2f}"
                    f"  k={s.spec_k}\nruns    {hist}\ndraft {s.draft_s:.2f}s verify {s.verify_s:.2f}s")
        else:
            spec = "speculation: off" if not s.governor or s.governor == "no drafter" else ""
        if s.governor and s.governor != "no drafter":
            spec += f"\ngovernor: {s.governor}"
        self._set("spec", spec.strip())
