"""Load-time costs kept on disk. A runner that speculates times every verify batch size (and a
model draft's step and catch-up) before its first reply, so the governors judge drafting before
paying for it. On CPUs that is most of a start: for the 1.5B on 2 cores, 2.4 s of a 5.3 s load of
`edgerun chat`, `run` or `serve`, at every start. The table is kept here, one file per model,
build, machine and engine settings: the seconds of each shape the key names, from which the
runner builds each governor's costs as it does from a timing. A later start on the same ones
reads it instead, and the runner lowers it where its replies timed a shape faster (lower).

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
from edgerun.convert.atomic import write_bytes
from edgerun.settings import cpu_name

MAX_AGE_S = 7 * 86400.0  # a table is timed again after a week
MAX_SECONDS = 600.0  # no batch of a load-time timing takes this long: a larger value is not a timing


def default_dir() -> Path:
    """Beside the saved KV states and n-gram pools: state the cache may lose."""
    return paths.kv_dir() / "costs"


def machine() -> dict:
    """What the timings depend on besides the model, build and settings: the CPU and the host."""
    return {"cpu": cpu_name(), "logical_cores": os.cpu_count(), "host": platform.node()}


def table_path(key: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return (root or default_dir()) / f"{digest}.json"


def load(key: dict, root: Path | None = None, *, now: float | None = None) -> dict[tuple[str, int], float] | None:
    """The seconds kept for each of the key's shapes, or None when there are none that can be
    used: missing, unreadable, made for another key, older than MAX_AGE_S, or not timings."""
    kept = _kept(key, root, now)
    return None if kept is None else kept[1]


def _kept(key: dict, root: Path | None, now: float | None) -> tuple[float, dict[tuple[str, int], float]] | None:
    """(when it was timed, the seconds of each shape) of a usable kept table (see load)."""
    try:
        doc = json.loads(table_path(key, root).read_text())
    except (OSError, ValueError):
        return None
    now = time.time() if now is None else now
    if not isinstance(doc, dict) or doc.get("key") != key:
        return None
    saved, seconds = doc.get("saved"), doc.get("seconds")
    if not _number(saved) or not 0 <= now - saved <= MAX_AGE_S:
        return None
    shapes = [tuple(shape) for shape in key["shapes"]]
    if not isinstance(seconds, list) or len(seconds) != len(shapes):
        return None
    if not all(_number(t) and 0 < t < MAX_SECONDS for t in seconds):
        return None
    return float(saved), dict(zip(shapes, map(float, seconds)))


def save(key: dict, timings: dict[tuple[str, int], float], root: Path | None = None, *,
         now: float | None = None) -> str | None:
    """Keep the seconds of the key's shapes (written atomically); the reason when they could not be."""
    doc = {"key": key, "saved": time.time() if now is None else now,
           "seconds": [timings[tuple(shape)] for shape in key["shapes"]]}
    try:
        write_bytes(table_path(key, root), json.dumps(doc).encode())
    except OSError as e:
        return f"the load-time costs were not kept ({e})"
    return None


def lower(key: dict, faster: dict[tuple[str, int], float], root: Path | None = None, *,
          now: float | None = None) -> bool:
    """Lower the kept seconds of the key's shapes to those of `faster` that are below them (what a
    session's replies measured), keeping the table's age: a table timed while the machine was
    busy is corrected by use where use ran its shapes, and still timed again after MAX_AGE_S.
    Noise only adds time, so the lower figure is the truer one. Whether the table was rewritten
    (not when nothing was lower, nor when there is no usable table to lower)."""
    kept = _kept(key, root, now)
    if kept is None:
        return False
    saved, table = kept
    lowered = {shape: min(t, faster[shape]) if _number(faster.get(shape)) and faster[shape] > 0 else t
               for shape, t in table.items()}
    return lowered != table and save(key, lowered, root, now=saved) is None


def clear(root: Path | None = None) -> int:
    """Remove every kept table; how many files went."""
    return paths.remove_matching(root or default_dir(), "*.json")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
