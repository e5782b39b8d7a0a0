"""Flags as a user gives them: each is honoured or refused in one line, a draft length larger
than a batch is clamped (llama_decode aborted on it), and what the native extension raises reaches
the user as an EngineError."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from edgerun import _native, settings, user_settings
from edgerun.cli import build_parser
from edgerun.commands import _chat_overrides
from edgerun.decode import governor
from edgerun.decode.generate import Step, first_pick, generate, native_params, native_rng, native_round
from edgerun.decode.speculative import Round, SpecConfig
from edgerun.errors import ConfigError, EngineError
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings, SamplerSettings
from testkit.cli import run_cli

EDGERUN = [sys.executable, "-m", "edgerun.cli"]
SMALL = "qwen2.5-coder-0.5b"
PROMPT = "Repeat this line exactly: def add(a, b): return a + b"


def edgerun(*args, input=None, env=None):
    return subprocess.run([*EDGERUN, *args], capture_output=True, text=True, input=input, timeout=600,
                          env={**os.environ, **(env or {})})


def _notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("edgerun: note:")]


def _one_line_error(proc, needle):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("edgerun: error:") and needle in lines[0], lines


# ---- spec-k against the batch ------------------------------------------------------------------

def test_spec_k_larger_than_the_batch_is_clamped_with_one_note(small_model):
    """`--n-batch 4 --spec-k 8` sent a verify batch of 9 tokens to llama_decode, whose GGML_ASSERT
    aborted the process. At temperature 0 the clamped run is still token for token plain decoding."""
    common = ["-m", str(small_model), "--temp", "0", "-n", "24", "--ctx", "256"]
    plain = edgerun("run", PROMPT, *common, "--draft", "none")
    clamped = edgerun("run", PROMPT, *common, "--n-batch", "4", "--spec-k", "8", "--ngram")
    assert plain.returncode == 0 and clamped.returncode == 0, clamped.stderr[-2000:]
    assert clamped.stdout == plain.stdout and "add" in plain.stdout
    notes = _notes(clamped.stderr)
    assert len(notes) == 1 and "spec-k 8" in notes[0] and "at most 3" in notes[0], clamped.stderr
    assert not _notes(plain.stderr)


def test_chat_plain_takes_the_batch_and_speculation_flags(small_model):
    proc = edgerun("chat", "--plain", str(small_model), "--temp", "0", "-n", "16", "--ctx", "256",
                   "--n-batch", "2", "--spec-k", "5", "--ngram", input=PROMPT + "\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = _notes(proc.stderr)
    assert len(notes) == 1 and "at most 1" in notes[0], proc.stderr
    assert "add" in proc.stdout


# ---- flags each command accepts are used or refused ------------------------------------------

def test_only_the_chat_flags_given_override_the_saved_settings():
    args = build_parser().parse_args(["chat", "--temp", "0.2", "--ngram", "--spec-k", "4", "--seed", "7"])
    overrides = _chat_overrides(args)
    assert overrides.saved == {"temperature": 0.2, "ngram": True, "spec_k": 4}
    assert overrides.sampling == {"seed": 7}
    assert overrides.describe() == "command line: temp 0.2, spec-k 4, ngram, seed 7"
    saved = user_settings.UserSettings(temperature=0.9, top_k=12, ngram=False, spec_k="auto")
    now = overrides.apply(saved)
    assert (now.temperature, now.top_k, now.ngram, now.spec_k_value) == (0.2, 12, True, 4)
    assert overrides.sampling_for(saved) == SamplerSettings(temperature=0.2, top_k=12, seed=7)
    assert _chat_overrides(build_parser().parse_args(["chat"])) == user_settings.Overrides()
    no_ngram = _chat_overrides(build_parser().parse_args(["chat", "--no-ngram"]))
    assert no_ngram.saved == {"ngram": False} and no_ngram.describe() == "command line: no-ngram"


@pytest.mark.parametrize("args,needle", [
    (["pull", "--default", SMALL], "not both"),
    (["run", "hi", "--raw", "--system", "be brief"], "--system has no effect with --raw"),
    (["chat", "--plain", "--spec-k", "many"], "--spec-k must be auto or a number"),
])
def test_flags_a_command_would_drop_are_refused(args, needle, capsys):
    _one_line_error(run_cli(capsys, *args), needle)


@pytest.mark.parametrize("flag,value", [
    ("--seed", "-1"), ("--seed", str(2**64)), ("--top-k", str(2**40)), ("--temp", "nan"),
    ("--top-p", "0"), ("--min-p", "2"), ("--repeat-penalty", "0"), ("--threads", "0"), ("--max-vram", "-1"),
])
def test_values_the_native_side_cannot_take_are_refused_before_loading(flag, value, capsys):
    """`--seed -1` and `--top-k 2**40` were a pybind11 TypeError traceback after the model loaded."""
    proc = run_cli(capsys, "run", "hi", "-m", SMALL, flag, value)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"edgerun run: error: argument {flag}")


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_edgerun_threads_that_is_no_count_is_one_line(value, monkeypatch, capsys):
    monkeypatch.setenv(settings.THREADS_ENV, value)
    with pytest.raises(ConfigError, match=f"EDGERUN_THREADS={value!r}: give a thread count"):
        EngineSettings()
    _one_line_error(run_cli(capsys, "run", "hi", "-m", "no-such-model"), "EDGERUN_THREADS")


def test_edgerun_threads_is_the_default_and_threads_still_win(monkeypatch):
    monkeypatch.setenv(settings.THREADS_ENV, "3")
    assert settings.default_threads() == EngineSettings().n_threads == 3
    assert EngineSettings().replace(n_threads=1).n_threads == 1  # what --threads gives
    monkeypatch.delenv(settings.THREADS_ENV)
    assert settings.threads_from_env() is None and EngineSettings().n_threads == settings.physical_cores()


# ---- native failures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ctx(small_model):
    with Model(small_model) as model, Context(model, EngineSettings(n_ctx=128, n_batch=8, n_threads=2)) as c:
        yield c


def test_what_the_native_extension_raises_is_an_engine_error(ctx):
    params, rng = native_params(SamplerSettings(temperature=0.0)), native_rng(1)
    with pytest.raises(EngineError, match="sampling the first token"):
        first_pick(ctx, [], params, rng)  # no decode yet: no logits to sample from
    plan = _native.RoundPlan()
    plan.target, plan.last, plan.params = ctx.address, ctx.model.n_vocab + 5, params  # a token outside the vocabulary
    with pytest.raises(EngineError, match="decoding a round") as failed:
        native_round(plan, rng)
    assert "target llama_decode failed" in str(failed.value)
    # n-gram proposals may verify after a decode left in flight; a model draft must see `last` itself
    plan = _native.RoundPlan()
    plan.target, plan.draft, plan.last, plan.params = ctx.address, ctx.address, 1, params
    plan.k, plan.in_flight, plan.draft_feed = 2, True, [1]
    with pytest.raises(EngineError, match="a model draft's round cannot start from a decode in flight"):
        native_round(plan, rng)
    # only point-mass proposals at T=0 verify by the graph's pick
    plan.in_flight, plan.picked = False, True
    with pytest.raises(EngineError, match="only a greedy n-gram round without a grammar verifies by the graph's pick"):
        native_round(plan, rng)
    with pytest.raises(ConfigError, match="rule must be"):
        SpecConfig(rule="coin-flip")
    with pytest.raises(EngineError, match="seed from 0"):
        native_rng(-1)
    with pytest.raises(EngineError, match="top-k"):
        native_params(SamplerSettings(top_k=2**40))


def _speculate(ctx, prompt, k):
    """A greedy reply with n-gram drafts of fixed length k: its tokens and rounds."""
    records = list(generate(ctx, prompt, SamplerSettings(temperature=0.0), max_tokens=40,
                            spec_config=SpecConfig(ngram=True, k=k)))
    steps = [r for r in records if isinstance(r, Step)]
    assert steps[-1].finish in ("length", "stop") and len(steps) > 8
    return steps, [r for r in records if isinstance(r, Round)]


def test_a_fixed_k_is_clamped_to_the_batch_and_to_the_context_left(small_model):
    """Without the runner's clamp (a caller building its own SpecConfig): k drafts over n_batch - 1
    aborted in llama_decode, and k past the context's end failed the verify decode."""
    with Model(small_model) as model, Context(model, EngineSettings(n_ctx=256, n_batch=64, n_threads=2)) as ctx:
        words = " ".join(f"item{i}" for i in range(30))
        pattern = model.tokenize(words + "\n", add_special=False)
        assert len(pattern) > 60
        # the prompt repeats a long line, so the n-gram drafter proposes as much as it is asked for
        prompt = (pattern * 4)[: ctx.n_ctx - governor.K_MAX - 30]
        steps, rounds = _speculate(ctx, prompt, 60)
        assert max(r.drafted for r in rounds) > governor.K_MAX  # drafts went past the reserved room
        assert ctx.n_past <= ctx.n_ctx
        with Context(model, EngineSettings(n_ctx=256, n_batch=4, n_threads=2)) as small_batch:
            steps, rounds = _speculate(small_batch, pattern * 2, 8)
            assert max(r.drafted for r in rounds) == 3 and any(s.from_draft for s in steps)


