"""The schema set (tests/data/json_schemas.json: nested objects, enums, arrays, bounded integers and
numbers, optional and nullable fields, $refs, patterns, formats) on the catalog's models: every
reply parses and validates, and at T=0 the n-gram drafter and the 0.5B draft change nothing."""

import json
from pathlib import Path

import jsonschema
import pytest

from edgerun.decode import constrain
from edgerun.decode.generate import Step
from edgerun.runner import Runner
from edgerun.settings import EngineSettings, SamplerSettings

CASES = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
GREEDY = SamplerSettings(temperature=0.0)
ENGINE = EngineSettings(n_ctx=1024, gpu_layers="0")
MAX_TOKENS = 80
EXACT = 6  # replies the n-gram runner's output is compared on, token for token, with plain decoding


def _reply(runner, case, sampling=GREEDY):
    tokens = runner.chat_tokens([{"role": "user", "content": case["prompt"]}])
    steps = [s for s in runner.stream(tokens, sampling, max_tokens=MAX_TOKENS,
                                      constraint=constrain.json_schema(case["schema"])) if isinstance(s, Step)]
    return [s.token for s in steps], "".join(s.text for s in steps), steps[-1].finish


def _valid(case, text, finish):
    assert finish == "stop", (case["prompt"], text)
    jsonschema.validate(json.loads(text), case["schema"])


def test_every_schema_validates_on_the_small_model_and_ngram_changes_nothing(small_model):
    assert len(CASES) >= 20
    with Runner(small_model, ENGINE, ngram=True) as ngram, Runner(small_model, ENGINE) as plain:
        for i, case in enumerate(CASES):
            tokens, text, finish = _reply(ngram, case)
            _valid(case, text, finish)
            if i < EXACT:
                assert _reply(plain, case)[0] == tokens, case["prompt"]


def test_every_schema_validates_on_the_target_with_its_draft(target_model, small_model):
    with Runner(target_model, ENGINE, draft=str(small_model), spec_k=4) as runner:
        for case in CASES:
            _valid(case, *_reply(runner, case)[1:])
        hot = SamplerSettings(temperature=0.8, seed=3)
        _valid(CASES[11], *_reply(runner, CASES[11], hot)[1:])
