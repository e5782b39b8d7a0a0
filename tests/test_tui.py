"""The chat app driven by Textual's Pilot on the real 0.5B model."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from textual._compositor import Compositor
from textual.geometry import Region

from edgerun import user_settings
from edgerun.history import History
from edgerun.settings import EngineSettings
from edgerun.tui.app import EdgerunApp
from edgerun.tui.compositor import BandCompositor
from edgerun.tui.stats import StatsPanel
from edgerun.tui.widgets import Transcript
from testkit.tui import notes, wait_for

DRAFT = "qwen2.5-coder-0.5b"
ENGINE = EngineSettings(n_ctx=2048, gpu_layers="0")


@pytest.fixture(autouse=True)
def own_state(tmp_path, monkeypatch, small_model):
    """Conversations and settings in a temp dir; models still from the shared cache."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("EDGERUN_KV_DIR", str(tmp_path / "kv"))
    prefs = user_settings.UserSettings().replace(temperature=0.0, max_tokens=40)
    user_settings.save(prefs)


def _save_prefs(**changes):
    prefs, _ = user_settings.load()
    user_settings.save(prefs.replace(**changes))



async def send(pilot, app, text, *, expect_reply=True):
    app.query_one("#input").text = text
    app.query_one("#input").focus()
    await pilot.press("enter")
    if expect_reply:
        await wait_for(pilot, lambda: app.generating or (replies(app) and replies(app)[-1].status != "streaming"))


def replies(app):
    return [e for e in app.query_one(Transcript).entries if e.role == "assistant"]


def _screen_text(app):
    """What the transcript shows, as plain text."""
    view = app.query_one(Transcript)
    return "\n".join(view.render_line(y).text for y in range(view.size.height))


@contextlib.asynccontextmanager
async def _loaded_app(size=(120, 40)):
    """The app on the 0.5B model (no draft), driven by a Pilot, once its model is loaded."""
    app = EdgerunApp(DRAFT, draft="none", engine=ENGINE)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.session is not None)
        yield app, pilot


def panel_text(panel):
    """The stats panel as drawn on the screen."""
    return "\n".join(panel.render_line(y).text for y in range(panel.size.height))



async def test_send_a_message_and_see_the_reply_stream_with_stats():
    _save_prefs(max_tokens=200)
    async with _loaded_app() as (app, pilot):
        await send(pilot, app, "Count from 1 to 50, separated by commas.")
        panel = app.query_one(StatsPanel)
        seen_partial = False
        panel_views, counted = set(), 0
        while app.generating:
            if app.stats is not None and app.stats.generated_tokens > counted:
                counted = app.stats.generated_tokens
                app.tick()  # the UI tick, run here on each new token rather than waited for
                if app.generating and replies(app)[-1].text:
                    seen_partial = True  # text showed before the reply was finished
                    panel_views.add(panel_text(panel))
            await pilot.pause(0.02)
        reply = replies(app)[-1]
        assert reply.text.strip() and reply.status == "done", (reply.text, reply.status, notes(app))
        assert seen_partial
        assert len(panel_views) >= 3, panel_views  # the panel's numbers moved while the reply streamed
        assert app.stats.decode_tok_s > 0
        speed = panel_text(panel)
        assert "tok/s" in speed and " 0.0 tok/s" not in speed and f"tokens  {app.stats.generated_tokens:6d}" in speed
        conv = app.session.conversation_id
    with History() as h:
        roles = [(m.role, m.status) for m in h.messages(conv)]
    assert roles == [("user", "done"), ("assistant", "done")]


async def test_a_partial_update_draws_what_textuals_compositor_draws():
    """The chat screen's compositor asks fewer widgets for fewer lines; the lines and columns an
    update covers come out as Textual's own compositor draws them."""
    async with _loaded_app() as (app, pilot):
        await send(pilot, app, "Write a Python function that adds two numbers.")
        await wait_for(pilot, lambda: not app.generating)
        await pilot.pause(0.3)
        band = app.screen._compositor
        assert isinstance(band, BandCompositor)
        textuals = copy.copy(band)
        textuals.__class__ = Compositor
        transcript, stats = app.query_one(Transcript).region, app.query_one(StatsPanel).region
        updates = [Region(transcript.x, transcript.y + 2, transcript.width, 3),
                   Region(stats.x, stats.y + 6, stats.width, 5)]
        crop = Region.from_union(updates)
        rows = {y for r in updates for y in r.line_range}.__contains__
        ours, theirs = band._render_chops(crop, rows), textuals._render_chops(crop, rows)
        compared = 0
        for y in crop.line_range:
            if not rows(y):
                continue
            ends = band.cuts[y][1:]
            for (x, strip), end in zip(theirs[y].items(), ends):
                if strip is not None and x < crop.right and end > crop.x:
                    assert ours[y][x] == strip, (y, x)
                    compared += 1
        assert compared >= 8 * 2  # each updated line: the transcript's cut and the panel's


