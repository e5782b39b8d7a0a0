"""The model catalog (models.toml): names, exact files, and where each can be fetched."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from edgerun.errors import UnknownModel


@dataclass(frozen=True)
class Source:
    kind: str  # "hub" | "mirror"
    repo: str = ""
    file: str = ""
    packages: tuple[str, ...] = ()

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


def parse(text: str) -> Catalog:
    data = tomllib.loads(text)
    entries = []
    for m in data["model"]:
        sources = tuple(
            Source(
                kind=s["kind"],
                repo=s.get("repo", ""),
                file=s.get("file", ""),
                packages=tuple(s.get("packages", ())),
            )
            for s in m.get("source", ())
        )
        entries.append(
            CatalogEntry(
                name=m["name"],
                role=m["role"],
                arch=m["arch"],
                description=m.get("description", ""),
                file=m["file"],
                size=int(m["size"]),
                sha256=m["sha256"].lower(),
                sources=sources,
                draft=m.get("draft"),
                template=m.get("template", ""),
            )
        )
    return Catalog(entries=tuple(entries), default_target=data["default_target"])


@lru_cache(maxsize=1)
def load() -> Catalog:
    return parse(_catalog_text())
