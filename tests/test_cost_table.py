"""Load-time costs kept on disk (edgerun/runtime/cost_table.py): a CPU runner that speculates
times its batch shapes at its first start and reads them at the next, a table that is not
timings is timed again, and `edgerun cache clear` removes the tables."""

from __future__ import annotations

import json

import pytest

from edgerun.runner import Runner
from edgerun.runtime import cost_table
from edgerun.settings import EngineSettings
from testkit.cli import run_cli

KEY = {"model": "file:1:2:ab", "engine": {"n_threads": 2}, "shapes": [["verify", 1], ["verify", 2], ["draft", 1]]}
TIMINGS = {("verify", 1): 0.07, ("verify", 2): 0.1, ("draft", 1): 0.02}
ENGINE = EngineSettings(n_ctx=512, n_threads=1, gpu_layers="0")


def test_a_table_reads_back_as_it_was_kept_for_its_key_alone(tmp_path):
    assert cost_table.save(KEY, TIMINGS, tmp_path, now=1000.0) is None
    assert cost_table.load(KEY, tmp_path, now=1000.0 + cost_table.MAX_AGE_S) == TIMINGS
    assert cost_table.load({**KEY, "engine": {"n_threads": 4}}, tmp_path, now=1000.0) is None


def test_a_table_older_than_its_age_or_from_the_future_is_timed_again(tmp_path):
    cost_table.save(KEY, TIMINGS, tmp_path, now=1000.0)
    assert cost_table.load(KEY, tmp_path, now=1000.0 + cost_table.MAX_AGE_S + 1) is None
    assert cost_table.load(KEY, tmp_path, now=999.0) is None


@pytest.mark.parametrize("broken", [
    "not json", "[]", '{"key": null}',
    {"saved": "yesterday"},
    {"seconds": None},
    {"seconds": [0.07, 0.1]},
    {"seconds": [0.07, 0.1, 0.02, 0.03]},
    {"seconds": [0.07, -0.1, 0.02]},
    {"seconds": [0.07, 0.0, 0.02]},
    {"seconds": [0.07, 1e9, 0.02]},
    {"seconds": [0.07, True, 0.02]},
    {"seconds": [0.07, "fast", 0.02]},
])
def test_a_table_that_is_not_timings_reads_as_none(tmp_path, broken):
    cost_table.save(KEY, TIMINGS, tmp_path, now=1000.0)
    path = cost_table.table_path(KEY, tmp_path)
    if isinstance(broken, dict):
        broken = json.dumps({**json.loads(path.read_text()), **broken})
    path.write_text(broken)
    assert cost_table.load(KEY, tmp_path, now=1000.0) is None


def test_a_table_with_a_value_past_json_reads_as_none(tmp_path):
    cost_table.save(KEY, TIMINGS, tmp_path, now=1000.0)
    path = cost_table.table_path(KEY, tmp_path)
    path.write_text(path.read_text().replace("0.07", "NaN", 1))
    assert cost_table.load(KEY, tmp_path, now=1000.0) is None


def test_a_kept_table_is_lowered_where_a_session_timed_a_shape_faster_and_keeps_its_age(tmp_path):
    cost_table.save(KEY, TIMINGS, tmp_path, now=1000.0)
    faster = {("verify", 1): 0.05, ("verify", 2): 0.3, ("verify", 9): 0.01, ("draft", 1): float("nan")}
    assert cost_table.lower(KEY, faster, tmp_path, now=1001.0)
    doc = json.loads(cost_table.table_path(KEY, tmp_path).read_text())
    assert doc["saved"] == 1000.0  # still timed again a week after it was timed
    assert cost_table.load(KEY, tmp_path, now=1000.0) == {**TIMINGS, ("verify", 1): 0.05}
    assert not cost_table.lower(KEY, faster, tmp_path, now=1001.0)  # nothing lower now: not written again
    assert not cost_table.lower({**KEY, "engine": {"n_threads": 4}}, faster, tmp_path, now=1001.0)  # none of that key
    assert not cost_table.lower(KEY, {("verify", 1): 0.01}, tmp_path, now=1000.0 + cost_table.MAX_AGE_S + 1)  # too old


