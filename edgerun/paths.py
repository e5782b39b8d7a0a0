"""Where edgerun keeps things, following XDG (overridable with EDGERUN_HOME)."""

from __future__ import annotations

import os
from pathlib import Path


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var)
    return Path(value) if value else Path.home() / fallback


def home() -> Path | None:
    value = os.environ.get("EDGERUN_HOME")
    return Path(value) if value else None


def cache_dir() -> Path:
    """Models and download leftovers."""
    root = home()
    return root / "cache" if root else _xdg("XDG_CACHE_HOME", ".cache") / "edgerun"


def data_dir() -> Path:
    """Conversations and other state worth keeping."""
    root = home()
    return root / "data" if root else _xdg("XDG_DATA_HOME", ".local/share") / "edgerun"


def config_dir() -> Path:
    root = home()
    return root / "config" if root else _xdg("XDG_CONFIG_HOME", ".config") / "edgerun"


def kv_dir() -> Path:
    """Saved KV states (runtime/kvstate.py); EDGERUN_KV_DIR puts them elsewhere (a faster disk)."""
    value = os.environ.get("EDGERUN_KV_DIR")
    return Path(value) if value else cache_dir() / "kv"


def models_dir() -> Path:
    return cache_dir() / "models"


def downloads_dir() -> Path:
    return cache_dir() / "downloads"


def remove_matching(folder: Path, pattern: str) -> int:
    """Remove the files of FOLDER whose names match PATTERN (a glob); how many went."""
    n = 0
    for path in folder.glob(pattern):
        path.unlink(missing_ok=True)
        n += 1
    return n
