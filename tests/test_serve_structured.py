"""Structured output through `edgerun serve` with the official `openai` client: response_format
json_object / json_schema on the tiny model, tools (calls, streamed call deltas, tool results
through the template) on the 0.5B, whose Qwen2.5 template renders tools; and the call parser."""

import json

import jsonschema
import openai
import pytest

from edgerun.runner import Runner
from edgerun.serve import tools as toolcalls
from edgerun.settings import EngineSettings
from testkit import serve

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"type": "string", "maxLength": 40}}, "required": ["tz"]}}}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    with serve.running(tiny_model, "--parallel", "2", "--ctx", "1024", "--threads", "1") as s:
        yield serve.client(s.url)


def _ask(client, content, **kw):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, **{"messages": [{"role": "user", "content": content}],
                                                          "temperature": 0, "max_tokens": 120} | kw)


def test_json_schema_replies_validate_whole_and_streamed(tiny):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = _ask(tiny, "a person", response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in _ask(tiny, "a person", response_format=fmt,
                                                                      stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content
    hot = _ask(tiny, "a person", response_format=fmt, temperature=1.0, seed=4)
    jsonschema.validate(json.loads(hot.choices[0].message.content), PERSON)


def test_json_object_replies_are_objects(tiny):
    reply = _ask(tiny, "anything", response_format={"type": "json_object"}, max_tokens=200)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # a random model may write a long object; what it wrote is still one, cut off
        assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("kw, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                        "minimum": 9, "maximum": 1}}}},
     "no integer"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                        "uniqueItems": True}}}},
     "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "yaml"}}, "yaml"),
    ({"tools": [WEATHER]}, "tool-call format"),  # the tiny model's template renders no tools
    ({"tool_choice": "required"}, "needs tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "must be JSON text"),
])
def test_bad_schemas_and_tool_requests_are_400(tiny, kw, needle):
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(tiny, "x", **kw)
    message = caught.value.body["message"]
    assert needle in message and "\n" not in message
    assert _ask(tiny, "x", max_tokens=2).choices  # and the server goes on


def _parse_stream(text: str, step: int, names=()):
    parser = toolcalls.CallParser(names)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    return events, parser.calls


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_call_parser_streams_content_and_calls(step):
    reply = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo {x}", "unit": "celsius"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    events, calls = _parse_stream(reply, step)
    assert "".join(e.text for e in events if isinstance(e, toolcalls.Content)) == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo {x}", "unit": "celsius"}
    for i, call in enumerate(calls):
        streamed = "".join(e.text for e in events if isinstance(e, toolcalls.CallArgs) and e.index == i)
        assert streamed == call["arguments"]
    plain, calls = _parse_stream("a < b and <tool", step)  # a partial tag is content once the reply ends
    assert "".join(e.text for e in plain) == "a < b and <tool" and calls == []


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("opening", ["", "  ", "```json\n", "```\n"])
def test_a_reply_that_opens_with_a_call_without_tags_is_that_call(step, opening):
    """Under "auto" the Qwen2.5 coder models write the call bare or in a ```json fence."""
    call = '{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo {x}", "unit": "c"}\n}'
    events, calls = _parse_stream(opening + call + ("\n```" if opening.strip() else ""), step, ["get_weather", "get_time"])
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo {x}", "unit": "c"}
    assert not [e for e in events if isinstance(e, toolcalls.Content)]
    assert "".join(e.text for e in events if isinstance(e, toolcalls.CallArgs)) == calls[0]["arguments"]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("reply", ['```python\nprint({"name": 1})\n```', '{"name": "Bob", "age": 3}', "``` is a fence",
                                   '{"name"', "{ not json", "`"])
def test_text_that_only_looks_like_a_call_stays_content(step, reply):
    events, calls = _parse_stream(reply, step, ["get_weather"])
    assert calls == [] and "".join(e.text for e in events) == reply


def test_auto_tools_leave_the_reply_free_until_the_tag_then_admit_only_a_call(tiny_model):
    """tool_choice auto: llama.cpp's lazy grammar, triggered by the tag written out piece by piece."""
    with Runner(tiny_model, EngineSettings(n_ctx=256, n_threads=1, gpu_layers="0")) as runner:
        model = runner.model
        grammar = toolcalls.tool_constraint([WEATHER, TIME], "auto").start(runner.ctx.address)

        def token(ch):
            (t,) = model.tokenize(ch, add_special=False, parse_special=False)
            return t

        def write(text):
            for ch in text:
                assert grammar.allows(token(ch)), (text, ch)
                grammar.accept(token(ch))

        write("Let me check that for you; no JSON here: x}]. " * 8 + "<tool_call>\n")
        assert not grammar.allows(token("x")) and grammar.allows(token("{"))
        write('{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
        assert grammar.allows(model.eos)
        required = toolcalls.tool_constraint([WEATHER, TIME], "required").start(runner.ctx.address)
        assert not required.allows(token("L")) and required.allows(token("<"))
    # a parameter's literal that reads like the converter's root rule stays a literal
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"enum": ["root ::= x"]}}, "required": ["a"]}}}
    assert '"\\"root ::= x\\""' in toolcalls.tool_constraint([odd], "required").gbnf


@pytest.fixture(scope="module")
def small(small_model):
    with serve.running(small_model, "--parallel", "1", "--ctx", "2048", "--threads", "2") as s:
        yield serve.client(s.url, timeout=300)


def test_tool_calls_whole_streamed_and_answered(small):
    # "required": the 0.5B answers a tool question in a ```json block when left to choose ("auto")
    question = "What is the weather in Paris, in celsius?"
    whole = _ask(small, question, tools=[WEATHER, TIME], max_tokens=40, tool_choice="required")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    # a named function, streamed: the call's id and name first, then its arguments in pieces
    chunks = list(_ask(small, question, tools=[WEATHER, TIME], max_tokens=40, stream=True,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # "auto": the 0.5B writes the call in a ```json fence, not in its template's tags; it is a call
    auto = _ask(small, question, tools=[WEATHER, TIME], max_tokens=60)
    assert auto.choices[0].finish_reason == "tool_calls", auto.choices[0].message.content
    assert auto.choices[0].message.tool_calls[0].function.name == "get_weather"
    chunks = list(_ask(small, question, tools=[WEATHER, TIME], max_tokens=60, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # the call and its result go back through the template; told to use no more tools, the model
    # answers in text (left to choose, the 0.5B calls get_weather again)
    model = small.models.list().data[0].id
    answer = small.chat.completions.create(model=model, temperature=0, max_tokens=30, tools=[WEATHER, TIME],
                                           tool_choice="none", messages=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}])
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
    assert "21" in answer.choices[0].message.content
