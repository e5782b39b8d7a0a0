"""The PNG of an A/B bench (`edgerun bench --plot`): matplotlib's object API, no pyplot state."""

from __future__ import annotations

import os
from pathlib import Path

from edgerun.bench.ab import BenchResult, _runs, describe, summarize



def plot(result: BenchResult, path: Path) -> None:
    """A PNG: per-token latency distributions (left) and decode tok/s per prompt (right), A and
    B side by side. Written atomically, without pyplot's global state."""
    from matplotlib.figure import Figure

    doc, labels = summarize(result), list(result.configs)
    fig = Figure(figsize=(11, 4.5), layout="tight")
    left, right = fig.subplots(1, 2)
    boxes = left.boxplot([[x * 1000 for r in _runs(result, lab) for x in r.latencies] for lab in labels],
                         patch_artist=True)
    for i, box in enumerate(boxes["boxes"]):
        box.set_facecolor(f"C{i}")  # the same colour as the config's bars on the right
    left.set_xticks(range(1, len(labels) + 1), labels)
    fig.suptitle("   vs   ".join(f"{lab}: {describe(result.configs[lab])}" for lab in labels))
    left.set_ylabel("per-token latency (ms)")
    left.set_title("latency per token")
    names = [p.name for p in result.prompts]
    width = 0.8 / max(len(labels), 1)
    for i, lab in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(names))]
        right.bar(xs, [doc["per_prompt"][n][lab]["decode_tok_s"] or 0 for n in names], width, label=lab)
    right.set_xticks(range(len(names)), names, rotation=20)
    right.set_ylabel("decode tok/s")
    right.set_title("decode speed per prompt (median over repeats)")
    right.legend()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
