"""Models made here (`edgerun convert`, the chat app's Convert…): a registry beside the catalog,
so a converted model is picked by name like a catalog one, and `edgerun list` says where it came
from and how good it is.

The registry is one JSON file in the data folder (<data>/local_models.json), rewritten atomically
under an exclusive lock, so two edgerun processes registering at once both land. It holds, per
model: its name, the GGUF's path, its origin (what was converted), when, and the report's summary
(size, bpw, mean KLD, top-1, perplexities) with the paths of the full report and plot."""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator

from edgerun import paths
from edgerun.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,79}")


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: str
    origin: str
    created: float
    summary: dict = field(default_factory=dict)  # report.SUMMARY_KEYS (None where not measured)
    report_path: str | None = None
    plot_path: str | None = None

    def describe(self) -> str:
        """One line: size, bpw and quality against the source."""
        s = self.summary
        parts = [f"{s['size_bytes'] / 1e6:,.1f} MB" if s.get("size_bytes") else "size ?",
                 f"{s['bpw']:.2f} bpw" if s.get("bpw") else ""]
        if s.get("kld_mean") is not None:
            parts += [f"KLD {s['kld_mean']:.4f}", f"top-1 {s['top1_agreement']:.1%}",
                      f"PPL {s['ppl']:.2f} (F16 {s['ppl_ref']:.2f})"]
        return ", ".join(p for p in parts if p)


def registry_path() -> Path:
    return paths.data_dir() / "local_models.json"


def check_name(name: str) -> str:
    """A name for a converted model: one plain file-name part, not a catalog model's."""
    from edgerun.models import catalog

    if not _NAME.fullmatch(name or "") or ".." in name or name.endswith(".gguf"):
        raise ConfigError(f"model name {name!r}: use letters, digits and . _ + - (up to 80, no .gguf),"
                          " e.g. qwen2.5-coder-1.5b-3bpw")
    if catalog.load().find(name) is not None:
        raise ConfigError(f"{name} is a catalog model's name; pick another")
    return name


def default_output(name: str) -> Path:
    """Where a converted model named NAME is written when no path is given."""
    return paths.models_dir() / f"{check_name(name)}.gguf"


def load() -> list[LocalModel]:
    """The registered models whose file still exists (a deleted file drops out)."""
    return [m for m in _read() if Path(m.path).is_file()]


def find(name: str) -> LocalModel | None:
    return next((m for m in load() if m.name == name), None)


def present() -> list[tuple[str, Path]]:
    """(name, GGUF) of every model here: the pulled catalog models, then those converted here."""
    from edgerun.models import catalog, fetch

    pulled = [(e.name, fetch.local_file(e)) for e in catalog.load().entries if fetch.is_present(e)]
    return pulled + [(m.name, Path(m.path)) for m in load()]


def register(name: str, gguf: Path, *, origin: str, report: dict, report_path: Path | None = None,
             plot_path: Path | None = None) -> LocalModel:
    """Add (or replace) NAME -> GGUF with its origin and report (report.Report.to_json())."""
    from edgerun.convert.report import summary

    check_name(name)
    model = LocalModel(name=name, path=str(Path(gguf).resolve()), origin=origin, created=time.time(),
                       summary=summary(report),
                       report_path=str(report_path) if report_path else None,
                       plot_path=str(plot_path) if plot_path else None)
    with _locked():
        models = [m for m in _read() if m.name != name] + [model]
        _write(models)
    return model


def remove(name: str) -> tuple[LocalModel, list[Path]] | None:
    """Forget NAME and delete the files it names (the GGUF, its report and plot) that lie inside
    edgerun's own folders; returns the model and the files kept because they lie elsewhere (a
    convert's -o chose them: the user's), or None when no converted model has that name."""
    with _locked():
        models = _read()
        gone = next((m for m in models if m.name == name), None)
        if gone is None:
            return None
        _write([m for m in models if m.name != name])
    ours = [d.resolve() for d in (paths.models_dir(), paths.data_dir(), paths.cache_dir())]
    kept = []
    for path in (Path(p) for p in (gone.path, gone.report_path, gone.plot_path) if p):
        if any(path.resolve().is_relative_to(d) for d in ours):
            path.unlink(missing_ok=True)
        elif path.exists():
            kept.append(path)
    return gone, kept


def _read() -> list[LocalModel]:
    path = registry_path()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in fields(LocalModel)}  # keys an older or later edgerun wrote are skipped
        return [LocalModel(**{k: v for k, v in m.items() if k in known}) for m in doc["models"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path}: unreadable registry of converted models ({e}); move it away and "
                          "convert again or re-register") from None


def _write(models: list[LocalModel]) -> None:
    from edgerun.convert.atomic import atomic_path

    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"models": [asdict(m) for m in models]}, indent=1) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Exclusive across processes for a read-modify-write of the registry."""
    lock = registry_path().with_name(".local_models.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
