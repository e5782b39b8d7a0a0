"""Convert… in the chat app, driven by Textual's Pilot on the tiny models: the form, a cancelled run
that a second run resumes, the chat answering meanwhile, the report, the registry (`edgerun list`)
and the new model loaded as target with a same-vocab draft offered."""

from __future__ import annotations

import threading

import pytest

from edgerun import user_settings
from edgerun.models import local
from edgerun.settings import THREADS_ENV, EngineSettings
from edgerun.tui.app import EdgerunApp
from edgerun.tui.convert import STEPS, ConvertJob, ConvertScreen, options_from_form, step_of
from edgerun.tui.screens import ModelScreen
from edgerun.tui.widgets import Transcript
from testkit.cli import run_cli
from testkit.tui import notes, wait_for

CALIB = "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 12


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGERUN_KV_DIR", str(tmp_path / "kv"))
    return tmp_path / "home"




def form(tmp_path, src, changes=None):
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    # one evaluation chunk: the report's figures need one, not the default's sixteen
    values = {"src": str(src), "budget_kind": "bpw", "budget": "6", "calib": "file", "calib_file": str(calib),
              "eval_chunks": "1", "name": "tiny-6bpw", "weigh": False, "i_quants": True, "stock": False}
    return values | (changes or {})


def fill(screen, values):
    for key, value in values.items():
        screen.query_one("#" + key.replace("_", "-")).value = value


def test_form_errors_are_one_line_and_steps_are_mapped(home, tmp_path):
    from edgerun.errors import EdgerunError

    src = tmp_path / "nowhere"
    for changes, needle in (({"src": ""}, "give what to convert"), ({"name": "a/b"}, "model name"),
                            ({"name": "qwen2.5-coder-0.5b"}, "catalog model"), ({"budget": "x"}, "a number"),
                            ({"budget_kind": "size", "budget": "lots"}, "is not a size"),
                            ({"calib_file": ""}, "calibration text file"),
                            ({"eval_chunks": "many"}, "evaluation chunks"), ({"eval_chunks": "-1"}, "evaluation chunks"),
                            ({}, "no such file or directory")):
        with pytest.raises(EdgerunError, match=needle):
            options_from_form(form(tmp_path, src, changes))
    assert [step_of(lab) for lab in ("write GGUF", "calibrate (cached)", "sensitivity (i-quants)", "weigh roles",
                                     "plan", "quantize", "stock Q4_K_M", "evaluate")] == [
        "write", "calibrate", "sensitivity", "weigh", "plan", "quantize", "report", "report"]

    # the ETA is the step's pace so far, on an injected clock
    now = [100.0]
    job = ConvertJob("x", None, clock=lambda: now[0])
    job.progress("calibrate", 0, 10)
    now[0] += 4.0
    job.progress("calibrate", 2, 10)
    assert job.eta_s() == pytest.approx(16.0)
    job.progress("sensitivity", 1, 5)
    assert job.finished == {"calibrate": "done"} and job.step == "sensitivity"
    job.cancel.set()
    with pytest.raises(Exception, match="cancelled"):
        job.progress("sensitivity", 2, 5)


