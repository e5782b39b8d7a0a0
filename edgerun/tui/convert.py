"""Convert… in the chat app: the form, the job and its report.

The job (ConvertJob) runs `edgerun convert`'s pipeline in a thread worker of the app, not of the
dialog: closing the dialog leaves it running and the chat usable (the worker thread runs at a lower
CPU priority, and so do the llama.cpp threads and the quantizer process it starts); F2 ->
Convert… shows it again. Cancel stops it at the next progress report; finished steps are cached by
the pipeline, so running it again resumes. When done the model is registered (models/local.py),
its report shown, and its same-vocab draft candidates offered."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, ProgressBar, Select, Static, Switch

from edgerun.errors import EdgerunError

STEPS = ("write", "calibrate", "sensitivity", "weigh", "plan", "quantize", "report")
WORKER_NICE = 10  # below the chat's generation (and the UI thread's UI_NICE)
REFRESH_S = 0.25


def step_of(label: str) -> str | None:
    """The step a pipeline progress label belongs to ("sensitivity (i-quants)" -> sensitivity)."""
    head = label.split()[0] if label else ""
    return {"write": "write", "download": "write", "calibrate": "calibrate", "sensitivity": "sensitivity",
            "weigh": "weigh", "plan": "plan", "quantize": "quantize", "check": "quantize", "stock": "report",
            "evaluate": "report"}.get(head)


class Cancelled(EdgerunError):
    """The user cancelled the conversion (its finished steps stay cached)."""


@dataclass
class ConvertJob:
    """One conversion's request and live state, shared by the worker thread and the dialog (plain
    attribute writes by the worker, reads by the UI's timer)."""

    name: str
    options: object  # pipeline.ConvertOptions
    clock: Callable[[], float] = time.monotonic
    state: str = "waiting"  # waiting | running | done | failed | cancelled
    step: str | None = None
    label: str = ""
    done: int = 0
    total: int = 0
    step_started: float = 0.0
    finished: dict[str, str] = field(default_factory=dict)  # step -> "done" | "cached"
    labels: list[str] = field(default_factory=list)  # every label seen, in order
    error: str | None = None
    report: dict | None = None
    drafts: list[str] = field(default_factory=list)  # same-vocab models present
    cancel: threading.Event = field(default_factory=threading.Event)
    stop_when: Callable[[], bool] | None = None  # also cancelled when this says so (the app is quitting)

    @property
    def running(self) -> bool:
        return self.state in ("waiting", "running")

    def progress(self, label: str, done: int, total: int) -> None:
        """The pipeline's progress callback (worker thread): record, and stop here if cancelled."""
        if self.cancel.is_set() or (self.stop_when is not None and self.stop_when()):
            raise Cancelled("cancelled")
        now = self.clock()
        step = step_of(label)
        if step is not None and step != self.step:
            if self.step is not None:
                self.finished.setdefault(self.step, "done")
            self.step, self.step_started = step, now
        if label != self.label:
            self.labels.append(label)
            if label.endswith("(cached)") and step is not None:
                self.finished[step] = "cached"
        self.label, self.done, self.total = label, done, total

    def eta_s(self) -> float | None:
        """Seconds left in the current step, from its pace so far (None until it can tell)."""
        if not self.total or not self.done or self.done >= self.total:
            return None
        elapsed = self.clock() - self.step_started
        return elapsed / (self.done / self.total) - elapsed if elapsed > 0.5 else None

    def run(self) -> None:
        """The worker: convert, register, look for draft candidates. Never raises."""
        from edgerun.convert import pipeline
        from edgerun.models import local

        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
        except (AttributeError, OSError):
            pass
        self.state = "running"
        opts = self.options
        try:
            result = pipeline.convert(opts, progress=self.progress)
            if self.step is not None:
                self.finished.setdefault(self.step, "done")
            self.finished.setdefault("report", "done")
            doc = result.to_json()
            doc.pop("tensors", None)
            local.register(self.name, opts.output, origin=opts.src, report=doc, report_path=opts.report_path,
                           plot_path=opts.plot)
            self.report = doc
            self.drafts = draft_candidates(self.name)
            self.state = "done"
        except Cancelled:
            self.state = "cancelled"
        except EdgerunError as exc:
            self.state, self.error = "failed", str(exc)
        except Exception as exc:  # noqa: BLE001  the worker must report, not die silently
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"


def draft_candidates(name: str) -> list[str]:
    """Models present here (catalog or converted) that share NAME's vocabulary: drafts for it."""
    from edgerun.models import fetch, local
    from edgerun.runtime.vocab import check_pair

    target = fetch.resolve(name)
    out = []
    for other, path in local.present():
        if other == name:
            continue
        try:
            check_pair(target, path)
        except EdgerunError:
            continue
        out.append(other)
    return out


