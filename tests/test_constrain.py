"""Constrained decoding on the tiny model (conftest's tiny_model, whose vocabulary holds every byte):
the schema-to-grammar conversion checked through llama.cpp's own grammar, the constrained
distribution and its rejection sampling, and exactness under speculation through the Runner."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun import _native
from edgerun.decode import constrain, reference
from edgerun.decode.generate import Step
from edgerun.errors import ConfigError
from edgerun.runner import Runner
from edgerun.settings import EngineSettings, SamplerSettings
from testkit.cli import one_line_error, run_cli

ENGINE = EngineSettings(n_ctx=512, n_batch=64, n_threads=1, gpu_layers="0")
GREEDY = SamplerSettings(temperature=0.0)
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "owl"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "weight": {"type": "number", "minimum": -3, "maximum": 250},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["kind", "legs", "ok"],
}
PROMPT = [{"role": "user", "content": "a pet as JSON: {\"kind\": \"cat\", \"legs\": 4} {\"kind\": \"cat\", \"legs\": 4}"}]


@pytest.fixture(scope="module")
def runners(tiny_model):
    with Runner(tiny_model, ENGINE) as plain, Runner(tiny_model, ENGINE, ngram=True, spec_k=4) as ngram, \
            Runner(tiny_model, ENGINE, draft=str(tiny_model), spec_k=4) as draft:
        # the random model is rarely sure of a pick the grammar forces: draft without the confidence stop
        draft.spec_config = replace(draft.spec_config, p_min=0.0)
        yield plain, ngram, draft


def _matches(grammar: _native.Grammar, model, text: str) -> bool:
    """Whether llama.cpp's grammar takes the ASCII `text` whole, one character's token at a time, and may end there."""
    g = grammar.copy()
    for ch in text:
        (token,) = model.tokenize(ch, add_special=False, parse_special=False)
        if not g.allows(token):
            return False
        g.accept(token)
    return g.allows(model.eos)


@settings(max_examples=40)
@given(lo=st.integers(-1200, 1200), span=st.integers(0, 2500), probe=st.integers(-4000, 4000))
def test_integer_bounds_match_exactly_the_integers_inside(runners, lo, span, probe):
    plain = runners[0]
    hi = lo + span
    grammar = constrain.json_schema({"type": "integer", "minimum": lo, "maximum": hi}).start(plain.ctx.address)
    for value in (lo, hi, lo - 1, hi + 1, probe):
        assert _matches(grammar, plain.model, str(value)) == (lo <= value <= hi), value


@pytest.mark.parametrize("text, inside", [("0", True), ("-3", True), ("-3.0", True), ("-3.5", False),
                                          ("-2.75", True), ("249.999", True), ("250", True), ("250.5", False),
                                          ("251", False), ("007", False), ("1e3", False)])
def test_number_bounds_take_decimals_between_whole_bounds(runners, text, inside):
    plain = runners[0]
    grammar = constrain.json_schema({"type": "number", "minimum": -3, "maximum": 250}).start(plain.ctx.address)
    assert _matches(grammar, plain.model, text) == inside


def test_a_list_of_types_keeps_the_other_keywords(runners):
    plain = runners[0]
    grammar = constrain.json_schema({"type": ["string", "null"], "maxLength": 3}).start(plain.ctx.address)
    assert _matches(grammar, plain.model, '"abc"') and _matches(grammar, plain.model, "null")
    assert not _matches(grammar, plain.model, '"abcd"')


def test_strings_refuse_raw_control_characters(runners):
    plain = runners[0]
    grammar = constrain.json_schema({"type": "string"}).start(plain.ctx.address)
    assert _matches(grammar, plain.model, '"a\\nb"') and not _matches(grammar, plain.model, '"a\nb"')


def _masked_reference(logits, allowed, **params):
    p = reference.distribution(logits, [], **params).astype(np.float64)
    masked = np.where(np.isin(np.arange(len(p)), allowed), p, 0.0)
    if masked.sum() == 0:  # no survivor allowed: the chain over the allowed tokens among the best 64
        order = sorted(range(len(logits)), key=lambda t: (-logits[t], t))[:64]
        keep = [t for t in order if t in set(allowed)]
        return reference.distribution(np.where(np.isin(np.arange(len(p)), keep), logits, -np.inf), [],
                                      **params).astype(np.float64)
    return masked / masked.sum()


def _letters(plain):
    """A grammar of one letter a-e then a space, its allowed first tokens, and logits over the vocabulary."""
    grammar = _native.Grammar(plain.ctx.address, 'root ::= [a-e] " "')
    allowed = grammar.allowed(list(range(plain.model.n_vocab)))
    logits = np.random.default_rng(3).normal(0, 1.0, plain.model.n_vocab).astype(np.float32)
    logits[allowed] += 2.0  # the allowed tokens carry real mass; the rest still holds most of it
    return grammar, allowed, logits


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (40, 0.95, 0.05), (2, 1.0, 0.0)])
def test_the_masked_distribution_is_the_chain_restricted_to_the_grammar(runners, top_k, top_p, min_p):
    plain = runners[0]
    grammar, allowed, logits = _letters(plain)
    if top_k == 2:  # the two best tokens refused: the chain runs on the allowed tokens alone
        refused = [t for t in range(len(logits)) if t not in allowed][:2]
        logits[refused] = logits.max() + 5
    params = _native.SamplerParams()
    params.temperature, params.top_k, params.top_p, params.min_p = 0.8, top_k, top_p, min_p
    got = grammar.masked_distribution(logits, [], params)
    want = _masked_reference(logits, allowed, temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p,
                             repeat_penalty=1.0, repeat_last_n=64)
    assert set(np.flatnonzero(got)) <= set(allowed)
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("refused_on_top", [0, 3, 70])
def test_the_masked_greedy_pick_is_the_best_allowed_token(runners, refused_on_top):
    """The model's own argmax, then the best 64, then the whole vocabulary: the first allowed token
    in logit order wherever it lies."""
    plain = runners[0]
    grammar, allowed, logits = _letters(plain)
    want = allowed[len(allowed) // 2]
    logits[want] = logits.max() + 1  # the best token overall, and then below `refused_on_top` refused ones
    refused = np.setdiff1d(np.arange(len(logits)), allowed)[:refused_on_top]
    logits[refused] = logits.max() + 1 + np.arange(len(refused))
    params = _native.SamplerParams()
    params.temperature = 0.0
    assert grammar.masked_greedy(logits, [], params) == want
    assert (np.argmax(logits) == want) == (refused_on_top == 0)


def _first_tokens(grammar, logits, drafts, q, seed, broken=False):
    """The first committed token of each verify: the draft if accepted, else the correction."""
    params = _native.SamplerParams()
    params.temperature, params.top_k, params.top_p, params.min_p = 1.0, 0, 1.0, 0.0
    rows = np.stack([logits, logits])
    rng = _native.Rng(seed)
    out = []
    for x in drafts:
        accepted, nxt = _native.verify(rows, [int(x)], None if q is None else q[None, :], [], params, "rejection",
                                       rng, None if broken else grammar.copy())
        out.append(int(x) if accepted else nxt)
    return np.array(out)


def test_rejection_sampling_under_a_grammar_keeps_the_constrained_target_distribution(runners):
    """Drafts from an unconstrained q (most refused by the grammar) and point-mass drafts, refused and
    allowed: the committed token follows the masked target, and the same test rejects a verify that
    ignores the grammar, so it has the power to fail."""
    plain = runners[0]
    grammar, allowed, logits = _letters(plain)
    p = _masked_reference(logits, allowed, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                          repeat_penalty=1.0, repeat_last_n=64)
    gen = np.random.default_rng(11)
    q = gen.dirichlet(np.ones(len(logits))).astype(np.float32)
    q[allowed[:2]] += 0.2
    q /= q.sum()
    trials = 6000
    cases = [(gen.choice(len(q), size=trials, p=q), q), (np.full(trials, allowed[0]), None),
             (np.full(trials, [t for t in range(len(q)) if t not in allowed][0]), None)]
    crit = 3 * np.sqrt(2 * len(allowed)) + len(allowed)  # chi-square well above its mean (df + 3 sd)
    for drafts, qq in cases:
        counts = np.bincount(_first_tokens(grammar, logits, drafts, qq, seed=5), minlength=len(p))
        assert counts[np.setdiff1d(np.arange(len(p)), allowed)].sum() == 0
        chi = (((counts[allowed] - trials * p[allowed]) ** 2) / (trials * p[allowed])).sum()
        assert chi < crit, chi
    broken = np.bincount(_first_tokens(grammar, logits, cases[0][0], q, seed=5, broken=True), minlength=len(p))
    assert broken[np.setdiff1d(np.arange(len(p)), allowed)].sum() > 0


def _reply(runner, sampling, constraint, max_tokens=160):
    steps = [r for r in runner.stream(runner.chat_tokens(PROMPT), sampling, max_tokens=max_tokens,
                                      constraint=constraint) if isinstance(r, Step)]
    return [s.token for s in steps], "".join(s.text for s in steps), steps


def test_greedy_constrained_replies_are_equal_with_ngram_and_draft_and_valid(runners):
    constraint = constrain.json_schema(SCHEMA)
    replies = [_reply(r, GREEDY, constraint) for r in runners]
    assert replies[0][0] == replies[1][0] == replies[2][0]
    assert replies[0][2][-1].finish == "stop", replies[0][1]
    jsonschema.validate(json.loads(replies[0][1]), SCHEMA)
    assert any(s.from_draft for s in replies[2][2])  # the self-draft's proposals were verified


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_constrained_replies_validate_with_every_drafter(runners, seed):
    hot = SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    constraint = constrain.json_schema(SCHEMA)
    for runner in runners:
        _, text, steps = _reply(runner, hot, constraint)
        assert steps[-1].finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("schema, needle", [
    ('{"type": "object", ', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"type": "array", "uniqueItems": true}', "uniqueItems"),
    ('{"type": "integer", "minimum": 5, "maximum": 1}', "no integer"),
    ('{"$ref": "#/$defs/missing"}', "cannot be turned into a grammar"),
    ('{"type": "number", "minimum": 0.5}', "whole value"),
])
def test_bad_schemas_are_one_clear_error(schema, needle):
    with pytest.raises(ConfigError, match=needle):
        constrain.json_schema(constrain.parse_schema(schema))


def test_a_grammar_llama_cpp_refuses_says_why(runners):
    with pytest.raises(ConfigError, match="does not parse") as info:
        constrain.gbnf('root ::= "a" missing').start(runners[0].ctx.address)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="empty"):
        constrain.gbnf("  \n").start(runners[0].ctx.address)
    # the parser recurses per nesting level: a deep one is refused before it can overflow the stack
    deep = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000
    with pytest.raises(ConfigError, match="20000 deep"):
        constrain.gbnf(deep).start(runners[0].ctx.address)
    with pytest.raises(ConfigError, match="maxLength 100000"):
        constrain.json_schema({"type": "string", "maxLength": 100000})


def test_run_json_schema_and_grammar_flags(tiny_model, capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    common = ["run", "-m", str(tiny_model), "--temp", "0", "--threads", "1", "--ctx", "512", "-n", "80",
              "--no-kv-cache"]
    result = run_cli(capsys, *common, "--json-schema", str(schema), "a pet")
    assert result.returncode == 0, result
    jsonschema.validate(json.loads(result.stdout), SCHEMA)
    grammar = tmp_path / "yes.gbnf"
    grammar.write_text('root ::= ("yes" | "no") "!"')
    result = run_cli(capsys, *common, "--grammar", str(grammar), "a pet")
    assert result.returncode == 0 and result.stdout.strip() in ("yes!", "no!"), result
    one_line_error(run_cli(capsys, *common, "--json-schema", '{"type": "string", "not": {}}', "x"), "'not'")
    grammar.write_text("root ::= \"a\" undefined-rule")
    one_line_error(run_cli(capsys, *common, "--grammar", str(grammar), "x"), "does not parse")
    one_line_error(run_cli(capsys, *common, "--grammar", str(tmp_path / "none.gbnf"), "x"), "cannot read")
    one_line_error(run_cli(capsys, *common, "--grammar", str(grammar), "--json-schema", "{}", "x"), "one of")


def test_bench_schema_on_the_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "schema.json"
    result = run_cli(capsys, "bench", "schema", "-m", str(tiny_model), "--temps", "0,1", "-n", "12", "--repeat", "1",
                     "--threads", "1", "--gpu-layers", "0", "--json", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert [r["temperature"] for r in doc["rows"]] == [0.0, 1.0]
    assert set(doc["sides"]) == {"free T=0", "schema T=0", "free T=1", "schema T=1"}
    for row in doc["rows"]:
        assert row["ratio"]["min"] <= row["ratio"]["median"] <= row["ratio"]["max"]
        assert all(r["valid"] in (True, None) for r in row["schema"])  # a finished reply validates
    assert [c["goal"] for c in doc["claims"]] == [">= 0.9"] and "schema / free" in result.stdout
