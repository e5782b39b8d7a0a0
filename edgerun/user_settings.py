"""The chat settings a user saved, as flat TOML in the config dir. Defaults come from
edgerun.settings; a bad value falls back to its default with a warning rather than failing."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgerun import paths, settings

_SAMPLER = settings.SamplerSettings()
TOP_K_MAX = 2**31 - 1  # the native sampler takes top-k as a 32-bit int
SPEC_K, NGRAM, SHOW_DRAFT_MARKS = settings.SPEC_K, settings.NGRAM, settings.SHOW_DRAFT_MARKS


@dataclass(frozen=True)
class UserSettings:
    temperature: float = _SAMPLER.temperature
    top_p: float = _SAMPLER.top_p
    top_k: int = _SAMPLER.top_k
    max_tokens: int = settings.MAX_TOKENS
    system_prompt: str | None = settings.DEFAULT_SYSTEM_PROMPT  # None: the model's template decides
    draft: str = settings.DRAFT  # "auto", "none" or a model name
    spec_k: str | int = SPEC_K  # "auto" (the governor decides) or a fixed draft length
    ngram: bool = NGRAM
    ngram_pool: bool = settings.NGRAM_POOL  # the n-gram drafter also drafts from earlier conversations
    show_draft_marks: bool = SHOW_DRAFT_MARKS
    last_model: str | None = None
    kv_cache_gib: float = settings.KV_CACHE_GIB  # saved KV states' cap; 0 saves none

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * 2**30)

    def replace(self, **changes: Any) -> UserSettings:
        return dataclasses.replace(self, **changes)

    @property
    def sampling(self) -> settings.SamplerSettings:
        return _SAMPLER.replace(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    @property
    def spec_k_value(self) -> int | None:
        """The fixed draft length, or None when the governor decides."""
        return None if self.spec_k == "auto" else int(self.spec_k)


@dataclass(frozen=True)
class Overrides:
    """Settings given on the command line. For this run they win over the saved ones; they are
    never saved. `saved`: UserSettings fields; `sampling`: SamplerSettings fields that have no
    saved setting (min_p, repeat_penalty, seed)."""

    saved: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)

    def apply(self, user: UserSettings) -> UserSettings:
        return user.replace(**self.saved)

    def sampling_for(self, user: UserSettings) -> settings.SamplerSettings:
        return self.apply(user).sampling.replace(**self.sampling)

    def without(self, keys: set[str]) -> Overrides:
        """These overrides less the saved settings in `keys` (ones the user has since changed)."""
        return Overrides({k: v for k, v in self.saved.items() if k not in keys}, self.sampling)

    def describe(self) -> str:
        """e.g. "command line: temp 0.2, ngram"; "" when nothing is overridden."""
        parts = []
        for key, value in (self.saved | self.sampling).items():
            name = _FLAG_NAMES.get(key, key.replace("_", "-"))
            if isinstance(value, bool):
                parts.append(name if value else f"no-{name}")
            elif key == "system_prompt":  # a prompt can be long: the status line names it only
                parts.append(name)
            else:
                parts.append(f"{name} {'default' if value is None else value}")
        return f"command line: {', '.join(parts)}" if parts else ""


_FLAG_NAMES = {"temperature": "temp", "system_prompt": "system", "max_tokens": "max-tokens"}


def _number(v: object) -> bool:
    # bool is an int subclass, and TOML's inf/nan are floats: neither is a usable setting
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _name(v: object) -> bool:
    return isinstance(v, str) and v.strip() != ""


# key -> (is this value usable, what a usable value looks like). One entry per field.
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _whole(v) and 0 <= v <= TOP_K_MAX, f"a whole number from 0 to {TOP_K_MAX}"),
    "max_tokens": (lambda v: _whole(v) and v > 0, "a whole number > 0"),
    "system_prompt": (lambda v: isinstance(v, str), "text"),
    "draft": (_name, '"auto", "none" or a model name'),
    "spec_k": (lambda v: v == "auto" or (_whole(v) and v >= 0), '"auto" or a whole number >= 0'),
    "ngram": (lambda v: isinstance(v, bool), "true or false"),
    "ngram_pool": (lambda v: isinstance(v, bool), "true or false"),
    "show_draft_marks": (lambda v: isinstance(v, bool), "true or false"),
    "last_model": (_name, "a model name"),
    "kv_cache_gib": (lambda v: _number(v) and v >= 0, "a number of GiB >= 0"),
}
_FLOATS = {"temperature", "top_p", "kv_cache_gib"}  # TOML reads `temperature = 1` as an int


def default_path() -> Path:
    return paths.config_dir() / "settings.toml"


def from_dict(data: dict[str, Any]) -> tuple[UserSettings, list[str]]:
    """Settings from raw key/values: unknown keys are ignored (a newer edgerun may have written
    them), a bad value keeps its default and adds a warning."""
    defaults, values, warnings = UserSettings(), {}, []
    for key, (ok, expected) in _CHECKS.items():
        if key not in data:
            continue
        value = data[key]
        if ok(value):
            values[key] = float(value) if key in _FLOATS else value
        else:
            warnings.append(f"{key} = {value!r} is not {expected}; "
                            f"using the default {getattr(defaults, key)!r}")
    return defaults.replace(**values), warnings


def load(path: Path | None = None) -> tuple[UserSettings, list[str]]:
    """The saved settings and what was wrong with them. A missing file is the defaults; an
    unreadable one is the defaults plus a warning (settings are never worth refusing to start)."""
    path = path or default_path()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return UserSettings(), []
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return UserSettings(), [f"cannot read {path} ({e}); using the defaults (saving will replace it)"]
    settings_, warnings = from_dict(data)
    return settings_, [f"{path}: {w}" for w in warnings]


def save(user: UserSettings, path: Path | None = None) -> Path:
    """Write atomically: a crash mid-write leaves the old file, never half of the new one."""
    _, problems = from_dict(_present(user))
    if problems:
        raise ValueError(f"refusing to save invalid settings: {'; '.join(problems)}")
    path = path or default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dumps(user))
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the rename makes it current
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def dumps(user: UserSettings) -> str:
    """Flat TOML, one `key = value` per set field (TOML has no null, so None is left out)."""
    lines = ["# edgerun chat settings, rewritten by the app (comments here are not kept)"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in _present(user).items()]
    return "\n".join(lines) + "\n"


def _present(user: UserSettings) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(user).items() if v is not None}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr of a finite float is a valid TOML float (0.7, 1e-05)
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    raise TypeError(f"no TOML form for {type(value).__name__}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _toml_char(c: str) -> str:
    # a basic string may not hold raw control characters (U+0000-U+001F, U+007F)
    if c in _ESCAPES:
        return _ESCAPES[c]
    return f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c


_FORM_TYPES: dict[str, Callable[[str], Any]] = {
    "temperature": float, "top_p": float, "top_k": int, "max_tokens": int,
    "spec_k": lambda v: v if v == "auto" else int(v),
}


def from_form(current: UserSettings, form: dict[str, Any]) -> tuple[UserSettings, list[str]]:
    """Settings from a form's text fields; problems name each field that did not parse or fit."""
    data = dataclasses.asdict(current)
    problems = []
    for key, raw in form.items():
        if key == "system":
            data["system_prompt"] = raw.strip() or None
        elif key in _FORM_TYPES:
            try:
                data[key] = _FORM_TYPES[key](str(raw).strip())
            except ValueError:
                problems.append(f"{key.replace('_', ' ')}: '{raw}' is not {_CHECKS[key][1]}")
        else:
            data[key] = raw
    user, warnings = from_dict({k: v for k, v in data.items() if v is not None})
    return user, problems + warnings
