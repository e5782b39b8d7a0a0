"""Plain-text tables for the scenarios' terminal reports."""

from __future__ import annotations


def align(rows: list[list[str]]) -> list[str]:
    """Columns: the first left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]
