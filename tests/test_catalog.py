"""The catalog file is well-formed and says what ARCHITECTURE.md promises."""

import json

import pytest

from edgerun.errors import ConfigError, UnknownModel
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
            assert s.revision is None or len(s.revision) == 40


def test_defaults_are_target_then_draft():
    assert [e.name for e in catalog.load().defaults] == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]


def test_unknown_name_lists_known_ones():
    with pytest.raises(UnknownModel, match="qwen2.5-coder-0.5b"):
        catalog.load().get("nope")


def _toml(name="m", file="m.gguf", source='kind = "mirror"\npackages = ["m-part1==1.0"]', sha="ab" * 32) -> str:
    return f"""default_target = {json.dumps(name)}
[[model]]
name = {json.dumps(name)}
role = "target"
arch = "llama"
file = {json.dumps(file)}
size = 10
sha256 = "{sha}"
[[model.source]]
{source}
"""


def test_a_well_formed_entry_parses():
    hub = f'kind = "hub"\nrepo = "org/repo"\nfile = "sub/m.gguf"\nrevision = "{"0a" * 20}"'
    entry = catalog.parse(_toml(source=hub)).get("m")
    assert (entry.file, entry.sources[0].repo, entry.sources[0].revision) == ("m.gguf", "org/repo", "0a" * 20)


@pytest.mark.parametrize("field", ["name", "file"])
@pytest.mark.parametrize("value", ["../m.gguf", "..", "/etc/passwd", "sub/m.gguf", "sub\\m.gguf", ".", "", ".hidden"])
def test_names_and_files_that_could_leave_the_models_folder_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"models.toml: .*{field} .* must be a plain file name"):
        catalog.parse(_toml(**{field: value}))


@pytest.mark.parametrize(
    ("source", "complaint"),
    [
        ('kind = "hub"\nrepo = "org/repo"\nfile = "m.gguf"\nrevision = "main"', "must be a commit sha"),
        ('kind = "hub"\nrepo = "org/repo"\nfile = "m.gguf"\nrevision = "ABC"', "must be a commit sha"),
        ('kind = "hub"\nrepo = "../repo"\nfile = "m.gguf"', "not a valid org/name"),
        ('kind = "hub"\nrepo = "org/repo"\nfile = "../../m.gguf"', "relative path inside the repo"),
        ('kind = "mirror"\npackages = ["--index-url=http://evil.example/"]', "pinned name==version"),
        ('kind = "mirror"\npackages = []', "pinned name==version"),
        ('kind = "ftp"', "must be 'hub' or 'mirror'"),
    ],
)
def test_sources_are_validated(source, complaint):
    with pytest.raises(ConfigError, match=complaint):
        catalog.parse(_toml(source=source))


def test_a_bad_hash_or_a_missing_field_is_one_clear_error():
    with pytest.raises(ConfigError, match="sha256 .* must be 64 hex digits"):
        catalog.parse(_toml(sha="xyz"))
    with pytest.raises(ConfigError, match="model 'm': role is missing"):
        catalog.parse(_toml().replace('role = "target"\n', ""))


def test_two_entries_for_one_file_or_a_missing_default_are_refused():
    one = _toml()
    twice = one + one[one.index("[[model]]"):].replace('name = "m"', 'name = "n"')
    with pytest.raises(ConfigError, match="two entries share a name or a file"):
        catalog.parse(twice)
    with pytest.raises(ConfigError, match="default_target 'x' is no entry"):
        catalog.parse(one.replace('default_target = "m"', 'default_target = "x"'))