@pytest.mark.slow
async def test_convert_in_the_app_cancel_resume_report_register_and_use(home, tmp_path, tiny_model, capsys,
                                                                        monkeypatch):
    from edgerun.tui import convert

    # the worker yields the CPU to the chat; here, beside other tests' load, it must not starve
    monkeypatch.setattr(convert, "WORKER_NICE", 0)
    # one llama.cpp thread for the chat, the conversion and its quantizer, as under two xdist
    # workers: on the tiny model a second thread mostly spins at ggml's barriers (0.5-2 CPU seconds
    # of this test on a busy 2-core machine)
    monkeypatch.setenv(THREADS_ENV, "1")
    # the tiny model converts in a moment: the worker waits at the step after calibration until the
    # cancel button has been pressed, so that the press lands mid-conversion however loaded the machine
    pressed, record = threading.Event(), ConvertJob.progress

    def progress(job, label, done, total):
        record(job, label, done, total)
        if step_of(label) == "sensitivity":
            pressed.wait(60)
    monkeypatch.setattr(ConvertJob, "progress", progress)
    from testkit.tiny import write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "hf", "qwen2")
    # a same-vocab model already here (the chat's tiny model, registered): the draft to be offered
    local.register("tiny-chat", tiny_model, origin="test", report={})
    # a short reply: the chat has only to answer while the conversion runs, not write 512 tokens
    user_settings.save(user_settings.UserSettings().replace(max_tokens=16))
    app = EdgerunApp(str(tiny_model), draft="none", engine=EngineSettings(n_ctx=512, gpu_layers="0"))
    async with app.run_test(size=(120, 50)) as pilot:
        await wait_for(pilot, lambda: app.session is not None)
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen))
        await pilot.click("#convert")
        await wait_for(pilot, lambda: isinstance(app.screen, ConvertScreen))
        screen = app.screen
        fill(screen, form(tmp_path, src))
        screen.query_one("#start").press()
        await wait_for(pilot, lambda: app.convert_job is not None and "calibrate" in app.convert_job.finished)
        screen.query_one("#cancel-convert").press()
        first = app.convert_job
        await wait_for(pilot, first.cancel.is_set)
        pressed.set()
        await wait_for(pilot, lambda: not first.running)
        assert first.state == "cancelled" and "report" not in first.finished
        await wait_for(pilot, lambda: "cancelled" in notes(app))
        assert not local.find("tiny-6bpw")

        # a second run resumes: the written GGUF and the imatrix are reused; the chat answers meanwhile
        fill(screen, {"stock": True})
        screen.query_one("#start").press()
        await wait_for(pilot, lambda: app.convert_job is not first)
        job = app.convert_job
        screen.query_one("#close-convert").press()  # the dialog closes; the conversion goes on
        await wait_for(pilot, lambda: not isinstance(app.screen, ConvertScreen))
        assert job.running
        app.query_one("#input").text = "hello"
        app.query_one("#input").focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: any(e.role == "assistant" and e.status != "streaming"
                                          for e in app.query_one(Transcript).entries))
        await wait_for(pilot, lambda: not job.running)
        assert job.state == "done", job.error
        assert "write GGUF (cached)" in job.labels and "calibrate (cached)" in job.labels
        assert set(job.finished) == set(STEPS) - {"weigh"}  # weigh was switched off
        assert job.drafts == ["tiny-chat"]

        # the report, with the stock recipes it was compared with
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen))
        table = app.screen.query_one("#models")
        assert "tiny-6bpw" in [k.value for k in table.rows]
        await pilot.click("#convert")
        await wait_for(pilot, lambda: isinstance(app.screen, ConvertScreen))
        await pilot.pause(0.3)
        shown = str(app.screen.query_one("#convert-report").render())
        assert "mean KLD" in shown and "top-1" in shown and "PPL" in shown
        assert "stock recipes" in shown and "draft candidates (same vocabulary): tiny-chat" in shown
        model = local.find("tiny-6bpw")
        assert model.origin == str(src) and model.summary["kld_mean"] == job.report["kld_mean"]
        assert model.plot_path and open(model.plot_path, "rb").read(4) == b"\x89PNG"
        assert f"plot: {model.plot_path}" in shown

        # picked as target right away, with the offered draft
        app.screen.query_one("#convert-draft").value = "tiny-chat"
        app.screen.query_one("#use-converted").press()
        await wait_for(pilot, lambda: app.model_spec == "tiny-6bpw" and app.session is not None
                       and app.session.runner.draft_spec == "tiny-chat")

    listed = run_cli(capsys, "list")
    assert listed.returncode == 0
    assert "tiny-6bpw" in listed.stdout and f"from {src}" in listed.stdout and "KLD" in listed.stdout
