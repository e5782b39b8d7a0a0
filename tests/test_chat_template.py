"""Chat templates come from untrusted files: rendered only inside Jinja's sandbox, in a helper
process whose time, memory and output are bounded. Every failure is one InvalidModelFile line."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from edgerun.errors import InvalidModelFile
from edgerun.runtime import chat_template
from testkit.cli import run_cli

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
CHATML_MSGS = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
# the longest a bounded-out render may take: its own limit, plus a kill and a loaded machine's slack
BOUND_S = 2 * chat_template.TIME_LIMIT_S + 5.0
# Tests of the cut-off path lower the limit to this: a runaway runs past any limit, so waiting out
# the real one (2 s a template) proves nothing more; test_the_cli_prints_one_line_and_raw_still_runs
# waits out the real limit in a real edgerun process.
SHORT_LIMIT_S = 0.25


def test_fallback_chatml():
    assert chat_template.render(None, MSGS) == CHATML_MSGS


def test_template_helpers_and_special_tokens():
    t = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}"
    assert chat_template.render(t, MSGS, bos="<s>", eos="</s>") == '<s>[system]"be brief"[user]"hi"</s>'


def test_raise_exception_becomes_a_clear_error():
    t = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    with pytest.raises(InvalidModelFile, match=r"\(System role not supported\); use --raw"):
        chat_template.render(t, MSGS)
    assert chat_template.render(t, MSGS[1:]) == ""


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set _ = messages.append({'role': 'x'}) %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
])
def test_sandbox_refuses_escapes_and_mutation(evil):
    msgs = [dict(m) for m in MSGS]
    with pytest.raises(InvalidModelFile):
        chat_template.render(evil, msgs)
    assert msgs == MSGS


def test_text_reaches_the_template_and_back_unchanged():
    odd = "line\nnext\r\n\t\x00 é ü 中文 🙂 \u2028 \\n \" ' <|im_end|> {{ x }} \ud800"
    assert chat_template.render("{{ messages[0]['content'] }}", [{"role": "user", "content": odd}]) == odd


def test_a_long_conversation_is_not_cut():
    long = "x" * (3 * chat_template.OUTPUT_LIMIT_CHARS)
    text = chat_template.render(None, [{"role": "user", "content": long}])
    assert text == f"<|im_start|>user\n{long}<|im_end|>\n<|im_start|>assistant\n"


HOSTILE = {
    # Python exceptions other than TemplateError
    "zero division": "{{ 1/0 }}",
    "type error": "{{ 1 + 'a' }}",
    "type error on content": "{{ messages[0]['content'] + 1 }}",
    "huge int printed": "{{ 10**100000 }}",
    "huge int formatted": "{{ '%d' % 10**10000 }}",
    "overflow in %c": "{{ '%c' % 10**9 }}",
    "format arity": "{{ '%s' % (1, 2) }}",
    "unorderable sort": "{{ [1, 'a']|sort }}",
    "bad filter argument": "{{ {'a': 1}|dictsort(by='x') }}",
    "precision too big": "{{ '%.1000000000f' % 1.0 }}",
    "include without a loader": "{% include 'x' %}",
    "extends without a loader": "{% extends 'base' %}",
    # recursion
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive loop()": "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "deeply nested parentheses": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    # syntax and names
    "syntax error": "{% for %}",
    "unclosed block": "{% if true %}{{ 1",
    "break without the extension": "{% for i in range(3) %}{% break %}{% endfor %}",
    "undefined used as callable": "{{ nope() }}",
    "undefined attribute chain": "{{ messages.nope.deeper }}",
    # loops that do not end in any useful time, with and without output
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # runaway
    "nested range sums": "{% for i in range(100000) %}{% set s = range(100000)|sum %}{% endfor %}",  # runaway
    "nested ranges writing": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "lorem ipsum": "{{ lipsum(10**6) }}",  # runaway
    "power computed in C": "{{ 10**(10**10) }}",  # runaway
    "repeated squaring": "{% set ns = namespace(a=3) %}{% for i in range(64) %}{% set ns.a = ns.a * ns.a %}{% endfor %}",  # runaway
    # huge values built inside one C call
    "string times a billion": "{{ 'x' * 10**9 }}",
    "string times a hundred million": "{{ 'x' * 10**8 }}",
    "list times 10**5": "{{ (range(100000)|list) * 100000 }}",
    "range of a billion": "{{ range(10**9) }}",
    "star width": "{{ '%*d' % (10**9, 1) }}",
    "ljust": "{{ 'x'.ljust(10**10) }}",
    "format width": "{{ '{:>1000000000}'.format(1) }}",
    "center filter": "{{ 'x'|center(10**10) }}",
    "indent filter": "{{ 'x\ny'|indent(10**10) }}",
    "tojson indent": "{{ messages|tojson(indent=10**9) }}",
    "batch fill": "{{ range(10)|batch(10**9, 'x')|list }}",
    "replace between chars": "{{ 'abc'.replace('', 'x' * 10**7) }}",
    "join separator": "{{ range(100000)|map('string')|join('x' * 10**4) }}",
    "concat doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "macro body": "{% macro m() %}{% for i in range(10**5) %}{{ 'x' * 10**4 }}{% endfor %}{% endmacro %}{{ m() }}",
    "strftime of a long format": "{{ strftime_now('%Y' * 10**8) }}",
}
# the ones that end only at the time limit (the others end in an error or another limit well before)
RUNAWAY = frozenset({"nested ranges", "nested range sums", "lorem ipsum", "power computed in C", "repeated squaring"})


@pytest.mark.parametrize("name", HOSTILE.keys())
def test_hostile_template_ends_in_one_clear_line(name, monkeypatch):
    assert chat_template.render(None, MSGS) == CHATML_MSGS  # the helper is up: time only this one
    start = time.monotonic()
    with monkeypatch.context() as patch, pytest.raises(InvalidModelFile) as caught:
        if name in RUNAWAY:
            patch.setattr(chat_template, "TIME_LIMIT_S", SHORT_LIMIT_S)
        chat_template.render(HOSTILE[name], MSGS)
    assert time.monotonic() - start < BOUND_S
    message = str(caught.value)
    assert message.startswith("the model's chat template ") and message.endswith("use --raw to skip it")
    assert (f"longer than its {SHORT_LIMIT_S:g} s limit" in message) == (name in RUNAWAY)
    assert "\n" not in message and len(message) < 500
    assert chat_template.render(None, MSGS) == CHATML_MSGS  # and the next turn renders as before


def test_a_runaway_template_in_a_worker_thread_ends(monkeypatch):
    """The chat app renders in a thread worker: the bound holds there too."""
    chat_template.render(None, MSGS)
    monkeypatch.setattr(chat_template, "TIME_LIMIT_S", SHORT_LIMIT_S)
    outcome = []

    def worker():
        try:
            chat_template.render(HOSTILE["nested ranges"], MSGS)
        except InvalidModelFile as exc:
            outcome.append(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive() and len(outcome) == 1


def test_interrupted_render_does_not_answer_the_next_turn():
    """Ctrl+C mid-render: the helper's late answer must not become the next prompt."""
    chat_template.render(None, MSGS)
    # about a second on an idle 2-core CPU: it would answer after the interrupt and within its
    # limit; long enough that the interrupt comes first however late a loaded machine wakes the timer
    slow = ("{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(2) %}"
            "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}late")
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            chat_template.render(slow, MSGS)
    finally:
        timer.cancel()
    assert chat_template.render(None, MSGS) == CHATML_MSGS


