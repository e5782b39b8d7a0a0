"""`edgerun bench`: the pure statistics, the JSON document, the table and the plot without a model;
the scenario registry and harness; scenarios end to end on the tiny random-weight model; then A/B
runs on the real small models through the command a user runs. No assertion reads a speed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgerun import bench
from edgerun.bench import scenario
from edgerun.bench import spec as spec_scenario
from edgerun.commands import bench_table
from edgerun.errors import ConfigError
from testkit.cli import run_cli

EDGERUN = [sys.executable, "-m", "edgerun.cli"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOP_KEYS = {"schema", "partial", "settings", "configs", "per_prompt", "ratios", "agreement", "warnings",
            "n_batch_ttft", "peak_rss_bytes"}
CONFIG_KEYS = {"model", "path", "draft", "ngram", "spec_k", "runs", "ttft_s", "tpot_s", "decode_tok_s",
               "prompt_tok_s", "latency_s", "rss_bytes", "acceptance_rate", "mean_accepted_len"}


# -- pure statistics ---------------------------------------------------------------------------


@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=50), st.sampled_from([0, 50, 90, 99, 100]))
def test_percentile_matches_numpy(values, q):
    assert bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-9)


def test_percentile_edges():
    assert bench.percentile([], 50) == 0.0
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5


def test_gaps_are_differences_of_token_times():
    assert bench.gaps([0.5, 0.6, 0.8]) == pytest.approx([0.1, 0.2])
    assert bench.gaps([0.5]) == [] and bench.gaps([]) == []


def test_agreement_and_first_divergence():
    assert bench.agreement([1, 2, 3], [1, 2, 3]) == 1.0 and bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 0.75 and bench.first_divergence([1, 2, 3, 4], [1, 9, 3, 4]) == 1
    assert bench.agreement([1, 2], [1, 2, 3, 4]) == 0.5 and bench.first_divergence([1, 2], [1, 2, 3, 4]) == 2
    assert bench.agreement([], []) == 1.0 and bench.first_divergence([], []) is None
    assert bench.agreement([], [5]) == 0.0 and bench.first_divergence([], [5]) == 0


def test_ratio_spread_is_b_over_a_per_repeat():
    assert bench.ratio_spread([10, 20, 40], [5, 20, 80]) == {"median": 1.0, "min": 0.5, "max": 2.0}
    assert bench.ratio_spread([0, 10], [3, 15]) == {"median": 1.5, "min": 1.5, "max": 1.5}
    assert bench.ratio_spread([], []) is None


def test_schedule_interleaves_configurations():
    assert bench.schedule(2, ["A", "B"], 2) == [
        (0, 0, "A"), (0, 0, "B"), (0, 1, "A"), (0, 1, "B"),
        (1, 0, "A"), (1, 0, "B"), (1, 1, "A"), (1, 1, "B"),
    ]


def test_bench_flags():
    from edgerun.cli import build_parser

    args = build_parser().parse_args(["bench", "--vs", "x.gguf", "--n-batch", "128,512"])
    assert args.n_batch == [128, 512] and args.vs == "x.gguf"
    assert (args.temp, args.seed, args.draft) == (0.0, 0, "none")  # greedy, seeded, no automatic draft
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--n-batch", "0,abc"])


# -- prompts -----------------------------------------------------------------------------------


def test_shipped_sets():
    code, chat, spec, every = (bench.load_prompts(s) for s in ("code", "chat", "spec", "all"))
    assert {p.name for p in code} == {"code-short", "code-long", "context-long"}
    assert {p.set for p in chat} == {"chat"} and len(chat) >= 2
    assert [p.name for p in spec] == ["codegen", "code-edit"]
    assert len(every) == len(code) + len(chat) + len(spec) and len({p.name for p in every}) == len(every)
    assert any(p.sensitive for p in chat) and all(p.sensitive for p in code)
    assert len(max(every, key=lambda p: len(p.text)).text) > 6000  # the prefill prompt


def test_prompts_by_name_and_set():
    assert [p.name for p in bench.load_prompts("code-short,chat")] == ["code-short", "chat-numbers", "chat-explain"]
    assert [p.name for p in bench.load_prompts(" code-edit ")] == ["code-edit"]
    with pytest.raises(ConfigError, match="'code-edit,nope' is none of these"):
        bench.load_prompts("code-edit,nope")


def test_prompt_files(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("What is 2 + 2?\n\n\nTell me a story\nabout a cat.\n")
    prompts = bench.load_prompts(str(text))
    assert [(p.name, p.text, p.sensitive) for p in prompts] == [
        ("p1", "What is 2 + 2?", True), ("p2", "Tell me a story\nabout a cat.", False)]
    toml = tmp_path / "prompts.toml"
    toml.write_text('[[prompt]]\nname = "x"\ntext = "def f(): pass"\n')
    assert bench.load_prompts(str(toml)) == [bench.Prompt("x", "def f(): pass", True, "file")]
    toml.write_text('[[prompt]]\ntext = "no name"\n')
    with pytest.raises(ConfigError, match="name and text"):
        bench.load_prompts(str(toml))
    with pytest.raises(ConfigError, match="code, chat, spec, all, shipped prompt names"):
        bench.load_prompts(str(tmp_path / "missing.txt"))


# -- summary, table, plot (synthetic runs) ----------------------------------------------------


def _run(config, prompt, repeat, tok_s, tokens):
    metrics = {"ttft_s": 0.1, "tpot_s": 1 / tok_s, "decode_tok_s": tok_s, "prompt_tok_s": 100.0,
               "prompt_tokens": 20, "generated_tokens": len(tokens), "drafted": 0, "accepted": 0, "draft_rounds": 0}
    return bench.Run(config, prompt, repeat, metrics, [1 / tok_s] * (len(tokens) - 1), tokens)


def _result(partial=False):
    prompts = [bench.Prompt("nums", "1 + 1", True), bench.Prompt("talk", "hello", False)]
    cfg = {"model": "m", "path": "/m.gguf", "draft": "none", "ngram": False, "spec_k": "auto", "rss_bytes": 2**20}
    result = bench.BenchResult({"A": cfg, "B": cfg | {"model": "q"}}, prompts,
                               {"prompts": ["nums", "talk"], "max_tokens": 4, "temperature": 0.0, "seed": 0,
                                "repeat": 2, "n_batch": [], "runs_planned": 8, "runs_done": 0}, partial=partial)
    for rep in range(2):
        result.runs += [_run("A", "nums", rep, 10, [1, 2, 3, 4]), _run("B", "nums", rep, 20, [1, 9, 3, 4]),
                        _run("A", "talk", rep, 10, [5, 6]), _run("B", "talk", rep, 30, [5, 6])]
    if partial:
        result.runs = result.runs[:5]
    result.settings["runs_done"] = len(result.runs)
    return result


def test_summary_schema_ratios_agreement_and_warning():
    doc = bench.summarize(_result())
    assert set(doc) == TOP_KEYS and doc["schema"] == 1 and doc["partial"] is False
    assert set(doc["configs"]["A"]) == CONFIG_KEYS
    assert doc["configs"]["B"]["decode_tok_s"] == 25.0  # mean over prompts of per-prompt medians
    assert doc["ratios"]["decode_tok_s"] == {"median": 2.5, "min": 2.5, "max": 2.5}
    assert doc["agreement"]["nums"] == {"rate": 0.75, "first_divergence": 1, "sensitive": True, "tokens": [4, 4]}
    assert doc["agreement"]["talk"]["rate"] == 1.0
    assert len(doc["warnings"]) == 1 and "nums" in doc["warnings"][0]
    json.dumps(doc)  # serializable as is


def test_partial_summary_and_table_show_what_finished():
    doc = bench.summarize(_result(partial=True))
    assert doc["partial"] is True and doc["per_prompt"]["talk"]["B"]["runs"] == 1
    text = bench_table(doc)
    assert "partial" in text and "5/8 runs" in text and "warning:" in text
    assert "decode tok/s" in text and "agreement" in text
    json.dumps(doc)


def test_plot_writes_a_png(tmp_path):
    from PIL import Image

    path = tmp_path / "bench.png"
    bench.plot(_result(partial=True), path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] > 500
    assert not list(tmp_path.glob("*.tmp"))


# -- the scenario registry and harness -------------------------------------------------------

SCENARIOS = {"spec", "llama-cpp-python", "round-host", "chat-app", "convert"}
ENVELOPE = {"schema", "scenario", "argv", "commit", "machine", "settings", "claims"}


def test_registry_names_every_scenario_with_its_parser():
    from edgerun.cli import build_parser

    found = scenario.scenarios()
    assert SCENARIOS <= set(found)  # and any other module's (the GPU ones)
    for s in found.values():
        assert s.help and "goal" in s.help and "\n" not in s.help
    args = build_parser().parse_args(["bench", "spec", "-m", "t.gguf", "--temps", "0,0.7", "--json", "o.json"])
    assert (args.scenario, args.model, args.temps, str(args.json)) == ("spec", "t.gguf", [0.0, 0.7], "o.json")
    assert build_parser().parse_args(["bench", "--vs", "x.gguf"]).scenario is None  # the A/B, as before
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "spec", "--repeat", "0"])


def test_unknown_and_duplicate_scenarios(capsys):
    with pytest.raises(ConfigError, match="no bench scenario named 'nope'; there are: spec"):
        scenario.get("nope")
    spec = scenario.get("spec")
    assert scenario.register(spec) is spec  # re-registering the same one (a re-import) is harmless
    with pytest.raises(ValueError, match="two bench scenarios"):
        scenario.register(dataclasses.replace(spec, help="another"))
    proc = run_cli(capsys, "bench", "nope")
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_interleave_takes_abba_turns():
    order = []
    values = scenario.interleave({"A": lambda: order.append("A") or 1.0, "B": lambda: order.append("B") or 2.0}, 4)
    assert order == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert values == {"A": [1.0] * 4, "B": [2.0] * 4}


def test_claims_judge_the_median_against_the_goal():
    met = scenario.claim("x / y", {"median": 0.98, "min": 0.9, "max": 1.1}, ">= 0.97")
    assert met == {"claim": "x / y", "goal": ">= 0.97", "met": True, "median": 0.98, "min": 0.9, "max": 1.1}
    assert scenario.claim("share", 0.03, "< 0.02")["met"] is False
    assert scenario.claim("kld", 0.5, "<= 0.85") | {"claim": ""} == {
        "claim": "", "goal": "<= 0.85", "met": True, "median": 0.5, "min": 0.5, "max": 0.5}
    unmeasured = scenario.claim("none", None, ">= 1.5")
    assert unmeasured["met"] is False and unmeasured["median"] is None
    lines = scenario.claim_lines({"claims": [met, unmeasured]})
    assert lines == ["x / y: 0.980 (0.900-1.100), goal >= 0.97: met", "none: not measured (goal >= 1.5)"]


def test_host_share():
    assert spec_scenario.host_share({"decode_s": 2.0, "in_round_s": 1.9}) == pytest.approx(0.05)
    assert spec_scenario.host_share({"decode_s": 1.0, "in_round_s": 1.2}) == 0.0  # timer granularity
    assert spec_scenario.host_share({"decode_s": 0.0, "in_round_s": 0.0}) == 0.0  # a one-token reply


# -- scenarios end to end on the tiny model ----------------------------------------------------


def _scenario_doc(capsys, tmp_path, name, *args):
    """`edgerun bench NAME ... --json` through cli.main: the document and what was printed."""
    out = tmp_path / f"{name}.json"
    proc = run_cli(capsys, "bench", name, *args, "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert ENVELOPE <= set(doc) and doc["scenario"] == name and doc["schema"] == scenario.SCHEMA
    assert doc["machine"]["logical_cores"] >= 1 and doc["machine"]["ram_bytes"] > 0
    for c in doc["claims"]:  # every claim is printed with its verdict
        assert f"{c['claim']}: " in proc.stdout and f"goal {c['goal']}" in proc.stdout
    return doc, proc


def test_spec_scenario_on_the_tiny_model(tiny_model, tmp_path, capsys):
    doc, proc = _scenario_doc(capsys, tmp_path, "spec", "-m", str(tiny_model), "--draft", str(tiny_model), "--temps", "0",
                              "-n", "12", "--repeat", "2", "--prompts", "codegen,code-edit", "--threads", "1")
    assert doc["settings"]["prompts"] == ["codegen", "code-edit"] and doc["settings"]["repeat"] == 2
    assert set(doc["sides"]) == {"plain", "draft", "ngram"} and doc["sides"]["ngram"]["ngram"] is True
    rows = {(r["prompt"], r["drafter"]): r for r in doc["rows"]}
    assert set(rows) == {(p, d) for p in ("codegen", "code-edit") for d in ("draft", "ngram")}
    for r in rows.values():
        assert r["ratio"]["min"] <= r["ratio"]["median"] <= r["ratio"]["max"]
        assert 0 <= r["host_overhead"] < 1 and 0 <= r["acceptance"] <= 1
        assert r["agreement"] == 1.0  # at T=0 every drafter gives the target's own tokens
    assert [c["goal"] for c in doc["claims"]] == [">= 0.97", ">= 1.5", "< 0.02"]
    assert "ratio (min-max)" in proc.stdout


def test_ngram_scenario_on_the_tiny_model(tiny_model, tmp_path, capsys):
    doc, proc = _scenario_doc(capsys, tmp_path, "ngram", "-m", str(tiny_model), "--temps", "0,0.7", "-n", "12",
                              "--repeat", "2", "--pld", "10,4", "--threads", "1")
    assert doc["settings"]["pld"] == [4, 10] and doc["settings"]["repeat"] == 2
    assert doc["settings"]["gpu_layers"] == 0  # the CPU unless asked: plain, n-gram and lookup alike
    rows = {(r["case"], r["temperature"]): r for r in doc["rows"]}
    assert set(rows) == {(c, t) for c in ("edit", "chat", "codegen") for t in (0.0, 0.7)}
    assert set(rows["edit", 0.0]["tok_s"]) == {"plain", "ngram", "pld4", "pld10"}
    assert set(rows["chat", 0.7]["tok_s"]) == {"plain", "ngram"}
    assert rows["edit", 0.0]["best_pld"] in ("pld4", "pld10")
    assert len(doc["runs"]) == 2 * 2 * (4 + 2 + 2) and all(r["decode_tok_s"] > 0 for r in doc["runs"])
    for r in rows.values():
        for ratio in r["ratios"].values():
            assert ratio["min"] <= ratio["median"] <= ratio["max"]
    assert {c["goal"] for c in doc["claims"]} == {">= 1.3", ">= 1.0", ">= 1.5", ">= 0.97"}
    assert "n-gram / best pld" in proc.stdout


def test_round_host_scenario_on_the_tiny_model(tiny_model, tmp_path, capsys):
    doc, _ = _scenario_doc(capsys, tmp_path, "round-host", "-m", str(tiny_model), "-n", "12", "--repeat", "1",
                           "--prompts", "code-edit", "--threads", "1")
    assert [(r["prompt"], r["side"]) for r in doc["rows"]] == [("code-edit", "plain"), ("code-edit", "ngram")]
    worst = max(r["host_share"]["max"] for r in doc["rows"])
    assert 0 <= worst < 1 and doc["claims"][0]["median"] == worst
    assert all(0 < r["calls_per_token"] <= 1 for r in doc["rows"])  # a call makes one token or more


def test_llama_cpp_python_scenario_on_the_tiny_model(tiny_model, tmp_path, capsys):
    doc, proc = _scenario_doc(capsys, tmp_path, "llama-cpp-python", "-m", str(tiny_model), "-n", "12", "--repeat", "2",
                              "--threads", "1")
    assert {k: len(v) for k, v in doc["decode_tok_s"].items()} == {"edgerun": 2, "llama-cpp-python": 2}
    assert all(x > 0 for v in doc["decode_tok_s"].values() for x in v)
    ratio = doc["claims"][0]
    pairs = [a / b for a, b in zip(doc["decode_tok_s"]["edgerun"], doc["decode_tok_s"]["llama-cpp-python"])]
    assert ratio["min"] == pytest.approx(min(pairs)) and ratio["max"] == pytest.approx(max(pairs))
    assert proc.stderr.count("[1/2]") == 1 and "[2/2]" in proc.stderr


def test_a_failing_side_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    proc = run_cli(capsys, "bench", "llama-cpp-python", "-m", str(bad), "--repeat", "1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("edgerun: error:")


def test_ngram_refuses_a_gpu_layer_request_that_is_not_a_count(tiny_model, capsys):
    proc = run_cli(capsys, "bench", "ngram", "-m", str(tiny_model), "--gpu-layers", "all", "--repeat", "1")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("edgerun: error: --gpu-layers 'all' is not a number;"
                                                    " use auto, 0 or a layer count")


@pytest.mark.slow
def test_convert_scenario_on_a_tiny_checkpoint(tmp_path, capsys):
    from testkit.tiny import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "hf", "qwen2")
    doc, proc = _scenario_doc(capsys, tmp_path, "convert", "--src", str(src), "--work", str(tmp_path / "work"),
                              "--eval-chunks", "1", "--calib-chunks", "1", "--no-weigh", "--no-prose",
                              "--decode-tokens", "4", "--decode-repeat", "1", "--threads", "1", "--timed")
    plans = {f"edgerun @{f} (code calib)" for f in ("Q3_K_M", "Q2_K")} | {f"edgerun k-quants @{f}" for f in ("Q3_K_M", "Q2_K")}
    assert set(doc["results"]) == {f"stock {f}" for f in ("Q3_K_M", "Q2_K", "IQ3_XXS", "IQ2_M")} | plans
    res = doc["results"]
    for ftype in ("Q3_K_M", "Q2_K"):  # the plans are held to the stock file's size
        for name in (f"edgerun @{ftype} (code calib)", f"edgerun k-quants @{ftype}"):
            assert abs(res[name]["size_bytes"] - res[f"stock {ftype}"]["size_bytes"]) < 0.01 * res[f"stock {ftype}"]["size_bytes"]
    assert all(r["decode_tok_s"]["median"] > 0 for r in res.values())
    best = {f: min((s for s in ("Q3_K_M", "Q2_K", "IQ3_XXS", "IQ2_M")
                    if res[f"stock {s}"]["size_bytes"] <= res[f"stock {f}"]["size_bytes"]),
                   key=lambda s: res[f"stock {s}"]["kld_mean"]) for f in ("Q3_K_M", "Q2_K")}
    assert [c["median"] for c in doc["claims"]] == pytest.approx(
        [res[f"edgerun @{f} (code calib)"]["kld_mean"] / res[f"stock {best[f]}"]["kld_mean"] for f in ("Q3_K_M", "Q2_K")]
        + [res[f"edgerun k-quants @{f}"]["kld_mean"] / res[f"stock {f}"]["kld_mean"] for f in ("Q3_K_M", "Q2_K")])
    assert "mean KLD" in proc.stdout
    timed = doc["convert"]  # --timed: the whole convert as a user runs it, in a child process
    assert timed["wall_s"] > 0 and timed["peak_rss_bytes"] > 0 and Path(timed["output"]).stat().st_size == timed["size_bytes"]
    assert {"calibrate", "sensitivity", "weigh", "quantize"} <= set(timed["steps_s"])


@pytest.mark.slow
def test_convert_speed_against_another_checkout_on_a_tiny_checkpoint(tmp_path, capsys):
    """--speed-against DIR: a copy of this checkout whose pipeline names its plan step apart, so
    the reference side is seen running the copy's code; each side converts from an empty cache
    in a child process. The same pipeline gives the same file, so the KLD ratio is exactly 1."""
    import shutil

    from testkit.tiny import write_tiny_checkpoint

    root = Path(__file__).resolve().parents[1]
    ref = tmp_path / "ref"
    shutil.copytree(root / "edgerun", ref / "edgerun", ignore=shutil.ignore_patterns("__pycache__"))
    pipeline_py = ref / "edgerun" / "convert" / "pipeline.py"
    pipeline_py.write_text(pipeline_py.read_text().replace('clock("plan")', 'clock("plan in the copy")'))
    src = write_tiny_checkpoint(tmp_path / "hf", "qwen2")
    doc, proc = _scenario_doc(capsys, tmp_path, "convert", "--src", str(src), "--work", str(tmp_path / "work"),
                              "--eval-chunks", "1", "--threads", "1", "--speed-against", str(ref), "--size-of", "Q8_0")
    (name_ref, old), (name_new, new) = doc["sides"].items()
    assert name_new == "this tree" and doc["settings"]["reference_commit"] in name_ref
    assert "plan in the copy" in old["steps_s"] and "plan" in new["steps_s"]
    assert {"source", "calibrate", "sensitivity", "weigh", "quantize"} <= set(old["steps_s"]) & set(new["steps_s"])
    assert Path(old["output"]).read_bytes() == Path(new["output"]).read_bytes()
    assert old["size_bytes"] <= doc["settings"]["size_bytes"]
    assert [c["median"] for c in doc["claims"]] == [new["wall_s"] / old["wall_s"], 1.0]
    assert "mean KLD" in proc.stdout and "plan in the copy" in proc.stdout


def test_convert_speed_against_refuses_what_is_no_checkout(tmp_path, capsys):
    proc = run_cli(capsys, "bench", "convert", "--src", str(tmp_path), "--work", str(tmp_path / "w"),
                   "--speed-against", "no-such-revision-xyz")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "not a directory nor a git revision" in proc.stderr.strip().splitlines()[-1]


# -- the command on real models ----------------------------------------------------------------


def edgerun(*args, timeout=300):
    return subprocess.run([*EDGERUN, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Write a Python function that returns the sum of the numbers 1 to 100.\n\n"
                    "Explain in two sentences why the sky looks blue during the day.\n")
    return path


def test_bench_against_itself_matches(small_model, prompt_file, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = edgerun("bench", "-m", str(small_model), "--vs", str(small_model), "--prompts", str(prompt_file),
                   "-n", "16", "--repeat", "2", "--n-batch", "8,64", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert set(doc) == TOP_KEYS and set(doc["configs"]["B"]) == CONFIG_KEYS and doc["partial"] is False
    assert doc["settings"]["runs_done"] == doc["settings"]["runs_planned"] == 8
    progress = [line for line in proc.stderr.splitlines() if line.startswith(("[", "n_batch"))]
    assert len(progress) == 8 + 2 * 2 * 2  # a line per run and per sweep run
    for key in ("ttft_s", "decode_tok_s", "prompt_tok_s"):  # present and positive; their size is the machine's
        assert doc["ratios"][key]["median"] > 0, (key, doc["ratios"])
    assert all(a["rate"] == 1.0 and a["first_divergence"] is None for a in doc["agreement"].values())
    assert doc["warnings"] == [] and set(doc["n_batch_ttft"]) == {"8", "64"}
    assert doc["configs"]["A"]["latency_s"]["p50"] > 0 and doc["configs"]["A"]["rss_bytes"] > 0
    assert "B/A" in proc.stdout and "agreement" in proc.stdout
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_bench_against_another_model_disagrees(small_model, other_vocab_model, prompt_file, tmp_path):
    out = tmp_path / "bench.json"
    proc = edgerun("bench", "-m", str(small_model), "--vs", str(other_vocab_model), "--prompts", str(prompt_file),
                   "-n", "16", "--repeat", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    rates = [a["rate"] for a in doc["agreement"].values()]
    assert len(rates) == 2 and sum(rates) / len(rates) < 0.5, doc["agreement"]
    assert doc["configs"]["B"]["model"] != doc["configs"]["A"]["model"]


def test_ctrl_c_reports_what_was_measured(small_model, prompt_file, tmp_path):
    """Ctrl-C exits 130, as `edgerun run` does when stopped: scripts can tell an interrupted
    bench from a complete one, and the partial report and JSON are still written."""
    out = tmp_path / "bench.json"
    proc = subprocess.Popen([*EDGERUN, "bench", "-m", str(small_model), "--prompts", str(prompt_file),
                             "-n", "64", "--repeat", "3", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = ""
    while not first.startswith("[") and proc.poll() is None:
        first = proc.stderr.readline()
    assert first.startswith("[1/12]"), first
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "partial" in stdout and "Traceback" not in stderr
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and 1 <= doc["settings"]["runs_done"] < 12
    assert doc["configs"]["A"]["runs"] >= 1
    assert not os.path.exists(str(out) + ".tmp")


def test_long_context_prompt_is_long(small_model):
    from edgerun.runtime.engine import Model

    prompt = next(p for p in bench.load_prompts("all") if p.name == "context-long")
    with Model(small_model, vocab_only=True) as model:
        assert len(model.tokenize(prompt.text, add_special=False)) >= 1500


def test_resume_scenario_on_the_tiny_model(tiny_model, tmp_path, capsys):
    doc, proc = _scenario_doc(capsys, tmp_path, "resume", "-m", str(tiny_model), "--draft", str(tiny_model),
                              "--tokens", "1500", "--ctx", "2048", "--repeat", "2", "--threads", "1", "--gpu-layers", "0")
    s = doc["settings"]
    assert 1000 < s["conversation_tokens"] <= 1500 and s["prompt_tokens"] > s["conversation_tokens"]
    assert s["conversation_tokens"] - 16 <= s["restored_tokens"] <= s["conversation_tokens"]
    assert set(doc["ttft_s"]) == {"restore", "restore-cold", "prefill"} and all(len(v) == 2 for v in doc["ttft_s"].values())
    assert doc["outputs"]["restored_equals_in_memory"] is True
    z = doc["sizes"]
    assert z["llama_state_bytes"] < z["state_file_bytes"] == doc["draft"]["state_file_bytes"]  # a self-draft: the same state
    assert set(doc["draft"]["sides"]) == {"draft restore", "draft catch-up"}
    assert [c["goal"] for c in doc["claims"]] == ["<= 0.1", "<= 0.1", "<= 1.001"]
    assert "restored replies equal the in-memory conversation's" in proc.stdout
