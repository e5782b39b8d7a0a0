"""What each `edgerun` subcommand does. Imported lazily by cli.main so `--help` stays instant."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

from edgerun import settings as defaults
from edgerun.decode.generate import Step
from edgerun.decode.stats import ReplyStats
from edgerun.errors import ConfigError
from edgerun.models import catalog, fetch
from edgerun.models.gguf_check import inspect


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _engine_settings(args) -> defaults.EngineSettings:
    if args.gpu_layers != "auto" and not args.gpu_layers.isdigit():
        raise ConfigError(f"--gpu-layers must be auto or a number, not '{args.gpu_layers}'")
    return defaults.EngineSettings().replace(
        n_ctx=args.ctx, n_batch=args.n_batch, n_threads=args.threads, gpu_layers=args.gpu_layers
    )


def _sampler_settings(args) -> defaults.SamplerSettings:
    return defaults.SamplerSettings(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, seed=args.seed,
    )


def _model_spec(args) -> str:
    return args.model or catalog.load().default_target


def _spec_k(args) -> int | None:
    if args.spec_k == "auto":
        return None
    if not args.spec_k.isdigit():
        raise ConfigError(f"--spec-k must be auto or a number, not '{args.spec_k}'")
    return int(args.spec_k)


def _open_runner(args):
    from edgerun.runner import Runner

    return Runner(_model_spec(args), _engine_settings(args), draft=args.draft, ngram=args.ngram,
                  spec_k=_spec_k(args))


@contextlib.contextmanager
def _sigint_sets(event: threading.Event):
    """While generating, Ctrl-C asks the loop to stop after the current token instead of
    tearing through native code."""
    previous = signal.signal(signal.SIGINT, lambda *_: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stream_to(out, records, stats: ReplyStats) -> str:
    """Write each token's text as it arrives; return the whole reply."""
    parts = []
    for record in records:
        stats.add(record)
        if isinstance(record, Step) and record.text:
            parts.append(record.text)
            out.write(record.text)
            out.flush()
    return "".join(parts)


def cmd_run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with _open_runner(args) as runner:
        if args.raw:
            tokens = runner.raw_tokens(prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            tokens = runner.chat_tokens(messages + [{"role": "user", "content": prompt}])
        stats = ReplyStats()
        cancel = threading.Event()
        with _sigint_sets(cancel):
            _stream_to(sys.stdout, runner.stream(tokens, _sampler_settings(args),
                                                 max_tokens=args.max_tokens, cancel=cancel), stats)
        sys.stdout.write("\n")
        sys.stdout.flush()
    _err(f"[{stats.line()}]")
    if args.stats_json:
        _write_json(args.stats_json, stats.as_json() | {"draft": runner.draft_spec or "none"})
    return 130 if stats.finish == "cancelled" else 0


def _write_json(path: Path, data: dict) -> None:
    """Atomic: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def cmd_chat(args) -> int:
    if args.plain or not sys.stdin.isatty() or not sys.stdout.isatty():
        return _plain_chat(args)
    from edgerun.tui.app import EdgerunApp

    draft = None if args.draft == defaults.DRAFT else args.draft  # the app's saved choice otherwise
    EdgerunApp(args.model, draft=draft, engine=_engine_settings(args)).run()
    return 0


def _plain_chat(args) -> int:
    sampling = _sampler_settings(args)
    with _open_runner(args) as runner:
        _err(f"edgerun chat: {runner.info.name} ({runner.plan.reason}). Ctrl-C stops a reply, "
             "/reset starts over, Ctrl-D or /exit quits.")
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        while True:
            try:
                line = input("> ")
            except EOFError:
                _err("")
                return 0
            except KeyboardInterrupt:
                _err("")
                continue
            if not line.strip():
                continue
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/reset":
                messages = messages[:1] if args.system else []
                _err("(conversation cleared)")
                continue
            messages.append({"role": "user", "content": line})
            reply = _chat_turn(runner, messages, sampling, args.max_tokens)
            messages.append({"role": "assistant", "content": reply})


def _chat_turn(runner, messages, sampling, max_tokens) -> str:
    stats = ReplyStats()
    cancel = threading.Event()
    with _sigint_sets(cancel):
        records = runner.stream(runner.chat_tokens(messages), sampling, max_tokens=max_tokens, cancel=cancel)
        reply = _stream_to(sys.stdout, records, stats)
    sys.stdout.write("\n")
    note = " (stopped)" if stats.finish == "cancelled" else ""
    _err(f"[{stats.line()}]{note}")
    return reply


def cmd_pull(args) -> int:
    cat = catalog.load()
    if args.default:
        for entry in cat.defaults:
            print(fetch.pull(entry, say=_err))
        return 0
    if not args.model:
        raise ConfigError("name a model to pull (see `edgerun list`), or pass --default")
    if args.model.startswith("hf://"):
        print(fetch.pull_uri(args.model))
        return 0
    entry = cat.find(args.model)
    if entry is not None:
        print(fetch.pull(entry, say=_err))
        return 0
    path = fetch.resolve(args.model)  # a local file: validate it, print where it is
    print(inspect(path).path)
    return 0


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def cmd_list(args) -> int:
    rows = [("NAME", "ROLE", "SIZE", "STATE", "PATH")]
    for e in catalog.load().entries:
        present = fetch.is_present(e)
        state = "verified" if fetch.is_verified(e) else ("unverified" if present else "not pulled")
        rows.append((e.name, e.role, _gb(e.size), state, str(fetch.local_file(e)) if present else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_rm(args) -> int:
    entry = catalog.load().get(args.model)
    if fetch.remove(entry):
        _err(f"removed {entry.name}")
    else:
        _err(f"{entry.name} was not downloaded; nothing to remove")
    return 0


def cmd_doctor(args) -> int:
    from edgerun import doctor

    print(doctor.report(args.model or catalog.load().default_target))
    return 0
