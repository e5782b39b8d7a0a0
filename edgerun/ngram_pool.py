"""The n-gram pool on disk: the tokens of earlier conversations with one model, which the chat
app's n-gram drafter also drafts from (decode/ngram.NgramPool), so code the model wrote in another
conversation can be copied in long drafts when it is asked for again. One file per model in the
KV cache's folder (`ngram/`), the newest POOL_TOKENS tokens (256 KiB), written atomically after
each reply; a file that is missing or unreadable is an empty pool, and ids that are no token of
the model are dropped on load. `edgerun cache clear` removes the pools with the saved KV states."""

from __future__ import annotations

import hashlib
from pathlib import Path

from edgerun import paths
from edgerun.convert.atomic import write_bytes
from edgerun.decode.ngram import NgramPool


def default_dir() -> Path:
    """Beside the saved KV states (EDGERUN_KV_DIR moves both): decode state the cache may lose."""
    return paths.kv_dir() / "ngram"


def pool_path(model_path: Path, root: Path | None = None) -> Path:
    from edgerun.runtime.kvstate import model_identity

    digest = hashlib.sha256(model_identity(Path(model_path)).encode()).hexdigest()[:32]
    return (root or default_dir()) / f"{digest}.pool"


class PoolFile:
    """One model's pool and the file it lives in."""

    def __init__(self, model_path: Path, n_vocab: int, root: Path | None = None):
        self.path = pool_path(model_path, root)
        try:
            self.pool = NgramPool.from_bytes(self.path.read_bytes(), n_vocab)
        except OSError:
            self.pool = NgramPool()

    def remember(self, tokens: list[int]) -> str | None:
        """Add a conversation's new tokens and write the pool; the reason when it could not be
        written (the pool in memory has them either way)."""
        self.pool.add(tokens)
        try:
            write_bytes(self.path, self.pool.to_bytes())
        except OSError as e:
            return f"the n-gram pool was not saved ({e})"
        return None


def clear(root: Path | None = None) -> int:
    """Remove every model's pool; how many files went."""
    return paths.remove_matching(root or default_dir(), "*.pool")
