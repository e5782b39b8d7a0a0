"""Render a model's chat template. The template comes from an untrusted file, so it runs only in
Jinja's immutable sandbox: no attribute access to Python internals, no mutation of our objects."""

from __future__ import annotations

from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgerun.errors import InvalidModelFile

# Used when a GGUF carries no template: plain ChatML, which most instruct models understand.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str):
    raise TemplateError(message)


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


def _tojson(value, indent=None, ensure_ascii=False, **_):
    import json

    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def render(template: str | None, messages: list[dict], *, bos: str = "", eos: str = "") -> str:
    """The prompt text for `messages`, ending with the assistant's turn opened."""
    try:
        tmpl = _env().from_string(template or CHATML)
        return tmpl.render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    except TemplateError as exc:
        raise InvalidModelFile(f"the model's chat template failed ({exc}); use --raw to skip it") from None
