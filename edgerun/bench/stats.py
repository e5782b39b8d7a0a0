"""The pure statistics every bench shares: percentiles, per-token gaps, output agreement,
spreads and paired ratios, and the interleaved schedule. Data in, numbers out; no model."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence



def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (NumPy's default); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def gaps(times: Sequence[float]) -> list[float]:
    """Per-token latency: the time between consecutive tokens (the first token's is the TTFT)."""
    return [b - a for a, b in zip(times, times[1:])]


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of positions holding the same token in both outputs, over the longer output."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length when one output is a prefix of
    the other); None when the outputs are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def spread(values: Sequence[float]) -> dict | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def ratio_spread(a: Sequence[float], b: Sequence[float]) -> dict | None:
    """B / A for each paired repeat, as median, min and max; pairs with A == 0 are skipped."""
    return spread([y / x for x, y in zip(a, b) if x])


def schedule(n_prompts: int, labels: Sequence[str], repeat: int) -> list[tuple[int, int, str]]:
    """(repeat, prompt index, label), configurations interleaved: noise falls on both alike."""
    return [(r, p, label) for r in range(repeat) for p in range(n_prompts) for label in labels]