async def test_draft_marks_and_copying_a_reply_and_its_code():
    """With the n-gram drafter on a reply that repeats the prompt, F5 shows the drafted tokens
    styled in the transcript; Ctrl+R and Ctrl+B copy the reply and its last code block."""
    _save_prefs(max_tokens=120, ngram=True, spec_k=4)  # a fixed k: the governor cannot turn drafting off
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b"
    async with _loaded_app() as (app, pilot):
        await send(pilot, app, f"Repeat this code exactly, in a python code block:\n\n```python\n{code}\n```")
        await wait_for(pilot, lambda: not app.generating)
        reply = replies(app)[-1]
        assert any(drafted for _, drafted in reply.chunks), app.stats.governor  # some tokens came from the drafter
        assert "def sub" in reply.code_blocks()[-1]

        view = app.query_one(Transcript)
        draft_style = view.get_component_rich_style("transcript--draft", partial=True)
        assert not reply.marks
        await pilot.press("f5")
        await wait_for(pilot, lambda: reply.marks)
        drafted_text = "".join(t for t, d in reply.chunks if d)
        styled = [seg.text.strip() for strip in view._lines[view.entries.index(reply)] for seg in strip
                  if seg.style and seg.style.color == draft_style.color and seg.style.bold and seg.text.strip()]
        assert styled and all(text in drafted_text for text in styled)

        await pilot.press("ctrl+r")
        assert app.clipboard == reply.text
        await pilot.press("ctrl+b")
        assert app.clipboard == reply.code_blocks()[-1] and "def sub" in app.clipboard


async def test_keys_typed_just_before_enter_are_all_sent():
    """Keys arrive from the terminal as fast as they were typed or pasted; Enter must not
    overtake the characters before it (it did as a priority binding: "Write a hai")."""
    from textual import events
    from textual.keys import _character_to_key

    text = "Write a haiku about the sea."
    async with _loaded_app() as (app, pilot):
        app.query_one("#input").focus()
        for ch in text:  # as the terminal driver posts them: no waiting in between
            app.post_message(events.Key(_character_to_key(ch), ch))
        app.post_message(events.Key("enter", "\r"))
        await wait_for(pilot, lambda: len(app.query_one(Transcript).entries) == 2)
        assert app.query_one(Transcript).entries[0].text == text
        await wait_for(pilot, lambda: not app.generating)


async def test_escape_stops_the_reply_and_keeps_it_marked():
    _save_prefs(max_tokens=400)
    async with _loaded_app() as (app, pilot):
        await send(pilot, app, "Write a very long story about a lighthouse keeper.")
        await wait_for(pilot, lambda: app.stats is not None and app.stats.generated_tokens >= 5)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating, timeout=30)
        reply = replies(app)[-1]
        assert reply.status == "stopped" and reply.label == "Assistant (stopped)"
        assert "Assistant (stopped)" in _screen_text(app)
        assert 5 <= app.stats.generated_tokens < 400
        conv = app.session.conversation_id
    with History() as h:
        assert h.messages(conv)[-1].status == "stopped"


async def test_resume_a_saved_conversation_after_restart():
    async with _loaded_app() as (app, pilot):
        await send(pilot, app, "My name is Ada. Reply with just OK.")
        await wait_for(pilot, lambda: not app.generating)
    async with _loaded_app() as (app, pilot):
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ConversationsScreen")
        await pilot.click("#resume")
        await wait_for(pilot, lambda: len(app.query_one(Transcript).entries) == 2)
        assert "My name is Ada" in _screen_text(app)
        await send(pilot, app, "What is my name? Answer with one word.")
        await wait_for(pilot, lambda: not app.generating)
        assert "Ada" in replies(app)[-1].text


LONG_OPENING = ("Here is my shopping list, one item per line: " + ", ".join(
    f"item {i}: {name}" for i, name in enumerate(["apples", "bread", "milk", "eggs", "rice", "tea", "soap"] * 6))
    + ". Reply with just OK.")


async def _a_saved_conversation(tmp_path):
    """A conversation with a long opening turn, answered and closed: (its id, its saved state as
    the history records it, the state file)."""
    _save_prefs(max_tokens=8)
    async with _loaded_app() as (app, pilot):
        await send(pilot, app, LONG_OPENING)
        await wait_for(pilot, lambda: not app.generating)
        conv = app.session.conversation_id
    with History() as h:
        (saved,) = h.kv_states(conv)
    return conv, saved, tmp_path / "kv" / saved.name


