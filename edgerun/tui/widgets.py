"""Widgets of the chat screen: the input box, and the transcript and its entries (the stats panel
is in stats.py)."""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import re

from markdown_it import MarkdownIt
from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from rich.syntax import Syntax
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.cache import LRUCache
from textual.message import Message
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import TextArea

from edgerun.serve.tools import CLOSE, OPEN

# a fenced code block at the start of a line; an unclosed one (still streaming) runs to the end
FENCE = re.compile(r"^[ \t]*(?P<mark>```+|~~~+)[ \t]*(?P<lang>[^\s`]*)[^\n]*\n(?P<code>.*?)(?:^[ \t]*(?P=mark)[ \t]*$|\Z)",
                   re.DOTALL | re.MULTILINE)
TOP_LEVEL_SPLIT = re.compile(r"\n\n(?=\S)")  # a blank line, then an unindented line
BLANK = Strip.blank(0)
WARM_UP = 'A **reply** with `code`:\n\n```python\ndef f(x: int) -> str:\n    return f"{x}"  # note\n```\n\n1. one\n- two\n'


def tool_call_view(call: str) -> tuple[str, str]:
    """A <tool_call> body (the text after the tag, its closing tag maybe not yet streamed) as the
    function's name and its arguments as indented JSON; a body that is not JSON yet is shown as it is."""
    body = call.split(CLOSE, 1)[0].strip()
    try:
        parsed = json.loads(body)
        return str(parsed.get("name", "")), json.dumps(parsed.get("arguments", {}), indent=2, ensure_ascii=False)
    except (ValueError, AttributeError):
        return "", body


@functools.cache
def _parser() -> MarkdownIt:
    """One markdown parser for every entry: building one costs 0.3 ms, four times the parse of a
    tick's text."""
    return MarkdownIt("gfm-like")


class ChatInput(TextArea):
    """Multi-line input: Enter sends, Ctrl+J (or Shift+Enter) adds a line, Up/Down on the first/
    last line walk the history of sent messages."""

    BINDINGS = [
        Binding("enter", "submit", "Send", show=True),  # for the footer; _on_key acts on it
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

    async def _on_key(self, event: events.Key) -> None:
        # Enter is handled here, in the order keys arrive, not as a priority binding: the app
        # runs those before the keys still queued for this box, so text typed or pasted just
        # before Enter was cut off ("... the se" of "... the sea.").
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        await super()._on_key(event)

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


class Entry:
    """One message of the transcript: its text as it streamed (with which pieces came from accepted
    draft proposals), and its rendered lines, cached per markdown block."""

    def __init__(self, role: str, text: str = "", *, status: str = "done") -> None:
        self.role, self.status = role, status
        self.chunks: list[tuple[str, bool]] = [(text, False)] if text else []
        self.marks = False
        self._blocks: dict[tuple[str, bool], list[Strip]] = {}  # (block source, streaming) -> lines at the view's width
        self._done: list[str] = []  # sources of the blocks that can no longer change
        self._tail_line = 0  # the text line where the block that may still grow starts

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.chunks)

    @property
    def label(self) -> str:
        name = {"user": "You", "assistant": "Assistant", "system": "System"}.get(self.role, self.role)
        suffix = {"stopped": " (stopped)", "interrupted": " (interrupted)", "streaming": " …"}.get(self.status, "")
        return name + suffix

    def code_blocks(self) -> list[str]:
        return [fence["code"] for fence in FENCE.finditer(self.text)]

    def block_sources(self) -> list[str]:
        """The text split into top-level markdown blocks. Only the text from the last block on is
        parsed again: a block is final once the next one has started."""
        lines = self.text.splitlines(keepends=True)
        tail = lines[self._tail_line:]
        starts = [t.map for t in _parser().parse("".join(tail)) if t.map is not None and t.level == 0]
        for a, b in starts[:-1]:
            self._done.append("".join(tail[a:b]))
        if starts:
            a, b = starts[-1]
            self._tail_line += a
            return self._done + ["".join(tail[a:b])]
        return list(self._done)

    def forget_rendering(self) -> None:
        self._blocks.clear()