# ---- the chat app ---

# ---- the chat app ------------------------------------------------------------------------------

@pytest.fixture
def app_state(tmp_path, monkeypatch, small_model):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _notes_of(app) -> str:
    return " ".join(str(n.message) for n in app._notifications)


async def _until(pilot, condition, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


async def _reply(app, pilot, text):
    app.query_one("#input").text = text
    app.query_one("#input").focus()
    await pilot.press("enter")
    await _until(pilot, lambda: not app.generating and app.reply_entry is not None
                 and app.reply_entry.status != "streaming")
    return app.reply_entry


async def test_the_app_runs_command_line_flags_over_saved_settings_without_saving_them(app_state):
    from edgerun.tui.app import EdgerunApp

    saved = user_settings.UserSettings(temperature=0.9, max_tokens=40, ngram=False, spec_k=8)
    user_settings.save(saved)
    overrides = user_settings.Overrides({"temperature": 0.0, "ngram": True}, {"seed": 3})
    app = EdgerunApp(SMALL, draft="none", engine=EngineSettings(n_ctx=512, n_batch=4, gpu_layers="0"),
                     overrides=overrides)
    async with app.run_test(size=(120, 36)) as pilot:
        await _until(pilot, lambda: app.session is not None)
        status = str(app.query_one("#status").render())
        assert "command line: temp 0.0, ngram, seed 3" in status, status
        assert app.session.runner.spec_config.ngram and app.session.runner.spec_config.k == 3  # saved spec_k 8, batch 4
        await _until(pilot, lambda: "spec-k 8" in _notes_of(app), timeout=10)
        assert _notes_of(app).count("spec-k 8") == 1 and len(app.session.runner.notes) == 1
        entry = await _reply(app, pilot, PROMPT)
        assert entry.status == "done" and "add" in entry.text, (entry.text, _notes_of(app))
    again, warnings = user_settings.load()
    assert again.replace(last_model=None) == saved and warnings == []


async def test_a_failure_in_the_generation_worker_is_a_notification(app_state):
    from edgerun.tui.app import EdgerunApp

    user_settings.save(user_settings.UserSettings(temperature=0.0, max_tokens=8))
    bad_seed = user_settings.Overrides({}, {"seed": 2**64})  # more than the native RNG takes
    app = EdgerunApp(SMALL, draft="none", engine=EngineSettings(n_ctx=256, gpu_layers="0"), overrides=bad_seed)
    async with app.run_test(size=(120, 36)) as pilot:
        await _until(pilot, lambda: app.session is not None)
        entry = await _reply(app, pilot, "hi")
        assert entry.status == "interrupted" and app.is_running
        assert "seeding the sampler" in _notes_of(app)
        app.overrides = user_settings.Overrides()
        assert (await _reply(app, pilot, "Say OK.")).status == "done"  # the app and its worker live on


async def test_a_saved_top_k_the_sampler_cannot_take_falls_back_to_its_default(app_state):
    """A saved top_k of 2**40 passed the settings check and killed the generation worker (a
    pybind11 TypeError), taking the app down."""
    from edgerun.tui.app import EdgerunApp

    path = user_settings.default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"temperature = 0.0\nmax_tokens = 8\ntop_k = {2**40}\n")
    app = EdgerunApp(SMALL, draft="none", engine=EngineSettings(n_ctx=256, gpu_layers="0"))
    async with app.run_test(size=(120, 36)) as pilot:
        await _until(pilot, lambda: app.session is not None)
        assert any("top_k" in w for w in app.pref_warnings)  # shown as a notification on mount
        assert (await _reply(app, pilot, "Say OK.")).status == "done"