async def test_a_reopened_conversation_restores_its_kv_state_and_deleting_it_removes_the_state(tmp_path):
    conv, saved, state = await _a_saved_conversation(tmp_path)
    assert state.is_file() and saved.n_tokens > 128
    async with _loaded_app() as (app, pilot):
        await app.show_conversation(conv)
        await send(pilot, app, "What is item 3? One word.")
        await wait_for(pilot, lambda: not app.generating)
        app.refresh_stats()
        resumed = app.session.resumed
        assert resumed.tokens > 128 and resumed.note is None
        assert f"resumed {resumed.tokens:,} tokens from cache in" in panel_text(app.query_one(StatsPanel))
        assert app.stats.prompt_evaluated == app.stats.prompt_tokens - resumed.tokens
        assert "KV cache" not in notes(app)
        with History() as h:
            (now,) = h.kv_states(conv)  # the longer conversation's state replaced the first
        assert now.n_tokens > saved.n_tokens and not state.exists()
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "ConversationsScreen")
        await pilot.click("#delete")
        await wait_for(pilot, lambda: not (tmp_path / "kv" / now.name).exists(), timeout=10)


async def test_a_corrupt_state_is_one_notification_and_the_reply_still_comes(tmp_path):
    conv, saved, state = await _a_saved_conversation(tmp_path)
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 1
    state.write_bytes(bytes(data))
    async with _loaded_app() as (app, pilot):
        await app.show_conversation(conv)
        await send(pilot, app, "What is item 3? One word.")
        await wait_for(pilot, lambda: not app.generating)
        await wait_for(pilot, lambda: "KV state not used" in notes(app), timeout=10)
        assert "checksum mismatch" in notes(app)
        assert replies(app)[-1].status == "done" and replies(app)[-1].text.strip()
        assert app.stats.prompt_evaluated == app.stats.prompt_tokens


async def test_resuming_another_conversation_waits_for_the_reply_to_stop():
    _save_prefs(max_tokens=400)
    async with _loaded_app() as (app, pilot):
        await send(pilot, app, "Say hi.")
        await wait_for(pilot, lambda: not app.generating)
        first = app.session.conversation_id
        await app.action_new_conversation()
        await send(pilot, app, "Write a very long story about a lighthouse keeper.")
        await wait_for(pilot, lambda: app.stats is not None and app.stats.generated_tokens >= 5)
        await app.show_conversation(first)
        await wait_for(pilot, lambda: "stop the reply first" in notes(app), timeout=10)
        assert app.generating
        assert [e.role for e in app.query_one(Transcript).entries] == ["user", "assistant"]
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating, timeout=30)
        await app.show_conversation(first)
        assert "Say hi." in _screen_text(app)


def _mid_reply_script(then: str) -> str:
    """A script that starts the app on the 0.5B model in its own process, asks for a long reply,
    and once tokens stream runs `then` (one line of code) inside the app."""
    return textwrap.dedent("""
        import asyncio, os, signal, sqlite3
        from edgerun import history
        from edgerun.settings import EngineSettings
        from edgerun.tui.app import EdgerunApp

        async def until_saved(pilot, n_chars):  # the streaming reply has n_chars on disk
            query = "SELECT length(content) FROM messages WHERE status = 'streaming'"
            while True:
                with sqlite3.connect(history.default_path()) as db:
                    if (db.execute(query).fetchone() or (0,))[0] > n_chars:
                        return
                await pilot.pause(0.02)

        async def main():
            app = EdgerunApp("qwen2.5-coder-0.5b", draft="none", engine=EngineSettings(n_ctx=2048, gpu_layers="0"))
            async with app.run_test(size=(100, 30)) as pilot:
                while app.session is None:
                    await pilot.pause(0.05)
                app.query_one("#input").text = "Write a long poem about the sea."
                app.query_one("#input").focus()
                await pilot.press("enter")
                while app.stats is None or app.stats.generated_tokens < 20:
                    await pilot.pause(0.02)
                THEN
            print("exited cleanly")

        asyncio.run(main())
    """).replace("THEN", then)


def test_a_kill_during_a_reply_leaves_the_partial_reply_in_the_database():
    _save_prefs(max_tokens=400)
    # once streamed text has reached the database, die
    script = _mid_reply_script("await until_saved(pilot, 20); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300, env=os.environ)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    with History() as h:
        conv = h.list_conversations()[0]
        assert h.recover() == 1
        reply = h.messages(conv.id)[-1]
    assert reply.role == "assistant" and reply.status == "interrupted"
    assert len(reply.content) > 20


def test_quitting_during_a_reply_exits_cleanly_and_keeps_it():
    """The model is closed only after the generation loop has returned from llama.cpp (closing
    it under a running decode crashed the process)."""
    _save_prefs(max_tokens=400)
    script = _mid_reply_script('await pilot.press("ctrl+q")')  # quit while llama.cpp is decoding
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300, env=os.environ)
    assert proc.returncode == 0 and b"exited cleanly" in proc.stdout, proc.stderr.decode()[-2000:]
    with History() as h:
        reply = h.messages(h.list_conversations()[0].id)[-1]
    assert reply.role == "assistant" and reply.status == "stopped" and reply.content


