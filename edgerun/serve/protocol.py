"""The OpenAI request bodies the server accepts (pydantic models) and its error shape.

Fields edgerun does not act on but that clients send routinely (user, presence and frequency
penalties at 0, logprobs false, n = 1) are accepted; ones that would change the answer in a way
edgerun cannot honour are refused with a 400 naming the field, rather than silently ignored."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edgerun.settings import SamplerSettings
from edgerun.user_settings import TOP_K_MAX

SEED_MAX = 2**64 - 1  # the native RNG's seed is 64 bits
MAX_STOPS = 4  # as OpenAI allows
_DEFAULT = SamplerSettings()


class APIError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json(cls, text: str) -> str:
        try:
            json.loads(text)
        except ValueError:
            raise ValueError(f"a tool call's arguments must be JSON text, not {text[:40]!r}") from None
        return text


class ToolCall(_Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            # templates (Qwen2.5's) write the arguments with tojson: they want the object, not its text
            out["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class Function(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function

    def for_template(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=TOP_K_MAX)  # llama-server's extensions
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    presence_penalty: float = Field(0, ge=-2, le=2)
    frequency_penalty: float = Field(0, ge=-2, le=2)
    logprobs: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (use repeat_penalty, llama.cpp's repetition penalty)")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def sampling(self) -> SamplerSettings:
        return _DEFAULT.replace(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                min_p=self.min_p, repeat_penalty=self.repeat_penalty, seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    response_format: dict | None = None

    @model_validator(mode="after")
    def _tools(self):
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            if self.tool_choice.get("type") != "function" or not isinstance(name, str):
                raise ValueError('tool_choice must be "none", "auto", "required" or'
                                 ' {"type": "function", "function": {"name": ...}}')
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.tools and self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("give tools or a response_format, not both")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request")
            value = value[0]
        return value

    @model_validator(mode="after")
    def _not_supported(self):
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not supported")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_tokens


def parse(model: type[_Sampling], body: object) -> _Sampling:
    """The request, or an APIError 400 that names the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{where}: {message}" if where else message, param=where or None,
                       code="invalid_value") from None
