"""Opening the history when the chat app starts. A file that is damaged or is not an edgerun
history is said in one line, with an offer to move it aside and start a new one; declining (or
closing the app meanwhile) ends the app with return code 1 and that line, so `edgerun chat`
never exits 0 after it. Any other history error ends the app the same way."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label

from edgerun import history
from edgerun.errors import HistoryError, HistoryUnreadable
from edgerun.history import History


def open_history(app: App, ready: Callable[[History], None]) -> None:
    """Open the default history and hand it to `ready`, asking first about an unreadable file."""
    try:
        opened = History()
    except HistoryUnreadable as exc:
        problem = str(exc)
        app.push_screen(MoveAsideScreen(problem), lambda move: _answered(app, ready, move, problem))
        return
    except HistoryError as exc:
        _give_up(app, str(exc))
        return
    ready(opened)


def _answered(app: App, ready: Callable[[History], None], move: bool | None, problem: str) -> None:
    if not move:
        _give_up(app, problem)
        return
    try:
        moved = history.move_aside(history.default_path())
    except HistoryError as exc:
        _give_up(app, str(exc))
        return
    app.notify(f"the old history was moved to {moved}; starting a new one", timeout=10)
    open_history(app, ready)


def _give_up(app: App, problem: str) -> None:
    # Text, not a str: Rich would read the brackets of a path or an SQLite message as markup
    app.exit(return_code=HistoryError.exit_code, message=Text(f"edgerun: error: {problem}"))


class MoveAsideScreen(ModalScreen[bool]):
    """The history cannot be used: move it aside and start a new one, or quit."""

    BINDINGS = [("m", "answer(True)", "Move aside"), ("q", "answer(False)", "Quit")]

    def __init__(self, problem: str) -> None:
        super().__init__()
        self.problem = problem
        self._answered = False

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("The conversation history cannot be used", classes="dialog-title")
            yield Label(self.problem, id="problem")
            yield Label("Move it aside (it is kept as <name>.corrupt-<time>) and start a new history?")
            with Horizontal(classes="buttons"):
                yield Button("Move aside (m)", id="move", variant="warning")
                yield Button("Quit (q)", id="quit")

    def on_mount(self) -> None:
        self.query_one("#move").focus()

    def action_answer(self, move: bool) -> None:
        self._answered = True
        self.dismiss(move)

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.action_answer(event.button.id == "move")

    def on_unmount(self) -> None:
        if not self._answered:  # closed some other way (Esc pops any screen; the app quit): a no
            _give_up(self.app, self.problem)
