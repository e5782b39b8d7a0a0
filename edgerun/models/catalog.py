"""The model catalog (models.toml): names, exact files, and where each can be fetched."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from edgerun.errors import ConfigError, UnknownModel

# A name or file becomes one path component under the models folder (and `rm` deletes it), so it
# must stay one: no separator, no "..", nothing absolute.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
# the shape huggingface_hub's validate_repo_id accepts (checked here without importing it: every
# command loads the catalog, few talk to the hub)
_REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# pip gets these as arguments: a pinned requirement, never something that reads as an option
_PINNED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*")


@dataclass(frozen=True)
class Source:
    kind: str  # "hub" | "mirror"
    repo: str = ""
    file: str = ""
    packages: tuple[str, ...] = ()
    revision: str | None = None  # hub: the commit the file is pinned to (40 hex), None = main

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hub {self.repo}/{self.file}"
        return f"package index ({len(self.packages)} chunk packages)"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    role: str
    arch: str
    description: str
    file: str
    size: int
    sha256: str
    sources: tuple[Source, ...]
    draft: str | None = None
    template: str = ""


@dataclass(frozen=True)
class Catalog:
    entries: tuple[CatalogEntry, ...]
    default_target: str

    def get(self, name: str) -> CatalogEntry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        known = ", ".join(e.name for e in self.entries)
        raise UnknownModel(
            f"unknown model '{name}': not in the catalog ({known}), not a file, not an hf:// URI"
        )

    def find(self, name: str) -> CatalogEntry | None:
        return next((e for e in self.entries if e.name == name), None)

    @property
    def defaults(self) -> tuple[CatalogEntry, ...]:
        """The default target and its recommended draft: what setup fetches."""
        target = self.get(self.default_target)
        return (target, self.get(target.draft)) if target.draft else (target,)


def _catalog_text() -> str:
    packaged = resources.files("edgerun").joinpath("models.toml")
    if packaged.is_file():
        return packaged.read_text()
    # editable install: the catalog lives at the repository root, beside pyproject.toml
    return (Path(__file__).resolve().parents[2] / "models.toml").read_text()


def _bad(where: str, what: str) -> ConfigError:
    return ConfigError(f"models.toml: {where}: {what}; fix the catalog entry")


def _plain(value: object, where: str, field: str) -> str:
    if not isinstance(value, str) or not _PLAIN_NAME.fullmatch(value) or ".." in value:
        raise _bad(where, f"{field} {value!r} must be a plain file name (letters, digits, . _ + -;"
                          " no path separator, no '..', not absolute)")
    return value


def _source(s: dict, where: str) -> Source:
    kind = s.get("kind")
    if kind == "hub":
        repo, file, revision = s.get("repo", ""), s.get("file", ""), s.get("revision")
        if not _REPO.fullmatch(repo) or ".." in repo or "--" in repo:
            raise _bad(where, f"hub repo {repo!r} is not a valid org/name")
        if not file or file.startswith("/") or ".." in file.split("/"):
            raise _bad(where, f"hub file {file!r} must be a relative path inside the repo")
        if revision is not None and not (isinstance(revision, str) and _COMMIT.fullmatch(revision)):
            raise _bad(where, f"hub revision {revision!r} must be a commit sha (40 hex digits)")
        return Source(kind=kind, repo=repo, file=file, revision=revision)
    if kind == "mirror":
        packages = tuple(s.get("packages", ()))
        if not packages or not all(isinstance(p, str) and _PINNED.fullmatch(p) for p in packages):
            raise _bad(where, f"mirror packages {list(packages)!r} must each be a pinned name==version")
        return Source(kind=kind, packages=packages)
    raise _bad(where, f"source kind {kind!r} must be 'hub' or 'mirror'")


def _entry(m: dict) -> CatalogEntry:
    name = _plain(m.get("name"), f"model {m.get('name')!r}", "name")
    where = f"model '{name}'"
    sha, size = str(m.get("sha256", "")).lower(), m.get("size")
    if not _SHA256.fullmatch(sha):
        raise _bad(where, f"sha256 {m.get('sha256')!r} must be 64 hex digits")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise _bad(where, f"size {size!r} must be a positive number of bytes")
    try:
        return CatalogEntry(
            name=name,
            role=m["role"],
            arch=m["arch"],
            description=m.get("description", ""),
            file=_plain(m.get("file"), where, "file"),
            size=size,
            sha256=sha,
            sources=tuple(_source(s, where) for s in m.get("source", ())),
            draft=m.get("draft"),
            template=m.get("template", ""),
        )
    except KeyError as exc:
        raise _bad(where, f"{exc.args[0]} is missing") from None


def parse(text: str) -> Catalog:
    """models.toml text -> a Catalog, every entry validated (ConfigError names what is wrong)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"models.toml is not valid TOML ({exc}); fix the catalog") from None
    entries = tuple(_entry(m) for m in data.get("model", ()))
    names = [e.name for e in entries]
    if len(set(names)) != len(names) or len({e.file for e in entries}) != len(entries):
        raise ConfigError("models.toml: two entries share a name or a file; fix the catalog")
    if data.get("default_target") not in names:
        raise ConfigError(f"models.toml: default_target {data.get('default_target')!r} is no entry")
    return Catalog(entries=entries, default_target=data["default_target"])


@lru_cache(maxsize=1)
def load() -> Catalog:
    return parse(_catalog_text())
