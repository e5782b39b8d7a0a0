"""The catalog file is well-formed and says what ARCHITECTURE.md promises."""

import pytest

from edgerun.errors import UnknownModel
from edgerun.models import catalog


def test_shipped_catalog_entries():
    cat = catalog.load()
    names = {e.name for e in cat.entries}
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m"} <= names
    target = cat.get(cat.default_target)
    assert target.role == "target" and cat.get(target.draft).role == "draft"
    for e in cat.entries:
        assert len(e.sha256) == 64 and e.size > 0 and e.sources
        assert e.sources[-1].kind == "mirror"  # the offline source is always the last resort
        for s in e.sources:
            assert s.kind in ("hub", "mirror")
            assert (s.repo and s.file) if s.kind == "hub" else all("==" in p for p in s.packages)


def test_defaults_are_target_then_draft():
    assert [e.name for e in catalog.load().defaults] == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]


def test_unknown_name_lists_known_ones():
    with pytest.raises(UnknownModel, match="qwen2.5-coder-0.5b"):
        catalog.load().get("nope")
