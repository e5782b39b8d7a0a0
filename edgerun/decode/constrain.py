"""Constrained decoding: what the output must match (a GBNF grammar, a JSON schema, any JSON
object) and the grammar state a reply decodes under (native/grammar.hpp). JSON schemas become
GBNF through llama-cpp-python's converter, with bounded numbers and JSON-legal strings added here;
a schema keyword that would constrain values but cannot be enforced is refused, never ignored."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llama_cpp import llama_grammar as lg

from edgerun import _native
from edgerun.errors import ConfigError

MAX_DIGITS = 15  # an unbounded side of a bounded number: up to 15 digits (exact in a double)
MAX_NESTING = 1000  # parenthesis depth a grammar may reach (llama.cpp's parser recurses per level)
MAX_COUNT = 1000  # the largest length or item bound a schema may set (each counted item is a nested group)
FRACTION = '("." [0-9]{1,10})?'  # a bounded number's fraction: at most 10 digits, so it cannot run away
# keywords that restrict values which the grammar does not express: refused, never silently dropped
UNENFORCED = ("multipleOf", "uniqueItems", "not", "if", "then", "else", "patternProperties", "contains",
              "dependentRequired", "dependentSchemas", "minProperties", "maxProperties", "propertyNames")
# JSON strings hold no raw control characters (json.loads refuses them); the converter's own rule allows them
CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must match. `triggers`: regexes that switch it on (lazy: the output is
    free until one matches, from its first group on); `what` names it in errors."""

    gbnf: str
    what: str = "the grammar"
    triggers: tuple[str, ...] = ()

    def start(self, ctx_address: int) -> _native.Grammar:
        """A fresh grammar state for one reply on the context's vocabulary."""
        return compile_gbnf(self.gbnf, ctx_address, self.what, self.triggers)


def compile_gbnf(gbnf: str, ctx_address: int, what: str, triggers: tuple[str, ...] = ()) -> _native.Grammar:
    """llama.cpp's parse of the grammar; its refusal becomes one ConfigError carrying llama.cpp's reason."""
    if not gbnf.strip():
        raise ConfigError(f"{what} is empty; give at least a root rule, e.g. root ::= \"yes\" | \"no\"")
    depth = _nesting(gbnf)
    if depth > MAX_NESTING:
        raise ConfigError(f"{what} nests groups {depth} deep, more than llama.cpp's parser can take"
                          f" ({MAX_NESTING}); flatten it into named rules")
    said: list[str] = []
    with _stderr_captured(said), _log_captured(said):
        try:
            return _native.Grammar(ctx_address, gbnf, "root", list(triggers))
        except ValueError:
            pass
    raise ConfigError(f"{what} does not parse ({_reason(''.join(said))}); fix it (GBNF: llama.cpp's grammars/README.md)")


def _reason(text: str) -> str:
    """llama.cpp's parse error, one line: 'parse: error parsing grammar: <why>' then the source (on
    stderr), or a log line (a left recursion, an empty rule set)."""
    for line in text.splitlines():
        if "error parsing grammar:" in line:
            return line.split("error parsing grammar:", 1)[1].strip().removesuffix(" at").strip()
    for line in text.splitlines():
        if "grammar" in line and line.strip():
            return line.strip()
    return "llama.cpp refused it: a rule that starts with itself (left recursion) is one cause"


def _nesting(gbnf: str) -> int:
    """The deepest parenthesis nesting outside literals, classes and comments: the parser recurses
    once per level, and a few thousand levels overflow its stack (a crash, not an error)."""
    depth = deepest = i = 0
    while i < len(gbnf):
        c = gbnf[i]
        if c in "\"[":  # a literal or a class: skip to its end, past escapes
            close = "\"" if c == "\"" else "]"
            i += 1
            while i < len(gbnf) and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "#":
            while i < len(gbnf) and gbnf[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


@contextlib.contextmanager
def _log_captured(said: list[str]):
    """What llama.cpp logs while it parses (a left recursion is reported there)."""
    handler = _Collect(said)
    logger = logging.getLogger("edgerun.llama")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


class _Collect(logging.Handler):
    def __init__(self, said: list[str]):
        super().__init__(logging.DEBUG)
        self.said = said

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage() + "\n")


