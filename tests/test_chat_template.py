"""Chat templates come from untrusted files: rendered only inside Jinja's sandbox."""

import pytest

from edgerun.errors import InvalidModelFile
from edgerun.runtime import chat_template

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_fallback_chatml():
    text = chat_template.render(None, MSGS)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_helpers_and_special_tokens():
    t = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}"
    assert chat_template.render(t, MSGS, bos="<s>", eos="</s>") == '<s>[system]"be brief"[user]"hi"</s>'


def test_raise_exception_becomes_a_clear_error():
    with pytest.raises(InvalidModelFile, match="--raw"):
        chat_template.render("{{ raise_exception('only user and assistant roles') }}", MSGS)


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
