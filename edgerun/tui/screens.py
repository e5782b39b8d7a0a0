"""Model picker, settings, saved conversations and help."""

from __future__ import annotations

import os
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Markdown, ProgressBar, Select, Switch

from edgerun import paths, user_settings
from edgerun.errors import EdgerunError
from edgerun.models import catalog, fetch, local
from edgerun.runtime.vocab import check_pair


def _dir_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


class ModelScreen(ModalScreen):
    """Catalog models with size and state; pick a target and a vocab-compatible draft; pull."""

    BINDINGS = [("escape", "dismiss", "Close")]

    def __init__(self, target: str, draft: str | None) -> None:
        super().__init__()
        self.target, self.draft = target, draft
        self.compatible: dict[str, bool] = {}

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Models", classes="dialog-title")
            yield DataTable(id="models", cursor_type="row")
            yield ProgressBar(id="pull-progress", show_eta=False)
            with Horizontal(classes="buttons"):
                yield Button("Use as target", id="use-target", variant="primary")
                yield Button("Use as draft", id="use-draft")
                yield Button("No draft", id="no-draft")
                yield Button("Pull", id="pull")
                yield Button("Convert…", id="convert")
                yield Button("Close", id="close")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("name", "role", "size", "state", "draft for target")
        self.query_one(ProgressBar).display = False
        self.fill()
        self.check_drafts()

    def fill(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        for e in catalog.load().entries:
            state = "verified" if fetch.is_verified(e) else ("present" if fetch.is_present(e) else "not pulled")
            mark = "target" if e.name == self.target else ("draft" if e.name == self.draft else "")
            fit = {True: "same vocab", False: "other vocab"}.get(self.compatible.get(e.name), "")
            table.add_row(f"{e.name} {'●' if mark else ''}".strip(), e.role, f"{e.size / 1e9:.2f} GB", state,
                          "(target)" if e.name == self.target else fit, key=e.name)
        for m in local.load():  # converted here: present by definition
            mark = m.name in (self.target, self.draft)
            fit = {True: "same vocab", False: "other vocab"}.get(self.compatible.get(m.name), "")
            table.add_row(f"{m.name} {'●' if mark else ''}".strip(), "converted",
                          f"{(m.summary.get('size_bytes') or 0) / 1e9:.2f} GB", "local",
                          "(target)" if m.name == self.target else fit, key=m.name)

    @work(thread=True, exclusive=True, group="vocab")
    def check_drafts(self) -> None:
        """Only same-vocab models are offered as drafts (vocab-only loads: about a second each)."""
        try:
            target = fetch.resolve(self.target)
        except EdgerunError:
            return
        for name, path in local.present():
            if name != self.target:
                try:
                    check_pair(target, path)
                    self.compatible[name] = True
                except EdgerunError:
                    self.compatible[name] = False
        self.app.call_from_thread(self.fill)

    def _selected(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    @on(Button.Pressed, "#use-target")
    def use_target(self) -> None:
        name = self._selected()
        entry = catalog.load().find(name) if name else None
        if (entry is None or not fetch.is_present(entry)) and not (name and local.find(name)):
            self.app.notify(f"{name} is not downloaded: press Pull first", severity="warning")
            return
        draft = self.draft if self.compatible.get(self.draft or "", False) or self.draft in ("auto", "none") else "none"
        self.app.request_load(name, draft)
        self.dismiss()

    @on(Button.Pressed, "#use-draft")
    def use_draft(self) -> None:
        name = self._selected()
        if name == self.target:
            self.app.notify("a model cannot draft for itself here; pick a smaller one", severity="warning")
        elif not self.compatible.get(name or ""):
            self.app.notify(f"{name} cannot draft for {self.target}: not downloaded or another vocabulary",
                            severity="error")
        else:
            self.app.request_load(self.target, name)
            self.dismiss()

    @on(Button.Pressed, "#no-draft")
    def no_draft(self) -> None:
        self.app.request_load(self.target, "none")
        self.dismiss()

    @on(Button.Pressed, "#close")
    def close(self) -> None:
        self.dismiss()

    @on(Button.Pressed, "#convert")
    def convert(self) -> None:
        from edgerun.tui.convert import ConvertScreen

        self.dismiss()
        self.app.push_screen(ConvertScreen())

    @on(Button.Pressed, "#pull")
    def pull(self) -> None:
        name = self._selected()
        if name and catalog.load().find(name) is None:
            self.app.notify(f"{name} was converted here: nothing to pull", severity="warning")
        elif name:
            bar = self.query_one(ProgressBar)
            bar.display = True
            bar.update(total=catalog.load().get(name).size, progress=0)
            self.pull_model(name)

    @work(thread=True, exclusive=True, group="pull")
    def pull_model(self, name: str) -> None:
        entry = catalog.load().get(name)
        bar = self.query_one(ProgressBar)
        # the fetchers write into the downloads folder (or the hub cache); watch it grow
        timer = self.app.call_from_thread(
            self.set_interval, 0.5, lambda: bar.update(progress=_dir_bytes(paths.downloads_dir() / name)))
        try:
            fetch.pull(entry, say=lambda text: self.app.call_from_thread(self.app.set_status, text))
            self.app.call_from_thread(self.app.notify, f"{name} is ready")
        except EdgerunError as exc:
            self.app.call_from_thread(self.app.notify, str(exc), title="pull failed", severity="error")
        finally:
            self.app.call_from_thread(timer.stop)
            self.app.call_from_thread(bar.update, progress=entry.size)
            self.app.call_from_thread(self.fill)


class SettingsScreen(ModalScreen):
    """Sampling, length, system prompt and speculation settings; saved for next time."""

    BINDINGS = [("escape", "dismiss", "Close")]

    def __init__(self, prefs: user_settings.UserSettings) -> None:
        super().__init__()
        self.prefs = prefs

    def compose(self) -> ComposeResult:
        p = self.prefs
        drafts = [("auto", "auto"), ("none", "none")] + [
            (e.name, e.name) for e in catalog.load().entries if e.role == "draft"]
        with Vertical(id="dialog"):
            yield Label("Settings", classes="dialog-title")
            for label, key, value in (("temperature", "temperature", p.temperature), ("top-p", "top_p", p.top_p),
                                      ("top-k", "top_k", p.top_k), ("max tokens", "max_tokens", p.max_tokens),
                                      ("draft k (auto or a number)", "spec_k", p.spec_k)):
                with Horizontal(classes="field"):
                    yield Label(label)
                    yield Input(str(value), id=key, compact=True)
            with Horizontal(classes="field"):
                yield Label("system prompt")
                yield Input(p.system_prompt or "", id="system", placeholder="(the model's default)", compact=True)
            with Horizontal(classes="field"):
                yield Label("draft")
                yield Select(drafts, value=p.draft if p.draft in dict(drafts) else "auto", id="draft", allow_blank=False, compact=True)
            with Horizontal(classes="field"):
                yield Label("n-gram drafting")
                yield Switch(p.ngram, id="ngram")
            with Horizontal(classes="field"):
                yield Label("n-gram: earlier conversations too")
                yield Switch(p.ngram_pool, id="ngram_pool")
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss()

    @on(Button.Pressed, "#save")
    def save(self) -> None:
        raw = {w.id: w.value for w in self.query(Input)}
        raw["draft"] = self.query_one("#draft", Select).value
        raw["ngram"] = self.query_one("#ngram", Switch).value
        raw["ngram_pool"] = self.query_one("#ngram_pool", Switch).value
        prefs, problems = user_settings.from_form(self.prefs, raw)
        if problems:
            self.app.notify("; ".join(problems), title="not saved", severity="error")
            return
        self.app.apply_settings(prefs)
        self.dismiss()


class ConversationsScreen(ModalScreen):
    """Saved conversations: resume, rename, delete, export to Markdown."""

    BINDINGS = [("escape", "dismiss", "Close")]

    def __init__(self, history) -> None:
        super().__init__()
        self.history = history

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Conversations", classes="dialog-title")
            yield DataTable(id="conversations", cursor_type="row")
            yield Input(placeholder="new title, then Rename", id="title")
            with Horizontal(classes="buttons"):
                yield Button("Resume", id="resume", variant="primary")
                yield Button("Rename", id="rename")
                yield Button("Export", id="export")
                yield Button("Delete", id="delete", variant="error")
                yield Button("Close", id="close")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("title", "model", "messages", "updated")
        self.fill()

    def fill(self) -> None:
        import time

        table = self.query_one(DataTable)
        table.clear()
        for c in self.history.list_conversations():
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            table.add_row(c.title, c.model, str(c.message_count), when, key=str(c.id))

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        return int(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    @on(Button.Pressed, "#resume")
    async def resume(self) -> None:
        conv = self._selected()
        if conv is not None:
            self.dismiss()
            await self.app.show_conversation(conv)

    @on(Button.Pressed, "#rename")
    def rename(self) -> None:
        conv, title = self._selected(), self.query_one("#title", Input).value.strip()
        if conv is not None and title:
            self.history.rename(conv, title)
            self.fill()

    @on(Button.Pressed, "#delete")
    def delete(self) -> None:
        conv = self._selected()
        if conv is not None:
            self.app.forget_states(self.history.delete(conv))  # its saved KV states go with it
            self.fill()

    @on(Button.Pressed, "#export")
    def export(self) -> None:
        conv = self._selected()
        if conv is None:
            return
        out = paths.data_dir() / "exports" / f"conversation-{conv}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".md.tmp")
        tmp.write_text(self.history.export_markdown(conv))
        os.replace(tmp, out)
        self.app.notify(f"exported to {out}")

    @on(Button.Pressed, "#close")
    def close(self) -> None:
        self.dismiss()


class HelpScreen(ModalScreen):
    BINDINGS = [("escape", "dismiss", "Close")]

    def __init__(self, bindings) -> None:
        super().__init__()
        rows = "\n".join(f"| `{b.key}` | {b.description} |" for b in bindings)
        self.text = (
            "# edgerun chat\n\nType a message and press **Enter**; **Ctrl+J** adds a line; **Up/Down** on the"
            " first/last line recall sent messages.\n\n| key | action |\n|---|---|\n" + rows +
            "\n\nEvery action is also in the command palette (**Ctrl+P**). Conversations are saved as they"
            " stream. Speculation stats show in the panel on the right; the governor turns a draft off"
            " when it does not pay.\n"
        )

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Markdown(self.text)
            yield Button("Close", id="close")

    @on(Button.Pressed, "#close")
    def close(self) -> None:
        self.dismiss()