@pytest.mark.parametrize("model,draft,needle", [
    ("no-such-model", "none", "unknown model"),
    ("/nonexistent/model.gguf", "none", "no such file"),
    (DRAFT, "gemma-3-270m", "vocabulary"),
])
async def test_bad_input_is_a_notification_and_the_app_stays_up(model, draft, needle, other_vocab_model):
    app = EdgerunApp(model, draft=draft, engine=ENGINE)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: needle in notes(app), timeout=60)
        assert app.session is None and app.is_running
        await send(pilot, app, "hello?", expect_reply=False)  # a hint instead of a crash
        await wait_for(pilot, lambda: "no model is loaded" in notes(app), timeout=10)
        await pilot.press("f1")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen", timeout=10)


# ---- snapshots -------------------------------------------------------------------------------

def _still(app):
    """Make the screen deterministic: no live memory numbers."""
    app.live = False
    return app


async def _loaded(pilot):
    await wait_for(pilot, lambda: pilot.app.session is not None)
    pilot.app.refresh_stats()
    await pilot.pause(0.2)


def test_snapshot_main_screen(snap_compare):
    app = _still(EdgerunApp(DRAFT, draft="none", engine=ENGINE, live=False))
    assert snap_compare(app, terminal_size=(120, 36), run_before=_loaded)


SAVED_REPLY = """Here is the function:

```python
def is_palindrome(s: str) -> bool:
    \"\"\"True when s reads the same both ways.\"\"\"
    cleaned = "".join(c.lower() for c in s if c.isalnum())
    return cleaned == cleaned[::-1]
```

### How it works

1. **Clean** the string: keep letters and digits, lower-cased.
2. **Compare** it with its reverse (`cleaned[::-1]`).

That is all."""


def test_snapshot_transcript_of_a_saved_conversation(snap_compare):
    """The transcript's own rendering: roles, prose, a highlighted code block, a heading, a list,
    and a stopped reply's mark."""
    with History() as h:
        conv = h.new_conversation(DRAFT)
        h.add_message(conv, "user", "Write a palindrome check in Python.")
        h.add_message(conv, "assistant", SAVED_REPLY)
        h.add_message(conv, "user", "And in one line?")
        h.add_message(conv, "assistant", "`s == s[::-1]`, after cleaning", status="stopped")
    app = _still(EdgerunApp(DRAFT, draft="none", engine=ENGINE, live=False, resume=conv))
    assert snap_compare(app, terminal_size=(120, 40), run_before=_loaded)


def test_snapshot_model_screen(snap_compare):
    async def open_models(pilot):
        await _loaded(pilot)
        await pilot.press("f2")
        await wait_for(pilot, lambda: len(getattr(pilot.app.screen, "compatible", {})) >= 2)
        await pilot.pause(0.3)

    app = EdgerunApp(DRAFT, draft="none", engine=ENGINE, live=False)
    assert snap_compare(app, terminal_size=(120, 36), run_before=open_models)


def test_snapshot_settings_screen(snap_compare):
    async def open_settings(pilot):
        from textual.widgets import Input

        from edgerun.tui.screens import SettingsScreen

        await _loaded(pilot)
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
        for field in pilot.app.screen.query(Input):
            field.cursor_blink = False  # a blinking cursor is on or off depending on timing
        await pilot.pause(0.3)

    app = EdgerunApp(DRAFT, draft="none", engine=ENGINE, live=False)
    assert snap_compare(app, terminal_size=(120, 36), run_before=open_settings)


async def test_settings_are_validated_and_saved():
    async with _loaded_app(size=(120, 36)) as (app, pilot):
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "SettingsScreen")
        app.screen.query_one("#temperature").value = "hot"
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: "temperature" in notes(app))
        assert app.screen.__class__.__name__ == "SettingsScreen"
        app.screen.query_one("#temperature").value = "0.3"
        app.screen.query_one("#top_k").value = "12"
        app.screen.query_one("#save").press()
        await wait_for(pilot, lambda: app.screen.__class__.__name__ != "SettingsScreen")
    saved, warnings = user_settings.load()
    assert (saved.temperature, saved.top_k, warnings) == (0.3, 12, [])