def test_a_runner_lowers_its_kept_table_to_the_sizes_its_replies_timed(tiny_model, tmp_path, monkeypatch):
    from dataclasses import replace

    monkeypatch.setenv("EDGERUN_KV_DIR", str(tmp_path / "kv"))
    with Runner(tiny_model, ENGINE, ngram=True) as first:
        timed = dict(_verify(first))
        state = first.governors.get("ngram")
        # what the replies left: sizes 2 and 16 timed in them, 2 faster than kept and 16 slower
        learned = {**timed, 2: timed[2] / 2, 16: timed[16] * 2, 3: timed[3] / 2}
        first.governors.put("ngram", replace(state, verify_s=tuple(sorted(learned.items())), verify_seen=(2, 16)))
    table, = cost_table.default_dir().glob("*.json")
    kept = json.loads(table.read_text())
    with Runner(tiny_model, ENGINE, ngram=True) as second:
        read = dict(_verify(second))
    assert read == {**timed, 2: timed[2] / 2}  # 3 was not timed in a reply, 16 was not faster
    assert json.loads(table.read_text())["saved"] == kept["saved"]


def _verify(runner: Runner) -> tuple:
    return runner.governors.get("ngram").verify_s


def test_a_cpu_runner_reads_the_costs_its_first_start_timed(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGERUN_KV_DIR", str(tmp_path / "kv"))
    with Runner(tiny_model, ENGINE, ngram=True) as first:
        timed = _verify(first)
    tables = list(cost_table.default_dir().glob("*.json"))
    assert len(tables) == 1 and [n for n, _ in timed] == [*range(1, 10), 16, 32]
    # what the next start reads is the file's: values no timing would give show it
    doc = json.loads(tables[0].read_text())
    assert doc["key"]["shapes"] == [["verify", n] for n, _ in timed]
    doc["seconds"] = [1.0 + n / 1000 for n, _ in timed]
    tables[0].write_text(json.dumps(doc))
    with Runner(tiny_model, ENGINE, ngram=True) as second:
        assert _verify(second) == tuple((n, 1.0 + n / 1000) for n, _ in timed)
    # a table that is not timings is timed again, and replaced by one that is
    tables[0].write_text(json.dumps({**doc, "seconds": [-1.0] * len(timed)}))
    with Runner(tiny_model, ENGINE, ngram=True) as third:
        retimed = _verify(third)
    assert [n for n, _ in retimed] == [n for n, _ in timed] and all(t > 0 for _, t in retimed)
    assert cost_table.load(doc["key"]) == {("verify", n): t for n, t in retimed}
    # other settings are another table; a runner that does not speculate times nothing
    with Runner(tiny_model, ENGINE.replace(n_threads=2), ngram=True), Runner(tiny_model, ENGINE):
        pass
    assert len(list(cost_table.default_dir().glob("*.json"))) == 2
    # a model draft's step and catch-up are kept with the verifies, and read back into its costs
    with Runner(tiny_model, ENGINE, draft=str(tiny_model)) as drafting:
        timed = drafting.governors.get("model")
    with Runner(tiny_model, ENGINE, draft=str(tiny_model)) as again:
        read = again.governors.get("model")
    assert (read.verify_s, read.draft_step_s, read.catch_up_s) == (timed.verify_s, timed.draft_step_s, timed.catch_up_s)
    assert len(list(cost_table.default_dir().glob("*.json"))) == 3
    cleared = run_cli(capsys, "cache", "clear")
    assert cleared.returncode == 0 and "3 load-time cost table(s)" in cleared.stderr
    assert not list(cost_table.default_dir().glob("*.json"))