async def test_a_setting_changed_in_the_app_stops_being_overridden(app_state):
    from edgerun.tui.app import EdgerunApp

    user_settings.save(user_settings.UserSettings(temperature=0.9, max_tokens=8))
    overrides = user_settings.Overrides({"temperature": 0.0, "max_tokens": 4})
    app = EdgerunApp(SMALL, draft="none", engine=EngineSettings(n_ctx=256, gpu_layers="0"), overrides=overrides)
    async with app.run_test(size=(120, 36)) as pilot:
        await _until(pilot, lambda: app.session is not None)
        await pilot.press("f3")
        await _until(pilot, lambda: app.screen.__class__.__name__ == "SettingsScreen", timeout=10)
        assert app.screen.query_one("#temperature").value == "0.9"  # the form edits the saved settings
        app.screen.query_one("#temperature").value = "0.3"
        app.screen.query_one("#save").press()
        await _until(pilot, lambda: app.screen.__class__.__name__ != "SettingsScreen", timeout=10)
        assert app.overrides.saved == {"max_tokens": 4}
        assert (app.effective.temperature, app.effective.max_tokens) == (0.3, 4)
        status = str(app.query_one("#status").render())
        assert "command line: max-tokens 4" in status and "temp" not in status, status
    saved, _ = user_settings.load()
    assert (saved.temperature, saved.max_tokens) == (0.3, 8)
