"""Is a draft usable for a target? Only with the same vocabulary, token for token."""

from __future__ import annotations

from pathlib import Path

from edgerun.errors import VocabMismatch
from edgerun.runtime.engine import Model


def mismatch(target: Model, draft: Model) -> str | None:
    """The first difference between two vocabularies, in words; None when they are the same."""
    if target.vocab_type != draft.vocab_type:
        return f"vocab type {target.vocab_type} vs {draft.vocab_type}"
    if target.n_vocab != draft.n_vocab:
        return f"vocab size {target.n_vocab} vs {draft.n_vocab}"
    for name in ("bos", "eos", "eot"):
        a, b = getattr(target, name), getattr(draft, name)
        if a != b:
            return f"{name.upper()} token id {a} vs {b}"
    for i in range(target.n_vocab):
        a, b = target.token_text(i), draft.token_text(i)
        if a != b:
            return f"token {i} is {a.decode(errors='replace')!r} vs {b.decode(errors='replace')!r}"
    return None


def check_pair(target_path: Path, draft_path: Path) -> None:
    """Refuse a draft whose vocabulary differs, before either model's weights are loaded."""
    with Model(target_path, vocab_only=True) as t, Model(draft_path, vocab_only=True) as d:
        why = mismatch(t, d)
    if why:
        raise VocabMismatch(
            f"draft {draft_path.name} does not share {target_path.name}'s vocabulary ({why});"
            " pick a draft from the same model family or use --draft none"
        )