@contextlib.contextmanager
def _stderr_captured(said: list[str]):
    """llama.cpp's grammar parser writes its errors straight to file descriptor 2 (not through its
    log): held in a file for the length of the parse, so a full-screen app is not torn and the
    CLI says one line. What was written is appended to `said`."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            said.append(sink.read().decode("utf-8", "replace"))


def gbnf(text: str, what: str = "the grammar") -> Constraint:
    return Constraint(text, what)


def read_text(value: str, flag: str) -> str:
    """A flag's FILE argument: the file's text, or one clear error."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag}: cannot read {value} ({exc.strerror if isinstance(exc, OSError) else exc});"
                          " give a readable UTF-8 file") from None


def schema_arg(value: str) -> dict:
    """`--json-schema FILE|JSON`: inline JSON when it starts like JSON, else a file's text."""
    text = value if value.lstrip().startswith(("{", "[")) or value.strip() in ("true", "false") else (
        read_text(value, "--json-schema"))
    return parse_schema(text)


def parse_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the JSON schema is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno});"
                          " fix the schema") from None
    return schema


def json_object() -> Constraint:
    """Any JSON object (OpenAI's response_format json_object)."""
    return json_schema({"type": "object"}, "the JSON object format")


def json_schema(schema, what: str = "the JSON schema") -> Constraint:
    """The grammar of the JSON texts that validate against `schema` (an object, or true for any value)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ConfigError(f"{what} must be a JSON object, not {type(schema).__name__}; e.g. {{\"type\": \"object\"}}")
    _refuse_unenforced(schema, what, "")
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        resolved = converter.resolve_refs(copy.deepcopy(schema), "input")  # it rewrites $refs in place
        converter.visit(resolved, "")
        text = converter.format_grammar()
    except ConfigError:
        raise
    except Exception as exc:  # the converter's own refusals: AssertionError, ValueError, KeyError, ...
        detail = str(exc) or type(exc).__name__
        raise ConfigError(f"{what} cannot be turned into a grammar ({detail}); simplify the schema") from None
    return Constraint(text, what)


def _refuse_unenforced(node, what: str, where: str) -> None:
    if isinstance(node, dict):
        for key in UNENFORCED:
            if key in node:
                raise ConfigError(f"{what} uses '{key}' at {where or 'the top'}, which edgerun cannot enforce"
                                  " while decoding; remove it (and check it after)")
        for key in ("minLength", "maxLength", "minItems", "maxItems"):
            value = node.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_COUNT:
                raise ConfigError(f"{what} sets {key} {value} at {where or 'the top'}; edgerun's grammar counts"
                                  f" up to {MAX_COUNT}: lower it (or drop it and check the length after)")
        kind = node.get("type")
        if kind == "number" and ("exclusiveMinimum" in node or "exclusiveMaximum" in node):
            raise ConfigError(f"{what} gives a number an exclusive bound at {where or 'the top'}; use minimum/maximum"
                              " (or an integer type)")
        for key, value in node.items():
            path = f"{where}.{key}" if where else key
            if key in ("enum", "const", "default", "examples"):
                continue
            if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                for name, sub in value.items():  # names here are the user's, not keywords
                    _refuse_unenforced(sub, what, f"{path}.{name}")
            else:
                _refuse_unenforced(value, what, path)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _refuse_unenforced(value, what, f"{where}[{i}]")


class _Converter(lg.SchemaConverter):
    """llama-cpp-python's converter, with integer and number bounds and JSON-legal string characters."""

    def _add_primitive(self, name, rule):
        if name == "char":
            rule = lg.BuiltinRule(CHAR_RULE, [])
        return super()._add_primitive(name, rule)

    def visit(self, schema, name):
        kind = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(kind, list) and "enum" not in schema and "const" not in schema:
            # each type with the schema's other keywords (the converter's own union drops them: a
            # ["string", "null"] with a maxLength would lose the bound)
            rest = {k: v for k, v in schema.items() if k != "type"}
            rule_name = name + "-" if name in lg.RESERVED_NAMES else name or "root"
            alts = [self.visit({**rest, "type": t}, f"{name}{'-' if name else ''}{t}") for t in kind]
            return self._add_rule(rule_name, " | ".join(alts))
        bounded = isinstance(schema, dict) and any(
            k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
        if kind in ("integer", "number") and bounded and "enum" not in schema and "const" not in schema:
            rule_name = name + "-" if name in lg.RESERVED_NAMES else name or "root"
            body = _integer_rule(*_int_bounds(schema)) if kind == "integer" else _number_rule(*_number_bounds(schema))
            return self._add_rule(rule_name, f"({body}) space")
        return super().visit(schema, name)


def _bound(schema: dict, key: str):
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"'{key}' must be a number, not {value!r}; fix the schema")
    return value


