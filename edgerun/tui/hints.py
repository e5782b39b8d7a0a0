"""Troubleshooting hints from the seed document's table, as pure functions of the numbers."""

from __future__ import annotations

from collections.abc import Sequence

from edgerun.decode.stats import ReplyStats

LOW_ACCEPTANCE = 0.40   # below this a draft costs more than it saves
MIN_DRAFTED = 24        # ... judged over at least this many drafted tokens
CONTEXT_NEARLY_FULL = 0.85


def after_reply(recent: Sequence[ReplyStats], n_ctx_used: int, n_ctx: int) -> list[str]:
    """Hints worth showing after a reply, given the last few replies (newest last)."""
    out = []
    drafted = sum(s.drafted for s in recent)
    accepted = sum(s.accepted for s in recent)
    if drafted >= MIN_DRAFTED and accepted / drafted < LOW_ACCEPTANCE:
        out.append(
            f"the draft is not helping (acceptance {accepted / drafted:.0%} over {drafted} tokens):"
            " turn it off in Settings (F3) or pick a closer draft (F2)"
        )
    if n_ctx and n_ctx_used / n_ctx >= CONTEXT_NEARLY_FULL:
        out.append(
            f"context nearly full ({n_ctx_used}/{n_ctx} tokens): start a new conversation (Ctrl+N)"
            " or raise --ctx"
        )
    return out
