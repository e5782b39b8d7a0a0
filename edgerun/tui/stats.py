"""The stats panel beside the transcript: live numbers of the reply being generated."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Region
from textual.renderables.sparkline import Sparkline
from textual.strip import Strip
from textual.widget import Widget

from edgerun.decode.stats import ReplyStats
from edgerun.runtime import placement

if TYPE_CHECKING:
    from edgerun.resume import Resumed

SECTIONS = ("speed", "context", "memory", "spec", "placement")
SPARK_HEIGHT = 3


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


class StatsPanel(Widget):
    """Live numbers of the reply being generated (or the last one), refreshed by the app.

    One widget drawn line by line (Textual's line API), not a Static per section: an update
    re-renders only the lines whose text changed and never lays out the screen. With a widget
    per section, every tick rendered each changed Static through Textual's content pipeline and
    the compositor walked all nine widgets: a screen update took about 4 ms of the UI thread
    while a reply streamed, 2.3 ms with this panel (2 cores; CPU taken from llama.cpp's threads)."""

    COMPONENT_CLASSES = {"stats--title", "stats--spark-max", "stats--spark-min"}
    DEFAULT_CSS = """
    StatsPanel { height: 1fr; }
    StatsPanel > .stats--title { color: $text-muted; }
    StatsPanel > .stats--spark-max { color: $primary; }
    StatsPanel > .stats--spark-min { color: $primary 30%; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rates: deque[float] = deque([0.0], maxlen=60)
        self.text: dict[str, str] = dict.fromkeys(SECTIONS, "")  # what each section shows
        self._section_lines: dict[str, list[Strip]] = {}  # rendered at the current width
        self._spark: list[Strip] | None = None
        self._lines: list[Strip] = []
        self._title: list[Strip] = []
        self._text_style = Style()
        self._width = 0

    # ----- content ------------------------------------------------------------------------------

    def show_plan(self, plan: placement.Plan) -> None:
        """Where the models live: layers and bytes per device (set once per model load)."""
        text = f"target  {plan.devices.describe() if plan.devices else plan.target.describe()}"
        if plan.draft:
            text += f"\ndraft   {plan.draft.describe()}"
        self._set("placement", text)
        self._update()

    def show(self, stats: ReplyStats | None, *, n_ctx_used: int, n_ctx: int, rss: int, free_ram: int,
             vram: str | None, live: bool, sample: bool = True, resumed: Resumed | None = None) -> None:
        """`sample`: add the current speed to the sparkline (a point a second; the numbers beside
        it change every refresh). `resumed`: what the reply's start restored from the KV cache."""
        s = stats or ReplyStats()
        if live and sample and s.generated_tokens > 1:
            self.rates.append(s.decode_tok_s)
            self._spark = None
        self._set(
            "speed", f"decode  {s.decode_tok_s:6.1f} tok/s\nTTFT    {s.ttft_s * 1000:6.0f} ms\n"
            f"TPOT    {s.tpot_s * 1000:6.1f} ms\nprompt  {s.prompt_tok_s:6.0f} tok/s\ntokens  {s.generated_tokens:6d}"
        )
        pct = n_ctx_used / n_ctx if n_ctx else 0.0
        context = f"context {n_ctx_used}/{n_ctx} ({pct:.0%})"
        if resumed is not None and resumed.tokens:
            context += f"\n{resumed.line()}"
        elif resumed is not None and resumed.note:
            context += "\nKV cache not used: prefilled"
        self._set("context", context)
        mem = f"RSS     {_mib(rss)}\nfree    {_mib(free_ram)}"
        self._set("memory", mem + (f"\nVRAM    {vram}" if vram else ""))
        if s.drafted:
            hist = " ".join(f"{k}:{v}" for k, v in sorted(s.accepted_hist.items()))
            spec = (f"accepted {s.acceptance_rate:.0%} ({s.accepted}/{s.drafted})\nmean run {s.mean_accepted_len:.2f}"
                    f"  k={s.spec_k}\nruns    {hist}\ndraft {s.draft_s:.2f}s verify {s.verify_s:.2f}s")
        else:
            spec = "" if s.governor else "speculation: off"
        if s.governor:
            spec += f"\ngovernor: {s.governor}"
        self._set("spec", spec.strip())
        self._update()

    def _set(self, section: str, text: str) -> None:
        if self.text[section] != text:
            self.text[section] = text
            self._section_lines.pop(section, None)

    # ----- rendering ----------------------------------------------------------------------------

    def on_resize(self) -> None:
        if self.content_region.width != self._width:
            self._width = self.content_region.width
            self._restyle()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        if self._width:
            self._restyle()

    def _restyle(self) -> None:
        """Render every line again (new width, theme or CSS); the ticks in between reuse the
        styles resolved here (resolving one walks the widget's ancestors)."""
        self._text_style = self.rich_style
        self._title = self._text_lines("tokens/s", self.get_component_rich_style("stats--title"))
        self._section_lines.clear()
        self._spark = None
        self._update()

    def _update(self) -> None:
        """Lay the panel out as lines: a title, the sparkline, then each section, with a blank
        line after each; repaint only the lines that changed."""
        if not self._width:
            return
        blank = Strip.blank(0)
        if self._spark is None:
            self._spark = self._sparkline()
        lines = self._title + [blank] + self._spark + [blank]
        for section in SECTIONS:
            if self.text[section]:
                if section not in self._section_lines:
                    self._section_lines[section] = self._text_lines(self.text[section], self._text_style)
                lines += self._section_lines[section] + [blank]
        old, self._lines = self._lines, lines
        changed = [y for y in range(max(len(old), len(lines)))
                   if y >= len(old) or y >= len(lines) or old[y] is not lines[y]]
        if changed:
            # no top border or padding: a line's y in the panel is its y in the widget
            self.refresh(Region(0, changed[0], self.outer_size.width, changed[-1] - changed[0] + 1))

    def _text_lines(self, text: str, style) -> list[Strip]:
        width = self._width
        if all(cell_len(line) <= width for line in text.split("\n")):
            return [Strip([Segment(line, style)], cell_len(line)) for line in text.split("\n")]
        # a long line (a GPU placement, say) wraps at words as a Static would wrap it
        console = self.app.console
        rendered = console.render_lines(Text(text, style=style), console.options.update(width=width, height=None),
                                        pad=False)
        return [Strip(line) for line in rendered]

    def _sparkline(self) -> list[Strip]:
        _, base = self.background_colors
        spark = Sparkline(
            list(self.rates), width=self._width, height=SPARK_HEIGHT,
            min_color=(base + self.get_component_styles("stats--spark-min").color).rich_color,
            max_color=(base + self.get_component_styles("stats--spark-max").color).rich_color,
        )
        console = self.app.console
        options = console.options.update(width=self._width, height=SPARK_HEIGHT)
        return [Strip(line) for line in console.render_lines(spark, options, style=self._text_style, pad=True)]

    def render_line(self, y: int) -> Strip:
        return self._lines[y] if y < len(self._lines) else Strip.blank(0)