def _int_bounds(schema: dict) -> tuple[int, int]:
    import math

    lo, hi = -(10**MAX_DIGITS - 1), 10**MAX_DIGITS - 1
    if (v := _bound(schema, "minimum")) is not None:
        lo = max(lo, math.ceil(v))
    if (v := _bound(schema, "exclusiveMinimum")) is not None:
        lo = max(lo, math.floor(v) + 1)
    if (v := _bound(schema, "maximum")) is not None:
        hi = min(hi, math.floor(v))
    if (v := _bound(schema, "exclusiveMaximum")) is not None:
        hi = min(hi, math.ceil(v) - 1)
    if lo > hi:
        raise ConfigError(f"no integer lies between the bounds {schema.get('minimum', schema.get('exclusiveMinimum'))}"
                          f" and {schema.get('maximum', schema.get('exclusiveMaximum'))}; fix the schema")
    return lo, hi


def _number_bounds(schema: dict) -> tuple[int, int]:
    lo, hi = -(10**MAX_DIGITS - 1), 10**MAX_DIGITS - 1
    for key in ("minimum", "maximum"):
        v = _bound(schema, key)
        if v is None:
            continue
        if not float(v).is_integer():
            raise ConfigError(f"edgerun constrains a number's {key} only at a whole value (got {v});"
                              " use a whole bound, or an integer type with scaled units")
        if key == "minimum":
            lo = int(v)
        else:
            hi = int(v)
    if lo > hi:
        raise ConfigError(f"the number's minimum {lo} is above its maximum {hi}; fix the schema")
    return lo, hi


def _digits(lo: str, hi: str) -> str:
    """GBNF for the decimal strings of one length from lo to hi (inclusive)."""
    if lo == hi:
        return f'"{lo}"'
    if lo[0] == hi[0]:
        return f'"{lo[0]}" ({_digits(lo[1:], hi[1:])})'
    n = len(lo) - 1
    lo_all, hi_all = lo[1:] == "0" * n, hi[1:] == "9" * n
    first, last = int(lo[0]) + (not lo_all), int(hi[0]) - (not hi_all)
    parts = []
    if not lo_all:
        parts.append(f'"{lo[0]}" ({_digits(lo[1:], "9" * n)})')
    if first <= last:
        parts.append(f"[{first}-{last}]" + (f" [0-9]{{{n}}}" if n else ""))
    if not hi_all:
        parts.append(f'"{hi[0]}" ({_digits("0" * n, hi[1:])})')
    return " | ".join(parts)


def _natural(lo: int, hi: int) -> str:
    """GBNF for the integers lo..hi, 0 <= lo <= hi, without leading zeros."""
    parts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10**n - 1)
        if a <= b:
            parts.append(f"({_digits(str(a), str(b))})")
    return " | ".join(parts)


def _signed(lo: int, hi: int, magnitude, least_negative: int) -> str:
    """lo..hi as a minus sign over the negative magnitudes (from least_negative up) or the others."""
    parts = []
    if lo < 0:
        parts.append(f'"-" ({magnitude(max(least_negative, -hi), -lo)})')
    if hi >= 0:
        parts.append(magnitude(max(lo, 0), hi))
    return " | ".join(parts)


def _integer_rule(lo: int, hi: int) -> str:
    return _signed(lo, hi, _natural, 1)  # no "-0"


def _magnitude(a: int, b: int) -> str:
    """Decimals from a to b (0 <= a <= b, whole bounds): below b any fraction, at b only zeros."""
    at_b = f'"{b}" ("." "0"{{1,10}})?'
    return at_b if a == b else f"({_natural(a, b - 1)}) {FRACTION} | {at_b}"


def _number_rule(lo: int, hi: int) -> str:
    return _signed(lo, hi, _magnitude, 0)  # "-0.5" is a negative below 1
