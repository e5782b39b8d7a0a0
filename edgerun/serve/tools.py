"""Tool calls in the model's own format, and OpenAI's response_format, as constraints.

Qwen2.5's chat template (and the Hermes format it follows) tells the model to answer a call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. The grammar here admits exactly
that for the request's tools, with each tool's arguments following its parameters' JSON schema:
from the first token for tool_choice "required" or a named function, and from the moment the
model writes `<tool_call>` for "auto" (a lazy grammar: the reply is free text until then). Under
"auto" the Qwen2.5 coder models often open their reply with the call itself instead, bare or in a
```json fence (the 0.5B and the 1.5B both do on a plain weather question); llama.cpp's own Hermes
parser takes those openings too, and so do the trigger and CallParser here. CallParser turns the
reply's text back into content and OpenAI tool calls, as it streams."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from edgerun.decode import constrain
from edgerun.decode.constrain import Constraint
from edgerun.errors import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# llama.cpp searches the whole output so far for a lazy grammar's trigger after every token (an
# unanchored pattern: std::regex_search), and the grammar takes the text from the first group on. A
# bare literal keeps each search linear in the output; one wrapped in [\s\S]*? ... [\s\S]* backtracks
# from every start, quadratic per token (142 ms a token by the 1,000th token of a free reply).
TRIGGER = r"(<tool_call>)"
# a reply that opens with a call without the tags: anchored at the reply's start, so as cheap
_FENCE = r'\s*(?:```(?:json)?\s*)?'  # what may come before a bare call's brace
BARE_TRIGGER = rf'^{_FENCE}(\{{\s*"name")'
_BARE = re.compile(rf'{_FENCE}(\{{\s*"name"\s*:\s*"([^"\\]*)")')


def supports_tools(template: str | None) -> bool:
    """Whether the model's chat template speaks the <tool_call> format."""
    return bool(template) and OPEN in template


def tool_constraint(tools: list[dict], choice, parallel: bool = True) -> Constraint | None:
    """The grammar of the reply for these tools and tool_choice ("none", "auto", "required" or
    {"type": "function", "function": {"name": ...}}); None when the reply is free text."""
    if choice == "none":
        return None
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name")
        if name not in by_name:
            raise ConfigError(f"tool_choice names '{name}', which is not among the tools; name one of"
                              f" {', '.join(by_name)}")
        by_name = {name: by_name[name]}
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                               "arguments": fn.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"]} for name, fn in by_name.items()]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    body = constrain.json_schema(schema, "a tool's parameters").gbnf
    # the converter's root is one call's JSON; the reply is one call or more, each in its tags (the
    # rule's line renamed: a literal may hold the same text, but never at a line's start)
    body = re.sub(r"^root ::= ", "call-json ::= ", body, count=1, flags=re.MULTILINE)
    # a bare call is written before the grammar takes over (its trigger needs `{"name"`), and the
    # models lay a call out on lines: the spacing between tokens is llama.cpp's own converter's
    body = re.sub(r"^space ::= .*$", lambda _: r'space ::= | " " | "\n" [ \t]{0,20}', body, count=1, flags=re.MULTILINE)
    many = ' ("\\n" call)*' if parallel and not isinstance(choice, dict) else ""
    lazy = choice == "auto" or choice is None
    bare = " | call-json" if lazy else ""  # what BARE_TRIGGER hands over: the call's JSON from its brace
    gbnf = (f'root ::= call{many}{bare}\ncall ::= "{OPEN}\\n" call-json "\\n{CLOSE}"\n' + body)
    return Constraint(gbnf, "the tools' grammar", (TRIGGER, BARE_TRIGGER) if lazy else ())


def response_constraint(response_format: dict | None) -> Constraint | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return constrain.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConfigError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return constrain.json_schema(spec["schema"], "response_format's schema")
    raise ConfigError(f"response_format type '{kind}' is not one of text, json_object, json_schema")


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


