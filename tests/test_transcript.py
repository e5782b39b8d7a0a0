"""The chat transcript's line-by-line rendering: a streamed reply ends up drawn exactly like the
same text drawn at once, only the entry that changed is rendered again, and the view follows a
growing reply until the user scrolls up. Real Textual app, no model needed."""

from __future__ import annotations

import random

from textual.app import App, ComposeResult

from edgerun.tui.widgets import Entry, Transcript

REPLY = """Here is the function:

```python
def is_palindrome(s: str) -> bool:
    cleaned = "".join(c.lower() for c in s if c.isalnum())
    return cleaned == cleaned[::-1]
```

### How it works

1. **Clean** the string: keep letters and digits.
2. **Compare** it with its reverse (`cleaned[::-1]`).

- a list item
- another

| a | b |
|---|---|
| 1 | 2 |

That is all."""


class TranscriptApp(App):
    def compose(self) -> ComposeResult:
        yield Transcript()


def _pieces(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 9)
        out.append(text[i:i + n])
        i += n
    return out


def _drawn(view: Transcript, entry: Entry) -> list[list[tuple[str, object]]]:
    lines = view._lines[view.entries.index(entry)]
    return [[(seg.text, seg.style) for seg in strip] for strip in lines]


async def test_a_streamed_reply_is_drawn_like_the_whole_text():
    async with TranscriptApp().run_test(size=(90, 30)) as pilot:
        view = pilot.app.query_one(Transcript)
        whole = view.add(Entry("assistant", REPLY))
        for seed in range(3):
            streamed = view.add(Entry("assistant"))
            for piece in _pieces(REPLY, seed):
                streamed.chunks.append((piece, False))
                view.changed(streamed)
            assert _drawn(view, streamed) == _drawn(view, whole)
            assert len(streamed._blocks) == len(whole._blocks)  # no stale versions of the growing block kept
        text = "\n".join(strip.text for strip in view._lines[0])
        assert "def is_palindrome" in text and "How it works" in text and "```" not in text


async def test_a_long_code_block_streamed_in_pieces_ends_up_highlighted_as_a_whole():
    code = ('"""A module docstring\n\nwith a blank line, then an unindented line."""\n\n\n'
            + "".join(f"def f{i}(x):\n    return x + {i}  # add\n\n" for i in range(12)) + "class A:\n\tpass\n")
    text = f"Code:\n\n```python\n{code}```\n\nDone."
    async with TranscriptApp().run_test(size=(90, 30)) as pilot:
        view = pilot.app.query_one(Transcript)
        whole = view.add(Entry("assistant", text))
        streamed = view.add(Entry("assistant", status="streaming"))
        for piece in _pieces(text, 3):
            streamed.chunks.append((piece, False))
            view.changed(streamed)
        assert [s.text for s in view._lines[1][1:]] == [s.text for s in view._lines[0][1:]]
        streamed.status = "done"
        view.changed(streamed)
        assert _drawn(view, streamed) == _drawn(view, whole)


async def test_an_unclosed_code_block_shows_its_code_while_it_streams():
    async with TranscriptApp().run_test(size=(90, 30)) as pilot:
        view = pilot.app.query_one(Transcript)
        entry = view.add(Entry("assistant", "Sure:\n\n```python\nx = 1\ny = ", status="streaming"))
        text = "\n".join(strip.text for strip in view._lines[view.entries.index(entry)])
        assert "x = 1" in text and "y =" in text and "```" not in text and "Assistant …" in text


async def test_a_change_renders_only_its_own_entry():
    async with TranscriptApp().run_test(size=(90, 30)) as pilot:
        view = pilot.app.query_one(Transcript)
        old = [view.add(Entry("user" if i % 2 == 0 else "assistant", REPLY)) for i in range(6)]
        before = [list(view._lines[i]) for i in range(len(old))]
        reply = view.add(Entry("assistant", status="streaming"))
        for piece in _pieces(REPLY, 7):
            reply.chunks.append((piece, False))
            view.changed(reply)
        for i in range(len(old)):  # the very same line objects: nothing re-rendered
            assert all(a is b for a, b in zip(before[i], view._lines[i], strict=True))


async def test_the_view_follows_a_growing_reply_until_the_user_scrolls_up():
    async with TranscriptApp().run_test(size=(90, 20)) as pilot:
        view = pilot.app.query_one(Transcript)
        for _ in range(3):
            view.add(Entry("assistant", REPLY))
        await pilot.pause()
        view.scroll_end(animate=False)
        await pilot.pause()
        reply = view.add(Entry("assistant", status="streaming"))
        for n in range(1, 13):  # the view is full already: each line lands past its bottom
            reply.chunks.append((f"line {n}\n\n", False))
            view.changed(reply)
            await pilot.pause()
        assert view.max_scroll_y > 0 and view.scroll_y == view.max_scroll_y
        bottom = "\n".join(view.render_line(y).text for y in range(view.size.height))
        assert "line 12" in bottom

        view.scroll_home(animate=False)  # the user goes back to read
        await pilot.pause()
        for n in range(13, 17):
            reply.chunks.append((f"line {n}\n\n", False))
            view.changed(reply)
            await pilot.pause()
        assert view.scroll_y == 0


async def test_draft_marks_show_the_text_with_drafted_pieces_styled():
    async with TranscriptApp().run_test(size=(90, 20)) as pilot:
        view = pilot.app.query_one(Transcript)
        entry = Entry("assistant")
        entry.chunks = [("plain ", False), ("drafted", True), (" **bold**", False)]
        entry.marks = True
        view.add(entry)
        segments = [seg for strip in view._lines[0][1:] for seg in strip]
        drafted = [seg for seg in segments if seg.text == "drafted"]
        assert drafted and drafted[0].style.bold
        assert "**bold**" in "".join(seg.text for seg in segments)  # raw text, not markdown


async def test_a_code_block_is_drawn_as_rich_syntax_draws_it():
    from rich.syntax import Syntax

    code = 'def f(x):\n\t"""A docstring\n\n    that spans lines."""\n\n    return [x] * 3  ' + "# long " * 20 + "\n"
    async with TranscriptApp().run_test(size=(70, 30)) as pilot:
        view = pilot.app.query_one(Transcript)
        view.add(Entry("assistant", f"```python\n{code}```"))
        ours = view._lines[0][1:-1]  # without the role line and the entry's blank line
        theirs = view._strips(Syntax(code.rstrip("\n"), "python", theme="monokai", word_wrap=True, padding=1,
                                     code_width=view._width - 2))

        def cells(strips):  # every character with its style
            return [[(ch, seg.style) for seg in strip for ch in seg.text] for strip in strips]
        assert cells(ours) == cells(theirs)
        assert len(ours) > code.count("\n") + 2  # the long line wrapped


def test_code_blocks_are_the_fenced_blocks_only():
    entry = Entry("assistant", "Use ```x``` inline.\n\n```python\ndef a():\n    pass\n```\n\ntext\n\n~~~\nb = 1\n~~~\n")
    assert entry.code_blocks() == ["def a():\n    pass\n", "b = 1\n"]