class Transcript(ScrollView, can_focus=True):
    """The conversation, drawn line by line (Textual's line API) from lines rendered once per
    markdown block. While a reply streams only its last block is rendered again, and no widget
    tree is laid out: the cost of a text update stays the same however long the conversation
    is (with a widget per message and per block, every update laid out all of them)."""

    COMPONENT_CLASSES = {"transcript--role", "transcript--user-role", "transcript--draft"}
    DEFAULT_CSS = """
    Transcript { scrollbar-gutter: stable; }
    Transcript > .transcript--role { text-style: bold; color: $accent; }
    Transcript > .transcript--user-role { text-style: bold; color: $success; }
    Transcript > .transcript--draft { text-style: bold; color: $success; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.entries: list[Entry] = []
        self._lines: list[list[Strip]] = []  # per entry
        self._starts: list[int] = []  # first line of each entry
        self._width = 0
        self._room = False  # keep room below a streaming reply (see changed)
        self._piece_cache: LRUCache[tuple[str, str, int, str], list[Strip]] = LRUCache(256)  # streaming code pieces
        self._code_cache: LRUCache[tuple, list[Strip]] = LRUCache(4000)  # a code line's lines, by highlighting
        self._line_cache: LRUCache[tuple[int, int, int], tuple[Strip, Strip]] = LRUCache(1000)
        # (role style, label) -> the label's line: resolving a component style walks the CSS, and
        # every refresh empties Textual's cache of them, so a streaming reply paid it each update
        self._labels: dict[tuple[str, str], Strip] = {}

    # ----- content ------------------------------------------------------------------------------

    def add(self, entry: Entry) -> Entry:
        self.entries.append(entry)
        self._lines.append([])
        self._room = False
        self.changed(entry)
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self._lines.clear()
        self._room = False
        self._update_size(follow=False)
        self.scroll_home(animate=False)

    def changed(self, entry: Entry) -> None:
        """Render an entry again after its text, status or marks changed; follows the end of the
        conversation when the view was showing it.

        While a reply streams, the view keeps up to half a screen of room below it and scrolls
        only when that is used up, half a screen at a time: between those jumps the text stands
        still (easier to read) and an update repaints only the lines that changed, not the whole
        view shifted by a line."""
        at_end = self.scroll_y >= self.max_scroll_y
        i = self.entries.index(entry)
        dirty = None
        if self._width:
            old, new = self._lines[i], self._render_entry(entry)
            self._lines[i] = new
            if i == len(self.entries) - 1:  # nothing below it moves: repaint from the first changed line
                first = next((k for k, (a, b) in enumerate(zip(old, new)) if a is not b and a != b), min(len(old), len(new)))
                dirty = (self._starts[i] + first, max(len(old), len(new)) - first)
        self._room = self._room or entry.status == "streaming"
        self._update_size(follow=at_end, dirty=dirty)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._labels.clear()

    def render_all(self) -> None:
        for entry in self.entries:
            entry.forget_rendering()
        self._lines = [self._render_entry(e) for e in self.entries] if self._width else [[] for _ in self.entries]
        self._update_size(follow=False)

    def _update_size(self, *, follow: bool, dirty: tuple[int, int] | None = None) -> None:
        self._starts = list(itertools.accumulate((len(lines) for lines in self._lines), initial=0))
        height = self._starts[-1]
        if self._room:
            step = max(self.scrollable_content_region.height // 2, 1)
            height = -(-height // step) * step
        size = Size(self._width, height)
        if size != self.virtual_size:
            # Setting virtual_size would lay out the whole screen. Only the scrollbar depends on
            # the height, so update it in place, and lay out only when the scrollbar appears or goes.
            shown = self.show_vertical_scrollbar
            self.set_reactive(ScrollView.virtual_size, size)
            self._scroll_update(size)
            if self.show_vertical_scrollbar != shown:
                self.refresh(layout=True)
            self.refresh()
            if follow:  # after the refresh, when the new height is known
                self.scroll_end(animate=False, x_axis=False)
        elif dirty is not None:
            if dirty[1]:
                self.refresh_lines(*dirty)
        else:
            self.refresh()

    # ----- rendering ----------------------------------------------------------------------------

    def on_mount(self) -> None:
        self.set_timer(0.5, self._warm_up)

    def _warm_up(self) -> None:
        """Render a sample reply once, off screen, while the model loads: the first use of the
        markdown parser and of a Pygments lexer compiles their patterns (about 0.15 s here), which
        would otherwise land on the first reply and take that time from llama.cpp's threads."""
        self._render_entry(Entry("assistant", WARM_UP))

    def on_resize(self) -> None:
        width = self.scrollable_content_region.width
        if width != self._width:
            self._width = width
            self.render_all()

    def _render_entry(self, entry: Entry) -> list[Strip]:
        role = "transcript--user-role" if entry.role == "user" else "transcript--role"
        label = self._labels.get((role, entry.label))
        if label is None:
            label = Strip([Segment(entry.label, self.get_component_rich_style(role, partial=True))])
            self._labels[role, entry.label] = label
        lines = [label]
        if entry.marks:
            text = Text()
            draft = self.get_component_rich_style("transcript--draft", partial=True)
            for chunk, drafted in entry.chunks:
                text.append(chunk, style=draft if drafted else "")
            lines += self._strips(text)
        else:
            sources = entry.block_sources()
            keys = [(source, entry.status == "streaming" and i == len(sources) - 1) for i, source in enumerate(sources)]
            # keep only the blocks shown now: a streaming tail leaves a stale version every update
            entry._blocks = {key: entry._blocks.get(key) or self._block_lines(*key) for key in keys}
            for i, key in enumerate(keys):
                lines += ([BLANK] if i else []) + entry._blocks[key]
        return lines + [BLANK]

    def _block_lines(self, source: str, streaming: bool = False) -> list[Strip]:
        """A markdown block's lines. Blocks other than code lose the blank lines Rich puts around
        some of them (headings): the transcript puts one blank line between any two blocks."""
        theme = "monokai" if self.app.current_theme.dark else "default"
        if OPEN in source:
            return self._tool_call_lines(source, theme, streaming)
        fence = FENCE.match(source)
        if fence:
            return self._code_lines(fence["code"], fence["lang"] or "text", theme, streaming=streaming)
        lines = self._strips(RichMarkdown(source, code_theme=theme, hyperlinks=False))
        while lines and not lines[0].text.strip():
            lines.pop(0)
        while lines and not lines[-1].text.strip():
            lines.pop()
        return lines

    def _tool_call_lines(self, source: str, theme: str, streaming: bool) -> list[Strip]:
        """A block holding a model's <tool_call>s (Qwen2.5's format), one after another when it
        calls several: each a header naming the function, then its arguments as highlighted JSON;
        text before the first tag stays markdown."""
        before, *calls = source.split(OPEN)
        lines = self._block_lines(before) + [BLANK] if before.strip() else []
        style = self.get_component_rich_style("transcript--role", partial=True)
        for i, call in enumerate(calls):
            name, body = tool_call_view(call)
            lines += ([BLANK] if i else []) + [Strip([Segment(f"⚙ tool call: {name or '…'}", style)])]
            lines += self._code_lines(body, "json", theme, streaming=streaming and i == len(calls) - 1)
        return lines

    def _code_lines(self, code: str, lang: str, theme: str, *, streaming: bool = False) -> list[Strip]:
        """A fenced code block drawn as Rich's Syntax draws it (a padded panel across the view,
        long lines wrapped), built line by line from a cache: only lines whose highlighting changed
        are rendered again. Syntax itself renders every line on every update (33 ms per update
        for a 95-line block here).

        A block still streaming is highlighted in top-level pieces (split where a blank line is
        followed by an unindented line), and only the last piece again: the cost of an update
        stays flat however long the block gets. A multi-line string spanning such a split can
        show in the wrong colour until the reply ends; then the whole block is highlighted."""
        bg = Syntax.get_theme(theme).get_background_style()
        width = max(self._width - 2, 1)
        options = self.app.console.options.update(width=width, height=None, justify="left")
        edge = Segment(" ", bg)
        panel_edge = Strip([Segment(" " * (width + 2), bg)])
        code = code.rstrip("\n").expandtabs(4)
        pieces = TOP_LEVEL_SPLIT.split(code) if streaming else [code]

        def drawn(line: Text) -> list[Strip]:
            key = (theme, width, line.plain, tuple(line.spans), str(line.style))
            strips = self._code_cache.get(key)
            if strips is None:
                rendered = self.app.console.render_lines(line, options, style=bg, pad=True)
                strips = [Strip([edge, *segments, edge]) for segments in rendered]
                self._code_cache[key] = strips
            return strips

        lines = [panel_edge]
        for n, piece in enumerate(pieces):
            if n:
                lines += drawn(Text(""))  # the blank line the split took
            # a piece before the last can no longer change: its lines are kept whole, so an
            # update looks at the last piece's lines only
            final = n < len(pieces) - 1
            key = (lang, theme, width, piece)
            piece_strips = self._piece_cache.get(key) if final else None
            if piece_strips is None:
                body = piece.rstrip("\n")  # more blank lines before the split: drawn as such
                piece_lines = list(Syntax(body, lang, theme=theme).highlight(body).split("\n"))
                piece_lines += [Text("") for _ in range(len(piece) - len(body))]
                piece_strips = [strip for line in piece_lines for strip in drawn(line)]
                if final:
                    self._piece_cache[key] = piece_strips
            lines += piece_strips
        return lines + [panel_edge]

    def _strips(self, renderable) -> list[Strip]:
        console = self.app.console
        options = console.options.update(width=max(self._width, 1), height=None)
        return [Strip(line) for line in console.render_lines(renderable, options, pad=False)]

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self._width
        n = scroll_y + y
        i = bisect.bisect_right(self._starts, n) - 1
        if 0 <= i < len(self._lines) and n - self._starts[i] < len(self._lines[i]):
            strip = self._lines[i][n - self._starts[i]]
        else:
            strip = BLANK
        # a scroll (the half-screen jump while following a reply, or the user's) moves lines
        # without changing them: those come from the cache, not cropped and styled again
        key = (id(strip), scroll_x, width)
        cached = self._line_cache.get(key)
        if cached is None or cached[0] is not strip:
            cached = (strip, strip.crop_extend(scroll_x, scroll_x + width, self.rich_style).apply_style(self.rich_style))
            self._line_cache[key] = cached
        return cached[1]