def _template_of(gguf) -> str | None:
    from edgerun.models import gguf_check

    return gguf_check.inspect(gguf).chat_template


def _in_process(template: str, messages: list[dict], bos: str, eos: str) -> str:
    """The same sandbox rendered in this process: what edgerun rendered before the helper."""
    return chat_template._env().from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)


CONVERSATION = [{"role": "system", "content": "You write Python."}] + [
    {"role": role, "content": f"{role} turn {i}: " + "def f(x):\n    return x * 2\n" * (i + 1)}
    for i in range(6) for role in ("user", "assistant")] + [{"role": "user", "content": "and now?"}]


@pytest.mark.model  # the fixture is named by a parameter, which conftest's automatic mark cannot see
@pytest.mark.parametrize("model", ["small_model", "target_model", "other_vocab_model"])
def test_catalog_templates_render_as_before(model, request):
    template = _template_of(request.getfixturevalue(model))  # None: ChatML
    assert chat_template.render(template, CONVERSATION, eos="<|im_end|>") == \
        _in_process(template or chat_template.CHATML, CONVERSATION, "", "<|im_end|>")


@pytest.mark.model
@pytest.mark.parametrize("model", ["small_model", "target_model"])
def test_qwen_templates_render_as_before(model, request):
    template = _template_of(request.getfixturevalue(model))
    assert chat_template.render(template, MSGS[1:]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chat_template.render(template, MSGS) == CHATML_MSGS


def test_gemma_template_from_a_gguf_renders_as_before(tmp_path):
    from edgerun.convert.gguf_writer import write_gguf
    from edgerun.convert.hf_reader import open_checkpoint
    from testkit.tiny import write_tiny_checkpoint

    gguf = write_gguf(open_checkpoint(write_tiny_checkpoint(tmp_path / "hf", "gemma3")), tmp_path / "tiny.gguf")
    template = _template_of(gguf)
    assert chat_template.render(template, MSGS, bos="<bos>") == (
        "<bos><start_of_turn>system\nbe brief<end_of_turn>\n<start_of_turn>user\nhi<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert chat_template.render(template, CONVERSATION, bos="<bos>", eos="<eos>") == \
        _in_process(template, CONVERSATION, "<bos>", "<eos>")


@pytest.fixture(scope="module")
def gguf_with_template(tmp_path_factory):
    """A tiny random-weight model whose GGUF carries the given chat template."""
    from edgerun.convert.gguf_writer import write_gguf
    from edgerun.convert.hf_reader import open_checkpoint
    from testkit.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("hostile")
    hf = write_tiny_checkpoint(root / "hf", "qwen2")

    def write(template: str):
        config = json.loads((hf / "tokenizer_config.json").read_text())
        (hf / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
        return write_gguf(open_checkpoint(hf), root / f"{abs(hash(template))}.gguf")
    return write


@pytest.mark.parametrize("name", ["nested ranges", "ljust", "zero division"])
def test_the_cli_prints_one_line_and_raw_still_runs(name, gguf_with_template, capsys):
    """The runaway in a real edgerun process, at the real limit; the other two through cli.main."""
    model = str(gguf_with_template(HOSTILE[name]))
    args = ["run", "hi", "-m", model, "-n", "4", "--ctx", "512", "--threads", "1"]
    if name in RUNAWAY:
        proc = subprocess.run([sys.executable, "-m", "edgerun.cli", *args], capture_output=True, text=True,
                              timeout=60 + BOUND_S)
        assert f"longer than its {chat_template.TIME_LIMIT_S:g} s limit" in proc.stderr
    else:
        proc = run_cli(capsys, *args)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("edgerun: error: the model's chat template ") and proc.stderr.count("\n") == 1
    assert proc.stderr.rstrip().endswith("use --raw to skip it")
    assert run_cli(capsys, *args, "--raw").returncode == 0  # as it says
