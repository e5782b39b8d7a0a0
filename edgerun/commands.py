"""What each `edgerun` subcommand does. Imported lazily by cli.main so `--help` stays instant."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

from edgerun import settings as defaults
from edgerun.errors import ConfigError, EngineError
from edgerun.models import catalog, fetch

# The decode chain (llama-cpp-python, jinja2) and the GGUF checker (gguf-py, numpy) are imported
# where a command first needs them: together ~0.25 s of CPU that a bad flag, an unknown model,
# `list` or `rm` does not pay. A model file is checked by Runner alone, in the order it sets.


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _engine_settings(args) -> defaults.EngineSettings:
    if args.gpu_layers != "auto" and not args.gpu_layers.isdigit():
        raise ConfigError(f"--gpu-layers must be auto or a number, not '{args.gpu_layers}'")
    return defaults.EngineSettings().replace(
        n_ctx=args.ctx, n_batch=args.n_batch, n_threads=args.threads, gpu_layers=args.gpu_layers,
        max_vram=int(args.max_vram * 2**30) if args.max_vram is not None else None,
        rpc=args.rpc, rpc_timeout_s=args.rpc_timeout,
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
    spec, settings, spec_k = _model_spec(args), _engine_settings(args), _spec_k(args)
    from edgerun.runner import Runner

    runner = Runner(spec, settings, draft=args.draft, ngram=args.ngram, spec_k=spec_k)
    for note in runner.notes:
        _err(f"edgerun: note: {note}")
    return runner


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
    from edgerun.decode.generate import Step

    parts = []
    for record in records:
        stats.add(record)
        if isinstance(record, Step) and record.text:
            parts.append(record.text)
            out.write(record.text)
            out.flush()
    return "".join(parts)


def _constraint(args):
    """--json-schema or --grammar as a Constraint (None: neither); a bad schema fails here, before
    the model loads (a grammar llama.cpp refuses, when the reply starts)."""
    if args.json_schema is not None and args.grammar is not None:
        raise ConfigError("give one of --json-schema and --grammar, not both")
    if args.json_schema is None and args.grammar is None:
        return None
    from edgerun.decode import constrain  # llama-cpp-python: only when a constraint is given

    if args.json_schema is not None:
        return constrain.json_schema(constrain.schema_arg(args.json_schema))
    if args.grammar is not None:
        return constrain.gbnf(constrain.read_text(args.grammar, "--grammar"), f"the grammar in {args.grammar}")
    return None


def cmd_run(args) -> int:
    if args.raw and args.system:
        raise ConfigError("--system has no effect with --raw (no chat template); drop one of them")
    constraint = _constraint(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with _open_runner(args) as runner:
        if args.raw:
            tokens = runner.raw_tokens(prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            tokens = runner.chat_tokens(messages + [{"role": "user", "content": prompt}])
        states = _state_cache(args, runner)
        resumed = _resume(states, tokens)
        from edgerun.decode.stats import ReplyStats

        stats = ReplyStats()
        cancel = threading.Event()
        with _sigint_sets(cancel):
            _stream_to(sys.stdout, runner.stream(tokens, _sampler_settings(args), max_tokens=args.max_tokens,
                                                 cancel=cancel, constraint=constraint), stats)
        sys.stdout.write("\n")
        sys.stdout.flush()
        # the prompt's state, for a later run that starts the same way (a long --system or file);
        # not when it was mostly restored: the state it came from serves that run as well
        if states is not None and stats.prompt_evaluated >= states.min_tokens:
            _save(states, upto=len(tokens))
    _err(f"[{_stats_line(stats, resumed)}]")
    if args.stats_json:
        _write_json(args.stats_json, stats.as_json() | {"draft": runner.draft_spec or "none",
                                                        "resumed": resumed.as_json()})
    return 130 if stats.finish == "cancelled" else 0


def _state_cache(args, runner):
    """The saved KV states for this runner, or None (--no-kv-cache, or a cap of 0 GiB)."""
    from edgerun import user_settings
    from edgerun.resume import StateCache
    from edgerun.runtime.kvstate import KvStore

    cap = user_settings.load()[0].kv_cache_bytes
    if args.no_kv_cache or cap <= 0:
        return None
    return StateCache(runner, KvStore(max_bytes=cap), min_tokens=defaults.KV_CACHE_MIN_TOKENS)


def _resume(states, tokens: list[int], saved=None):
    from edgerun.resume import Resumed

    if states is None:
        return Resumed()
    resumed = states.resume(tokens, saved)
    if resumed.note:
        _err(f"edgerun: note: {resumed.note}")
    return resumed


def _save(states, *, upto: int | None = None) -> list:
    """Save the runner's KV state; a failure (a full disk) is a note, never a lost reply."""
    try:
        return states.save(upto=upto)
    except (OSError, EngineError) as e:
        _err(f"edgerun: note: the KV state was not saved ({e}); a later run will prefill")
        return []