class CallParser:
    """The reply's text, fed as it streams, split into content and tool calls. Text that might be the
    start of a `<tool_call>` tag is held until it is known; a call's arguments stream once its name
    is read, and end where their JSON object does. A reply that opens with a call to one of `names`
    without the tags (bare or in a ```json fence) is that call: its opening is held until known."""

    def __init__(self, names=()):
        self.buf = ""
        self.names = set(names)
        self.calls: list[dict] = []  # {"id", "name", "arguments"} in order
        self._in_call = False
        self._bare = False  # the call has no tags: it ends where its JSON object does
        self._opening = bool(self.names)  # the reply's start, until known to be a bare call or not
        self._args_from: int | None = None  # where the arguments start in buf
        self._sent = 0  # argument characters streamed

    def feed(self, text: str) -> list[Content | CallStart | CallArgs]:
        self.buf += text
        out: list[Content | CallStart | CallArgs] = []
        if self._opening:
            bare = _BARE.match(self.buf)
            if bare and bare.group(2) in self.names:
                self.buf, self._in_call, self._bare = self.buf[bare.start(1):], True, True
                self._opening = False
            elif not bare and _could_open(self.buf):
                return out
            else:
                self._opening = False
        while True:
            if not self._in_call:
                at = self.buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buf, OPEN)
                    free = self.buf[: len(self.buf) - keep]
                    if free and not self.calls:  # after a call only separators follow
                        out.append(Content(free))
                    self.buf = self.buf[len(free):]
                    return out
                if at and not self.calls:
                    out.append(Content(self.buf[:at]))
                self.buf, self._in_call, self._args_from, self._sent = self.buf[at + len(OPEN):], True, None, 0
            if not self._call_step(out):
                return out

    def _call_step(self, out: list) -> bool:
        """Advance inside a call; True when the call ended (the buffer holds what follows it)."""
        index = len(self.calls)
        if self._args_from is None:
            head = self.buf.find('"arguments"')
            colon = self.buf.find(":", head) if head >= 0 else -1
            if colon < 0:
                return False
            name = _name_of(self.buf[:head])
            self.calls.append({"id": "call_" + uuid.uuid4().hex[:24], "name": name, "arguments": ""})
            out.append(CallStart(index, self.calls[-1]["id"], name))
            self._args_from = colon + 1
        call = self.calls[-1]
        text = self.buf[self._args_from:].lstrip()
        try:
            _, end = json.JSONDecoder().raw_decode(text)
        except ValueError:
            end = None
        if end is None:
            if len(text) > self._sent:
                out.append(CallArgs(len(self.calls) - 1, text[self._sent:]))
                call["arguments"] += text[self._sent:]
                self._sent = len(text)
            return False
        if end > self._sent:
            out.append(CallArgs(len(self.calls) - 1, text[self._sent:end]))
            call["arguments"] += text[self._sent:end]
        tag = "}" if self._bare else CLOSE  # a bare call ends with the brace around name and arguments
        at = len(self.buf) - len(text) + end  # the arguments' end in buf
        close = self.buf.find(tag, at)
        if close < 0:
            self._sent = end
            return False
        self.buf, self._in_call = self.buf[close + len(tag):], False
        return True

    def finish(self) -> list[Content]:
        """The reply ended: text held back as a possible tag start is content after all."""
        tail, self.buf = self.buf, ""
        return [Content(tail)] if tail and not self._in_call and not self.calls else []


def _could_open(text: str) -> bool:
    """Whether more text could make this reply's start a bare call's opening (_BARE)."""
    t = text.lstrip()
    if "```json".startswith(t):
        return True
    fence = next((f for f in ("```json", "```") if t.startswith(f)), "")
    body = t[len(fence):].lstrip()
    if not body:
        return True
    if body[0] != "{":
        return False
    key = body[1:].lstrip()
    if '"name"'.startswith(key):
        return True
    if not key.startswith('"name"'):
        return False
    rest = key[len('"name"'):].lstrip()
    if not rest:
        return True
    if rest[0] != ":":
        return False
    value = rest[1:].lstrip()
    return not value or (value[0] == '"' and '"' not in value[1:])


def _name_of(head: str) -> str:
    """The call's name from `{"name": "x", ` (the grammar wrote it; a free reply may not have)."""
    try:
        return json.loads(head.strip().rstrip(",") + "}")["name"]
    except (ValueError, KeyError, TypeError):
        return ""


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of text could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_reply(text: str, names=()) -> tuple[str, list[dict]]:
    """A whole reply as (content, tool calls)."""
    parser = CallParser(names)
    parts = [e.text for e in parser.feed(text) + parser.finish() if isinstance(e, Content)]
    return "".join(parts), parser.calls
