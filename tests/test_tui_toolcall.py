"""The chat app's transcript draws a model's <tool_call> as a block: the function's name and its
arguments as JSON, never the raw tags (the real Transcript widget in a Textual app, no model)."""

import pytest
from textual.app import App, ComposeResult

from edgerun.tui.widgets import Entry, Transcript, tool_call_view

CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


class _One(App):
    def compose(self) -> ComposeResult:
        yield Transcript(id="t")


def _text(view: Transcript) -> str:
    return "\n".join(view.render_line(y).text for y in range(view.size.height))


@pytest.mark.parametrize("streamed", [len(CALL), CALL.index("</tool_call>"), CALL.index('"city"')])
async def test_a_tool_call_is_a_block_while_it_streams_and_after(streamed):
    app = _One()
    async with app.run_test(size=(80, 30)) as pilot:
        view = app.query_one(Transcript)
        entry = view.add(Entry("assistant", CALL[:streamed], status="streaming" if streamed < len(CALL) else "done"))
        view.changed(entry)
        await pilot.pause()
        shown = _text(view)
        assert "<tool_call>" not in shown and "</tool_call>" not in shown
        assert "Checking." in shown and "tool call" in shown
        if streamed == len(CALL):
            assert "tool call: get_weather" in shown and '"city": "Paris"' in shown


async def test_parallel_calls_are_each_a_block():
    two = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    app = _One()
    async with app.run_test(size=(80, 40)) as pilot:
        view = app.query_one(Transcript)
        view.changed(view.add(Entry("assistant", two, status="done")))
        await pilot.pause()
        shown = _text(view)
        assert "tool call: get_weather" in shown and "tool call: get_time" in shown and '"tz": "CET"' in shown


def test_the_call_view_reads_name_and_arguments():
    assert tool_call_view('\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>') == ("f", '{\n  "a": 1\n}')
    assert tool_call_view('\n{"name": "f", "argu') == ("", '{"name": "f", "argu')
