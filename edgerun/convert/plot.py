"""The plan against llama.cpp's stock recipes: mean KLD against the F16 by file size, one PNG
(`edgerun convert --plot`, and the chat app's convert report). matplotlib's object API, no pyplot
state; written atomically."""

from __future__ import annotations

from pathlib import Path

from edgerun.convert.atomic import atomic_path


def points(report_doc: dict) -> list[tuple[str, float, float, bool]]:
    """(label, size MB, mean KLD, is the plan) of the report's plan and every stock recipe it
    measured (details["stock"]); empty when the plan's quality was not measured."""
    out = []
    if report_doc.get("kld_mean") is not None:
        out.append(("edgerun plan", report_doc["size_bytes"] / 1e6, report_doc["kld_mean"], True))
    for name, r in (report_doc.get("stock") or {}).items():
        out.append((name, r["size_bytes"] / 1e6, r["kld_mean"], False))
    return out


def plot(report_doc: dict, path: Path) -> Path:
    """A PNG of mean KLD (log scale) vs size: the stock recipes as a line of labelled dots, the plan
    as a star. Returns PATH."""
    from matplotlib.figure import Figure

    pts = points(report_doc)
    stock = sorted((p for p in pts if not p[3]), key=lambda p: p[1])
    fig = Figure(figsize=(7, 4.5), layout="tight")
    ax = fig.subplots()
    if stock:
        ax.plot([p[1] for p in stock], [p[2] for p in stock], "o-", color="C0", label="llama.cpp stock recipes")
        for name, x, y, _ in stock:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for name, x, y, _ in (p for p in pts if p[3]):
        ax.plot([x], [y], "*", color="C3", markersize=14, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("mean KLD vs F16 (log)")
    ax.set_title(Path(report_doc.get("output", "")).name)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return path


def text_chart(report_doc: dict, width: int = 40) -> list[str]:
    """The same comparison as text lines (for a terminal or the chat app): size, KLD and a bar
    whose length is log KLD, the plan marked."""
    import math

    pts = sorted(points(report_doc), key=lambda p: p[1])
    if not pts:
        return []
    logs = [math.log10(max(p[2], 1e-9)) for p in pts]
    lo, hi = min(logs), max(logs)
    name_w = max(len(p[0]) for p in pts)
    lines = []
    for (name, size, kld, ours), lg in zip(pts, logs):
        n = 1 + int((lg - lo) / (hi - lo) * (width - 1)) if hi > lo else width // 2
        lines.append(f"{'*' if ours else ' '} {name:<{name_w}} {size:8.1f} MB  KLD {kld:.5f}  {'#' * n}")
    return lines