def _stats_line(stats: ReplyStats, resumed) -> str:
    return stats.line() + (f"; {resumed.line()}" if resumed.line() else "")


def _write_json(path: Path, data: dict) -> None:
    """Atomic: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def cmd_chat(args) -> int:
    engine = _engine_settings(args)
    overrides = _chat_overrides(args)
    if args.plain or not sys.stdin.isatty() or not sys.stdout.isatty():
        from edgerun.cli import chat_flag_defaults

        unset = {k: v for k, v in chat_flag_defaults().items() if getattr(args, k) is None}
        return _plain_chat(argparse.Namespace(**(vars(args) | unset)))
    from edgerun.tui.app import EdgerunApp

    app = EdgerunApp(args.model, engine=engine, overrides=overrides, kv_cache=not args.no_kv_cache)
    app.run()
    return app.return_code or 0  # non-zero when the app ended on an error (e.g. an unusable history)


# chat flag -> the saved setting it overrides in the app (the rest have no saved setting)
_CHAT_SAVED = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_tokens",
               "system": "system_prompt", "draft": "draft", "spec_k": "spec_k", "ngram": "ngram"}
_CHAT_SAMPLING = {"min_p": "min_p", "repeat_penalty": "repeat_penalty", "seed": "seed"}


def _chat_overrides(args):
    """The chat flags actually given (checked here, so a bad one fails before the app starts)."""
    from edgerun.user_settings import Overrides

    saved = {key: getattr(args, flag) for flag, key in _CHAT_SAVED.items() if getattr(args, flag) is not None}
    if "spec_k" in saved:
        k = _spec_k(args)
        saved["spec_k"] = "auto" if k is None else k
    if "system_prompt" in saved:
        saved["system_prompt"] = saved["system_prompt"] or None  # --system "": the template's own
    sampling = {key: getattr(args, flag) for flag, key in _CHAT_SAMPLING.items() if getattr(args, flag) is not None}
    return Overrides(saved, sampling)


def _plain_chat(args) -> int:
    sampling = _sampler_settings(args)
    with _open_runner(args) as runner:
        states, saved = _state_cache(args, runner), []
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
            reply = _chat_turn(runner, messages, sampling, args.max_tokens, states)
            messages.append({"role": "assistant", "content": reply})
            if states is not None:
                saved = _save_replacing(states, saved)


def _chat_turn(runner, messages, sampling, max_tokens, states=None) -> str:
    """One reply. With `states` (no history here: the store's best prefix), a restarted REPL with
    the same system prompt and opening turns restores them."""
    from edgerun.decode.stats import ReplyStats

    stats = ReplyStats()
    cancel = threading.Event()
    tokens = runner.chat_tokens(messages)
    resumed = _resume(states, tokens)
    with _sigint_sets(cancel):
        records = runner.stream(tokens, sampling, max_tokens=max_tokens, cancel=cancel)
        reply = _stream_to(sys.stdout, records, stats)
    sys.stdout.write("\n")
    note = " (stopped)" if stats.finish == "cancelled" else ""
    _err(f"[{_stats_line(stats, resumed)}]{note}")
    return reply


def _save_replacing(states, before: list) -> list:
    """Save the conversation's state and remove the one saved after the turn before (a prefix
    of this one: nothing would choose it over the new one)."""
    saved = _save(states)
    for old in {s.name for s in before} - {s.name for s in saved}:
        states.store.remove(states.store.path(old))
    return saved


def cmd_cache(args) -> int:
    """`edgerun cache`: list the saved KV states; `clear` removes them all, `rm NAME...` some.
    The history forgets the removed ones (a conversation then prefills, silently)."""
    from edgerun import user_settings
    from edgerun.runtime.kvstate import KvStore

    store = KvStore(max_bytes=user_settings.load()[0].kv_cache_bytes)
    if args.action == "clear":
        from edgerun import ngram_pool
        from edgerun.runtime import cost_table

        n = store.clear()
        _forget_states(None)
        removed = [f"{n} saved KV state(s) from {store.root}"]
        for count, what, where in ((ngram_pool.clear(), "n-gram pool(s)", ngram_pool.default_dir()),
                                   (cost_table.clear(), "load-time cost table(s)", cost_table.default_dir())):
            if count:
                removed.append(f"{count} {what} from {where}")
        _err("removed " + " and ".join(removed))
        return 0
    if args.action == "rm":
        if not args.names:
            raise ConfigError("name the states to remove (see `edgerun cache`), or use `edgerun cache clear`")
        try:
            found = [store.path(name) for name in args.names]
        except ValueError as e:
            raise ConfigError(f"{e}; see `edgerun cache` for the names") from None
        missing = [p.stem for p in found if not p.is_file()]
        if missing:
            raise ConfigError(f"no saved state named {', '.join(missing)}; see `edgerun cache` for the names")
        for path in found:
            store.remove(path)
        _forget_states([p.name for p in found])
        _err(f"removed {len(found)} saved KV state(s)")
        return 0
    _print_states(store, _state_owners())
    return 0


def _state_owners() -> dict[str, list[str]]:
    from edgerun.errors import HistoryError
    from edgerun.history import History

    try:
        with History() as h:
            return h.kv_state_owners()
    except HistoryError:
        return {}  # an unusable history names no owners; the states are still listed


def _forget_states(names: list[str] | None) -> None:
    from edgerun.errors import HistoryError
    from edgerun.history import History

    with contextlib.suppress(HistoryError):
        with History() as h:
            h.forget_kv_states(names)


def _print_states(store, owners: dict[str, list[str]]) -> None:
    import time

    entries = store.entries()
    rows = [["NAME", "MODEL", "TOKENS", "SIZE", "LAST USED", "CONVERSATION"]]
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used))
        rows.append([e.name, e.label, f"{e.n_tokens:,}", _mb(e.size), used, ", ".join(owners.get(e.path.name, [])) or "-"])
    if entries:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.rjust(w) if i in (2, 3) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    cap = f"{store.max_bytes / 2**30:g} GiB cap (kv_cache_gib in {_settings_path()})"
    print(f"{len(entries)} saved KV state(s), {_mb(store.total_bytes())} of the {cap}, in {store.root}")


def _settings_path() -> Path:
    from edgerun import user_settings

    return user_settings.default_path()


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def cmd_serve(args) -> int:
    from edgerun.runner import Runner
    from edgerun.serve.command import serve

    def load():
        settings = _engine_settings(args).replace(n_seq=args.parallel)
        runner = Runner(_model_spec(args), settings, draft=args.draft, ngram=args.ngram, spec_k=_spec_k(args))
        for note in runner.notes:
            _err(f"edgerun: note: {note}")
        return runner
    return serve(args, load)


def cmd_pull(args) -> int:
    cat = catalog.load()
    if args.default and args.model:
        raise ConfigError(f"pull either --default or '{args.model}', not both")
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
    from edgerun.models.gguf_check import inspect

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
    from edgerun.models import local

    made = local.load()
    for m in made:
        rows.append((m.name, "converted", _gb(m.summary.get("size_bytes") or 0), "local", m.path))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if made:
        print("\nconverted here:")
        for m in made:
            print(f"  {m.name}: from {m.origin}; {m.describe()}"
                  + (f"; report {m.report_path}" if m.report_path else "") + (f"; plot {m.plot_path}" if m.plot_path else ""))
    return 0


def cmd_rm(args) -> int:
    from edgerun.models import local

    known = catalog.load()
    if known.find(args.model) is None and (removed := local.remove(args.model)) is not None:
        model, kept = removed
        _err(f"removed {model.name}" + (f"; kept {', '.join(map(str, kept))} (outside edgerun's folders:"
                                         " yours to delete)" if kept else ""))
        return 0
    entry = known.get(args.model)
    if fetch.remove(entry):
        _err(f"removed {entry.name}")
    else:
        _err(f"{entry.name} was not downloaded; nothing to remove")
    return 0


def cmd_doctor(args) -> int:
    from edgerun import doctor

    print(doctor.report(args.model or catalog.load().default_target, args.rpc))
    return 0


def cmd_rpc_server(args) -> int:
    from edgerun import rpc_server

    return rpc_server.run(args)


def cmd_bench(args) -> int:
    from edgerun import bench

    if args.scenario:
        from edgerun.bench import scenario

        return scenario.main(args, say=_err)
    model, k = _model_spec(args), _spec_k(args)
    configs = (bench.BenchConfig("A", model, args.draft, args.ngram, k),
               bench.BenchConfig("B", args.vs or model, args.vs_draft, args.vs_ngram, k))
    engine = defaults.EngineSettings().replace(n_ctx=args.ctx, n_threads=args.threads)
    sampling = defaults.SamplerSettings().replace(temperature=args.temp, seed=args.seed)
    prompts = bench.load_prompts(args.prompts)
    cancel = threading.Event()
    with _sigint_sets(cancel):  # Ctrl-C ends the current run; what finished is reported
        result = bench.run(configs, prompts, engine, sampling, max_tokens=args.max_tokens,
                           repeat=args.repeat, n_batches=args.n_batch, cancel=cancel, say=_err)
    doc = result.as_json()
    print(bench_table(doc), flush=True)
    if args.json:
        _write_json(args.json, doc)
    if args.plot and result.runs:
        bench.plot(result, args.plot)
    return 130 if result.partial else 0


def _align(rows: list[list[str]]) -> list[str]:
    """Plain-text columns: the first left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _num(value, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _ratio(r: dict | None) -> str:
    return "-" if r is None else f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def bench_table(doc: dict) -> str:
    """The terminal report of a bench, made from its JSON document."""
    from edgerun import bench

    s = doc["settings"]
    lines = [f"{lab}: {bench.describe(c)}" for lab, c in doc["configs"].items()]
    lines.append(f"{len(s['prompts'])} prompts x {s['repeat']} repeats, {s['max_tokens']} tokens,"
                 f" temperature {s['temperature']}, seed {s['seed']}; {s['runs_done']}/{s['runs_planned']} runs")
    lines += ["", *_align(_bench_config_rows(doc)), "", *_align(_bench_prompt_rows(doc))]
    labels = list(doc["configs"])
    if doc["n_batch_ttft"]:
        rows = [["n_batch", *(f"{lab} TTFT ms" for lab in labels)]]
        rows += [[nb, *(_num(t[lab] and t[lab]["median"], 1000) for lab in labels)]
                 for nb, t in doc["n_batch_ttft"].items()]
        lines += ["", *_align(rows)]
    if doc["warnings"]:
        lines += ["", *(f"warning: {w}" for w in doc["warnings"])]
    if doc["partial"]:
        lines.append("partial: stopped early; the numbers cover the runs that finished")
    return "\n".join(lines)


def _bench_config_rows(doc: dict) -> list[list[str]]:
    cfg, ratios = doc["configs"], doc["ratios"]
    labels = list(cfg)
    rows = [["", *labels, "B/A (min-max)"]]
    for name, key, scale in (("TTFT ms", "ttft_s", 1000), ("TPOT ms", "tpot_s", 1000),
                             ("decode tok/s", "decode_tok_s", 1), ("prompt tok/s", "prompt_tok_s", 1)):
        rows.append([name, *(_num(cfg[lab][key], scale) for lab in labels), _ratio(ratios.get(key))])
    for q in ("p50", "p90", "p99"):
        rows.append([f"latency {q} ms", *(_num(cfg[lab]["latency_s"][q], 1000) for lab in labels), ""])
    rows.append(["RSS added MiB", *(_num(cfg[lab]["rss_bytes"], 2**-20, 0) for lab in labels), ""])
    if any(cfg[lab]["acceptance_rate"] for lab in labels):
        rows.append(["acceptance %", *(_num(cfg[lab]["acceptance_rate"], 100, 0) for lab in labels), ""])
        rows.append(["mean accepted", *(_num(cfg[lab]["mean_accepted_len"], 1, 2) for lab in labels), ""])
    return rows


def _bench_prompt_rows(doc: dict) -> list[list[str]]:
    labels = list(doc["configs"])
    rows = [["prompt", *(f"{lab} tok/s" for lab in labels), "agreement", "diverges at"]]
    for name, p in doc["per_prompt"].items():
        a = doc["agreement"].get(name) or {}
        div = a.get("first_divergence")
        rows.append([name, *(_num(p[lab]["decode_tok_s"]) for lab in labels), _num(a.get("rate"), 1, 2),
                     "-" if div is None else str(div)])
    return rows


def cmd_convert(args) -> int:
    from edgerun.convert import pipeline
    from edgerun.convert.progress import Bar

    opts = _convert_options(args)
    bar = Bar()
    try:
        result = pipeline.convert(opts, progress=bar)
    finally:
        bar.close()
    print(result.table(), flush=True)
    if opts.report_path:
        _err(f"report: {opts.report_path}")
    if opts.plot:
        _err(f"plot: {opts.plot}")
    if args.name:
        from edgerun.models import local

        local.register(args.name, opts.output, origin=opts.src, report=result.to_json(),
                       report_path=opts.report_path, plot_path=opts.plot)
        _err(f"registered as {args.name}: edgerun run -m {args.name}")
    return 0


def _convert_options(args):
    """The options of `edgerun convert`, checked before any long step: a bad one is a one-line
    error with exit code 2."""
    from edgerun.convert import pipeline, plan
    from edgerun.errors import ConvertError

    if not args.src:
        raise ConfigError("name what to convert: edgerun convert SRC -o OUT.gguf --quant Q4_K_M")
    if not args.output and args.name:
        from edgerun.models import local

        args.output = local.default_output(args.name)
        args.output.parent.mkdir(parents=True, exist_ok=True)
    elif args.name:
        from edgerun.models import local

        local.check_name(args.name)
    if not args.output:
        raise ConfigError("name the file to write with -o OUT.gguf (or --name NAME)")
    calib = tuple(s.strip() for arg in (args.calib or []) for s in arg.split(",") if s.strip())
    try:
        options = dict(src=args.src, output=args.output, quant=args.quant, keep_f16=args.keep_f16,
                       report_path=args.report, calib=calib or pipeline.ConvertOptions.calib,
                       weigh=args.weigh, i_quants=not args.k_quants_only, plot=args.plot)
        if args.bpw is not None:
            options["bpw"] = _number("--bpw", args.bpw, float)
        if args.size is not None:
            options["size_bytes"] = plan.parse_size(args.size)
        if args.eval_chunks is not None:
            options["eval_chunks"] = _number("--eval-chunks", args.eval_chunks, int, minimum=0)
        if args.threads is not None:
            options["n_threads"] = _number("--threads", args.threads, int, minimum=1)
        opts = pipeline.ConvertOptions(**options)
        pipeline.check(opts)
    except ConvertError as exc:
        raise ConfigError(str(exc)) from None
    return opts


def _number(flag: str, text: str, kind, *, minimum: float = 0):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value >= minimum:  # `not >=` also catches nan
        raise ConfigError(f"{flag} must be a {'whole ' if kind is int else ''}number of at least {minimum},"
                          f" not '{text}'")
    return value
