"""`edgerun bench`: one measurement harness.

- The A/B experiment (`edgerun bench -m A --vs B ...`, ab.py): two configurations on the same
  prompts, interleaved, with latency percentiles, agreement at T=0, JSON and a plot.
- Scenarios (`edgerun bench NAME ...`, scenario.py): one per claim in docs/BENCHMARKS.md, each a
  side-by-side measurement on the same harness (interleaved turns, medians, paired ratios from
  stats.py) that writes its JSON and prints the ratio its claim is about.
"""

from edgerun.bench.ab import (
    PROMPTS_FILE, SCHEMA, SETS, BenchConfig, BenchResult, BenchSettings, Prompt, Run, describe, load_prompts,
    looks_sensitive, paragraphs, run, summarize,
)
from edgerun.bench.stats import agreement, first_divergence, gaps, percentile, ratio_spread, schedule, spread


def plot(result, path) -> None:
    """The A/B bench's PNG (plot.py; matplotlib is imported only when one is drawn)."""
    from edgerun.bench.plot import plot as draw

    draw(result, path)


__all__ = ["PROMPTS_FILE", "SCHEMA", "SETS", "BenchConfig", "BenchResult", "BenchSettings", "Prompt", "Run",
           "agreement", "describe", "first_divergence", "gaps", "load_prompts", "looks_sensitive", "paragraphs",
           "percentile", "plot", "ratio_spread", "run", "schedule", "spread", "summarize"]
