"""Load-time costs kept on disk. A runner that speculates times every verify batch size (and a
model draft's step and catch-up) before its first reply, so the governors judge drafting before
paying for it. On CPUs that is most of a start: for the 1.5B on 2 cores, 2.4 s of a 5.3 s load of
`edgerun chat`, `run` or `serve`, at every start. The table is kept here, one file per model,
build, machine and engine settings, and a later start on the same ones reads it instead.

Only CPU-only placements keep one: on a GPU the timing is a fraction of a second and doubles as
the warm-up of those batch shapes (CUDA graph capture). What a table says is a prior either way:
the governor reprices batches from the rounds it runs in a reply (governor.verify_bias, the
sizes a reply timed). A table older than MAX_AGE_S is timed again, so one taken while the machine
was busy does not stay. The file is validated like any input: a table that does not parse, was
made for other keys, or holds a value no timing gives is timed again and replaced."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path

from edgerun import paths
from edgerun.convert.atomic import atomic_path
from edgerun.decode.governor import Costs

MAX_AGE_S = 7 * 86400.0  # a table is timed again after a week
MAX_SECONDS = 600.0  # no batch of a load-time timing takes this long: a larger value is not a timing
DRAFTERS = ("model", "ngram")


def default_dir() -> Path:
    """Beside the saved KV states and n-gram pools: state the cache may lose."""
    return paths.kv_dir() / "costs"


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what Python's platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def machine() -> dict:
    """What the timings depend on besides the model, build and settings: the CPU and the host."""
    return {"cpu": cpu_name(), "logical_cores": os.cpu_count(), "host": platform.node()}


def table_path(key: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return (root or default_dir()) / f"{digest}.json"


def load(key: dict, root: Path | None = None, *, now: float | None = None) -> dict[str, Costs] | None:
    """The costs kept for this key, or None when there are none that can be used: missing,
    unreadable, made for another key, older than MAX_AGE_S, or not timings."""
    try:
        doc = json.loads(table_path(key, root).read_text())
    except (OSError, ValueError):
        return None
    now = time.time() if now is None else now
    if not isinstance(doc, dict) or doc.get("key") != key:
        return None
    saved = doc.get("saved")
    if not _number(saved) or not 0 <= now - saved <= MAX_AGE_S:
        return None
    costs = doc.get("costs")
    if not isinstance(costs, dict) or not costs or not set(costs) <= set(DRAFTERS):
        return None
    out = {}
    for name, entry in costs.items():
        parsed = _costs(entry)
        if parsed is None:
            return None
        out[name] = parsed
    return out


def save(key: dict, costs: dict[str, Costs], root: Path | None = None, *, now: float | None = None) -> str | None:
    """Keep the costs for this key (written atomically); the reason when they could not be."""
    path = table_path(key, root)
    doc = {"key": key, "saved": time.time() if now is None else now,
           "costs": {name: {"verify_s": [list(p) for p in c.verify_s], "draft_step_s": c.draft_step_s,
                            "catch_up_s": c.catch_up_s} for name, c in costs.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(doc))
    except OSError as e:
        return f"the load-time costs were not kept ({e})"
    return None


def clear(root: Path | None = None) -> int:
    """Remove every kept table; how many files went."""
    n = 0
    for path in (root or default_dir()).glob("*.json"):
        path.unlink(missing_ok=True)
        n += 1
    return n


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(value, *, zero: bool = False) -> bool:
    return _number(value) and (value >= 0 if zero else value > 0) and value < MAX_SECONDS


def _costs(entry) -> Costs | None:
    if not isinstance(entry, dict):
        return None
    verify = entry.get("verify_s")
    if not isinstance(verify, list) or not verify:
        return None
    pairs = []
    for pair in verify:
        if (not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], int)
                or isinstance(pair[0], bool) or pair[0] < 1 or not _seconds(pair[1])):
            return None
        pairs.append((pair[0], float(pair[1])))
    if len({n for n, _ in pairs}) != len(pairs):
        return None
    step, catch_up = entry.get("draft_step_s"), entry.get("catch_up_s")
    if (step is not None and not _seconds(step, zero=True)) or (catch_up is not None and not _seconds(catch_up)):
        return None
    return Costs(tuple(pairs), draft_step_s=None if step is None else float(step),
                 catch_up_s=None if catch_up is None else float(catch_up))