def options_from_form(values: dict) -> tuple[str, object]:
    """(name, pipeline.ConvertOptions) from the form's values, checked; ConfigError/ConvertError
    with a one-line reason otherwise. values: src, budget_kind (size|bpw|preset), budget, calib
    (a set name or "file"), calib_file, eval_chunks, name, weigh, stock, i_quants."""
    from edgerun.convert import pipeline, plan
    from edgerun.errors import ConfigError
    from edgerun.models import local

    src = values["src"].strip()
    if not src:
        raise ConfigError("give what to convert: an HF directory, hf://org/repo or an F16/BF16 GGUF")
    name = local.check_name(values["name"].strip())
    budget, kind = values["budget"].strip(), values["budget_kind"]
    if not budget:
        raise ConfigError("give a budget: a size (900MB), bits per weight (3.5) or a preset (Q4_K_M)")
    if kind == "size":
        budget_opt = {"size_bytes": plan.parse_size(budget)}
    elif kind == "bpw":
        try:
            budget_opt = {"bpw": float(budget)}
        except ValueError:
            raise ConfigError(f"bits per weight must be a number such as 3.5, not {budget!r}") from None
    else:
        budget_opt = {"quant": budget.upper()}
    calib = values["calib"]
    if calib == "file":
        calib = values["calib_file"].strip()
        if not calib:
            raise ConfigError("give the calibration text file, or pick a built-in set")
    try:
        eval_chunks = int(values["eval_chunks"].strip())
    except ValueError:
        eval_chunks = -1
    if eval_chunks < 0:
        raise ConfigError(f"evaluation chunks must be a whole number of at least 0, not {values['eval_chunks']!r}")
    output = local.default_output(name)
    output.parent.mkdir(parents=True, exist_ok=True)
    opts = pipeline.ConvertOptions(
        src=src, output=output, calib=(calib,), report_path=output.with_name(f"{name}.report.json"),
        plot=output.with_name(f"{name}.plot.png") if values["stock"] else None,
        eval_chunks=eval_chunks, weigh=values["weigh"], i_quants=values["i_quants"], **budget_opt)
    pipeline.check(opts)
    return name, opts


def report_text(doc: dict, drafts: list[str], plot_path: Path | None = None) -> str:
    """The finished conversion as the dialog shows it."""
    from edgerun.convert.plot import text_chart

    lines = [f"{Path(doc['output']).name}: {doc['size_bytes'] / 1e6:,.1f} MB, {doc['bpw']:.3f} bpw"]
    if doc.get("kld_mean") is not None:
        lines.append(f"vs F16: mean KLD {doc['kld_mean']:.5f}, top-1 {doc['top1_agreement']:.2%}, "
                     f"PPL {doc['ppl']:.3f} (F16 {doc['ppl_ref']:.3f})")
    if doc.get("stock"):
        lines += ["against llama.cpp's stock recipes (bar: log mean KLD):", *text_chart(doc)]
    if plot_path:
        lines.append(f"plot: {plot_path}")
    lines.append("draft candidates (same vocabulary): " + (", ".join(drafts) if drafts else "none present"))
    return "\n".join(lines)


class ConvertScreen(ModalScreen):
    """The Convert… dialog: the form, then the job's steps, progress and ETA, then its report."""

    BINDINGS = [("escape", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        from edgerun.convert.pipeline import CALIB_SETS, EVAL_CHUNKS

        with VerticalScroll(id="dialog"):
            yield Label("Convert a model", classes="dialog-title")
            yield Input(placeholder="HF directory, hf://org/repo or an F16/BF16 GGUF", id="src", compact=True)
            with Horizontal(classes="field"):
                yield Label("budget")
                yield Select([("size", "size"), ("bits per weight", "bpw"), ("preset", "preset")], value="size",
                             id="budget-kind", allow_blank=False, compact=True)
                yield Input(placeholder="900MB, 3.5 or Q4_K_M", id="budget", compact=True)
            with Horizontal(classes="field"):
                yield Label("calibration")
                yield Select([(s, s) for s in CALIB_SETS] + [("a text file", "file")], value=CALIB_SETS[0],
                             id="calib", allow_blank=False, compact=True)
                yield Input(placeholder="text file (for 'a text file')", id="calib-file", compact=True)
            with Horizontal(classes="field"):
                yield Label("eval chunks")  # 512-token chunks of held-out code for the report; 0 skips it
                yield Input(str(EVAL_CHUNKS), placeholder=f"{EVAL_CHUNKS} (0: no quality report)", id="eval-chunks",
                            compact=True)
            with Horizontal(classes="field"):
                yield Label("name")
                yield Input(placeholder="e.g. qwen2.5-coder-1.5b-3bpw", id="name", compact=True)
            for label, key, on_ in (("weigh roles (slower)", "weigh", True),
                                    ("i-quants (off: k-only)", "i-quants", True),
                                    ("vs stock recipes (plot)", "stock", False)):
                with Horizontal(classes="field"):
                    yield Label(label)
                    yield Switch(on_, id=key)
            yield Static("", id="steps")
            yield ProgressBar(id="step-progress", show_eta=False)
            yield Static("", id="convert-report")
            with Horizontal(classes="field", id="draft-row"):
                yield Label("draft")
                yield Select([("none", "none")], value="none", id="convert-draft", allow_blank=False, compact=True)
            with Horizontal(classes="buttons"):
                yield Button("Start", id="start", variant="primary")
                yield Button("Cancel", id="cancel-convert", variant="error")
                yield Button("Use as target", id="use-converted")
                yield Button("Close", id="close-convert")

    @property
    def job(self) -> ConvertJob | None:
        return self.app.convert_job

    def on_mount(self) -> None:
        self._shown_drafts: list[str] | None = None
        self.set_interval(REFRESH_S, self.refresh_job)
        self.refresh_job()
        self.query_one("#src", Input).focus()

    @on(Button.Pressed, "#start")
    def start(self) -> None:
        if self.job is not None and self.job.running:
            self.app.notify("a conversion is already running; cancel it first", severity="warning")
            return
        values = {w.id.replace("-", "_"): w.value for w in self.query(Input)}
        values |= {w.id.replace("-", "_"): w.value for w in self.query(Select) if w.id != "convert-draft"}
        values |= {w.id.replace("-", "_"): w.value for w in self.query(Switch)}
        try:
            name, opts = options_from_form(values)
        except EdgerunError as exc:
            self.app.notify(str(exc), title="cannot convert", severity="error")
            return
        job = ConvertJob(name, opts)
        self.app.convert_job = job
        self._shown_drafts = None
        self.app.run_worker(lambda: self._run(job), thread=True, group="convert", exit_on_error=False)
        self.refresh_job()

    def _run(self, job: ConvertJob) -> None:
        from textual.worker import get_current_worker

        worker = get_current_worker()
        job.stop_when = lambda: worker.is_cancelled  # the app cancels its workers when it quits
        app = self.app
        job.run()
        if worker.is_cancelled:
            return
        say = {"done": (f"{job.name} is converted and registered: F2 picks it", "information"),
               "failed": (f"conversion of {job.name} failed: {job.error}", "error"),
               "cancelled": (f"conversion of {job.name} cancelled; Start resumes it", "warning")}[job.state]
        try:
            app.call_from_thread(app.notify, say[0], severity=say[1], timeout=10)
        except RuntimeError:  # the app has stopped meanwhile
            pass

    @on(Button.Pressed, "#cancel-convert")
    def cancel(self) -> None:
        if self.job is not None and self.job.running:
            self.job.cancel.set()

    @on(Button.Pressed, "#use-converted")
    def use(self) -> None:
        job = self.job
        if job is None or job.state != "done":
            self.app.notify("no finished conversion to use yet", severity="warning")
            return
        self.app.request_load(job.name, self.query_one("#convert-draft", Select).value)
        self.dismiss()

    @on(Button.Pressed, "#close-convert")
    def close(self) -> None:
        self.dismiss()

    def refresh_job(self) -> None:
        job = self.job
        steps, bar = self.query_one("#steps", Static), self.query_one("#step-progress", ProgressBar)
        report = self.query_one("#convert-report", Static)
        self.query_one("#cancel-convert").display = bool(job and job.running)
        self.query_one("#use-converted").display = self.query_one("#draft-row").display = bool(
            job and job.state == "done")
        if job is None:
            steps.update("")
            bar.display = False
            report.update("")
            return
        marks = []
        for s in STEPS:
            mark = {"done": "✓", "cached": "✓ (cached)"}.get(job.finished.get(s, ""), "")
            if not mark and s == job.step and job.running:
                mark = "…"
            marks.append(f"{s} {mark}".strip())
        line = " · ".join(marks)
        if job.running and job.step:
            eta = job.eta_s()
            line += f"\n{job.label}: {job.done}/{job.total}" + (f", about {eta:.0f} s left" if eta is not None else "")
        elif job.state in ("failed", "cancelled"):
            line += f"\n{job.state}" + (f": {job.error}" if job.error else " (finished steps are kept: Start resumes)")
        steps.update(f"{job.name}: {line}")
        bar.display = job.running and job.total > 0
        if bar.display:
            bar.update(total=job.total, progress=job.done)
        if job.state == "done" and job.report is not None and self._shown_drafts != job.drafts:
            self._shown_drafts = list(job.drafts)
            report.update(report_text(job.report, job.drafts, job.options.plot))
            self.query_one("#convert-draft", Select).set_options(
                [("none", "none")] + [(d, d) for d in job.drafts])
