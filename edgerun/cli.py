"""The `edgerun` command. The only place (with the TUI) that turns errors into exit codes."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

from edgerun import settings as defaults
from edgerun.bench import BenchSettings
from edgerun.errors import EdgerunError
from edgerun.user_settings import TOP_K_MAX

SEED_MAX = 2**64 - 1  # the native RNG's seed is 64 bits


def _at_least_one(text: str) -> int:
    """argparse type of a count: a whole number of 1 or more (argparse prints the one-line error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return value


def _number(low: float, high: float = math.inf, *, low_open: bool = False, whole: bool = False):
    """argparse type of a finite number in [low, high] ((low, high] with low_open): a value the
    native sampler cannot take is an argparse error here, not a failure in llama.cpp later."""
    def parse(text: str):
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            value = math.nan
        if not (low < value if low_open else low <= value) or not value <= high:  # `not <=` catches nan
            kind = "a whole number" if whole else "a number"
            bounds = f"above {low}" if low_open else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind} {bounds}"
                                             + (f" and at most {high}" if high < math.inf else ""))
        return value
    return parse


# chat's flags that override the app's saved settings; its parser leaves them None when not given
CHAT_OVERRIDES = ("temp", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "max_tokens", "system",
                  "draft", "spec_k", "ngram")


def chat_flag_defaults() -> dict:
    """What each of chat's override flags means when it is not given."""
    p = argparse.ArgumentParser(add_help=False)
    _add_model_args(p, positional=True)
    _add_sampling_args(p)
    return {k: v for k, v in vars(p.parse_args([])).items() if k in CHAT_OVERRIDES}


def _add_model_args(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", nargs="?", default=None, help="catalog name, hf:// URI or .gguf path")
    else:
        p.add_argument("-m", "--model", default=None, help="catalog name, hf:// URI or .gguf path")
    e = defaults.EngineSettings()
    p.add_argument("--ctx", type=int, default=e.n_ctx, help=f"context size in tokens (default {e.n_ctx})")
    p.add_argument("--n-batch", type=_at_least_one, default=e.n_batch, help="prompt tokens per llama_decode call")
    p.add_argument("--threads", type=_at_least_one, default=None,
                   help="CPU threads (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--gpu-layers", default=e.gpu_layers, help="auto, 0, or a layer count")
    p.add_argument("--max-vram", type=_number(0), default=None, metavar="GIB",
                   help="GiB of VRAM the offload plan may use (default: all that is free)")
    p.add_argument("--draft", default=defaults.DRAFT,
                   help="draft model: a catalog name or path, auto (the catalog's recommended draft where it pays), none")
    p.add_argument("--spec-k", default="auto", help="draft tokens per round: auto (the governor) or a number")
    p.add_argument("--ngram", action="store_true", help="prompt-lookup drafting (no model; pays when replies repeat the prompt)")
    p.add_argument("--rpc", default=e.rpc, metavar="HOST:PORT[,...]",
                   help="also place the model's layers on these `edgerun rpc-server`s (ggml's RPC backend)")
    p.add_argument("--rpc-timeout", type=_number(1), default=e.rpc_timeout_s, metavar="S",
                   help=f"seconds an rpc server may stay silent in a request before the reply ends with an error"
                        f" (default {e.rpc_timeout_s:g})")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    s = defaults.SamplerSettings()
    p.add_argument("--temp", type=_number(0), default=s.temperature,
                   help=f"temperature (default {s.temperature}; 0 = greedy)")
    p.add_argument("--top-p", type=_number(0, 1, low_open=True), default=s.top_p)
    p.add_argument("--top-k", type=_number(0, TOP_K_MAX, whole=True), default=s.top_k, help="0 = off")
    p.add_argument("--min-p", type=_number(0, 1), default=s.min_p)
    p.add_argument("--repeat-penalty", type=_number(0, low_open=True), default=s.repeat_penalty)
    p.add_argument("--seed", type=_number(0, SEED_MAX, whole=True), default=None, help="RNG seed (default: random)")
    p.add_argument("-n", "--max-tokens", type=_at_least_one, default=defaults.MAX_TOKENS)
    p.add_argument("--system", default=defaults.DEFAULT_SYSTEM_PROMPT, help="system prompt")


def _add_kv_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-kv-cache", action="store_true",
                   help="neither restore nor save KV states (see `edgerun cache`)")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, not '{text}'")
    return values


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    b, e = BenchSettings(), defaults.EngineSettings()
    p.add_argument("-m", "--model", default=None, help="configuration A: catalog name, hf:// URI or .gguf path")
    p.add_argument("--vs", default=None, help="configuration B's model (default: A's model)")
    p.add_argument("--draft", default=b.draft, help=f"A's draft model: a name or path, auto, none (default {b.draft})")
    p.add_argument("--vs-draft", default=b.draft, help=f"B's draft model (default {b.draft})")
    p.add_argument("--ngram", action="store_true", help="prompt-lookup drafting for A")
    p.add_argument("--vs-ngram", action="store_true", help="prompt-lookup drafting for B")
    p.add_argument("--spec-k", default="auto", help="draft tokens per round, both sides: auto or a number")
    p.add_argument("--prompts", default=b.prompts, help=f"code, chat, all, or a FILE: one prompt per paragraph,"
                   f" or a .toml like the shipped one (default {b.prompts})")
    p.add_argument("-n", "--max-tokens", type=_at_least_one, default=b.max_tokens,
                   help=f"tokens per reply (default {b.max_tokens})")
    p.add_argument("--temp", type=_number(0), default=b.temperature,
                   help=f"temperature (default {b.temperature}: greedy, so outputs compare token for token)")
    p.add_argument("--seed", type=_number(0, SEED_MAX, whole=True), default=b.seed, help=f"RNG seed (default {b.seed})")
    p.add_argument("--repeat", type=_at_least_one, default=b.repeat,
                   help=f"runs per prompt and configuration (default {b.repeat})")
    p.add_argument("--n-batch", type=_int_list, default=[], metavar="N[,N...]",
                   help="also measure the longest prompt's TTFT for each n_batch, e.g. 128,512")
    p.add_argument("--ctx", type=int, default=e.n_ctx, help=f"context size in tokens (default {e.n_ctx})")
    p.add_argument("--threads", type=_at_least_one, default=None,
                   help="CPU threads (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of latencies and tok/s here")


def _add_bench_scenarios(p: argparse.ArgumentParser) -> None:
    from edgerun.bench import scenario

    sub = p.add_subparsers(dest="scenario", metavar="SCENARIO", title="scenarios (edgerun bench SCENARIO -h)")
    scenario.add_parsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgerun", description="Local LLM runner on llama.cpp.")
    parser.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="one prompt, reply streamed to stdout")
    p.add_argument("prompt", help="the prompt ('-' reads stdin)")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--raw", action="store_true", help="skip the chat template")
    p.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="the reply is JSON valid for this schema (a file, or the schema inline)")
    p.add_argument("--grammar", default=None, metavar="FILE", help="the reply matches this GBNF grammar (llama.cpp's format)")
    p.add_argument("--stats-json", type=Path, default=None, help="write the reply's stats as JSON here")
    _add_kv_cache_arg(p)

    p = sub.add_parser("chat", help="chat with a model (flags given win over the app's saved settings, for this run)")
    _add_model_args(p, positional=True)
    _add_sampling_args(p)
    p.add_argument("--no-ngram", dest="ngram", action="store_false", help="no prompt-lookup drafting this run")
    p.add_argument("--plain", action="store_true", help="a plain streaming REPL instead of the app")
    _add_kv_cache_arg(p)
    p.set_defaults(**dict.fromkeys(CHAT_OVERRIDES, None))  # None: not given (the saved setting holds)

    p = sub.add_parser("bench", help="A/B benchmark of two configurations, or a claim's scenario (edgerun bench -h)",
                       description="Without a scenario: an A/B of two configurations (speed and output"
                       " agreement). With one (edgerun bench NAME -h): the side-by-side measurement behind"
                       " one claim in docs/BENCHMARKS.md, its ratio against the goal, and --json.")
    _add_bench_args(p)
    _add_bench_scenarios(p)

    p = sub.add_parser("serve", help="an OpenAI-compatible server on 127.0.0.1 (continuous batching)",
                       description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health and "
                                   "/metrics. Ctrl-C or SIGTERM drains running replies, then exits 0.")
    _add_model_args(p)
    _add_serve_args(p)
    p = sub.add_parser("pull", help="download a model (prints its path)")
    p.add_argument("model", nargs="?", help="catalog name, hf://org/repo/file.gguf, or a path")
    p.add_argument("--default", action="store_true", help="the default target and its draft")

    sub.add_parser("list", help="catalog and local models")

    p = sub.add_parser("cache", help="the saved KV states that resume conversations and prompts: list, clear, rm",
                       description="Saved KV states let a conversation (or a run with the same long prompt)"
                       " resume without evaluating its prefix again. The directory is kept under"
                       " kv_cache_gib (settings.toml), least recently used removed first.")
    p.add_argument("action", nargs="?", choices=("list", "clear", "rm"), default="list",
                   help="list (default), clear (remove all), rm NAME... (remove some)")
    p.add_argument("names", nargs="*", metavar="NAME", help="for rm: names from `edgerun cache`")

    p = sub.add_parser("rm", help="delete a downloaded or converted model")
    p.add_argument("model")

    p = sub.add_parser("doctor", help="backend, hardware, models, and the offload plan")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--rpc", default="", metavar="HOST:PORT[,...]", help="plan with these rpc servers' devices too")

    p = sub.add_parser("rpc-server", help="lend this machine's GPU (else CPU) to another edgerun's --rpc",
                       description="Serves this machine's backend through ggml's RPC server until Ctrl-C. ggml's RPC"
                       " protocol has no authentication or encryption: bind to 127.0.0.1 (the default) or a"
                       " trusted network only.")
    _add_rpc_server_args(p)

    p = sub.add_parser("convert", help="an HF checkpoint or F16 GGUF into mixed k-quants chosen by measurement")
    _add_convert_args(p)
    return parser


def _add_rpc_server_args(p: argparse.ArgumentParser) -> None:
    from edgerun.runtime import rpc

    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other is"
                   " reachable without authentication)")
    p.add_argument("--port", type=_number(1, 65535, whole=True), default=rpc.DEFAULT_PORT,
                   help=f"TCP port (default {rpc.DEFAULT_PORT})")
    p.add_argument("--mem", type=_number(0, low_open=True), default=None, metavar="GIB",
                   help="GiB the server reports and allocates at most (default: the device's free memory)")
    p.add_argument("--threads", type=_at_least_one, default=None,
                   help="CPU threads (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help="keep tensors clients sent here, so a reload sends only their hashes")
    p.add_argument("--cpu", action="store_true", help="serve the CPU even where a GPU is (a GPU and a CPU server on one host)")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from edgerun.serve import command

    p.add_argument("--host", default="127.0.0.1", help="address to listen on (any but loopback needs --api-key)")
    p.add_argument("--port", type=_number(0, 65535, whole=True), default=command.DEFAULT_PORT,
                   help=f"TCP port (default {command.DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--parallel", type=_at_least_one, default=4,
                   help="sequences decoded together, each with --ctx tokens of KV (default 4)")
    p.add_argument("--queue", type=_number(0, whole=True), default=64,
                   help="requests that may wait for a slot before new ones get 503 (default 64)")
    p.add_argument("--prefill-chunk", type=_at_least_one, default=256,
                   help="tokens per engine step, running replies' included: a long prompt is evaluated in"
                        " chunks of about this size between their tokens (default 256)")
    p.add_argument("--prefill-share", type=_number(0, 1, low_open=True), default=defaults.PREFILL_SHARE,
                   help="the most of the engine's time prompts take while replies decode (more when more wait than"
                        " decode): a long prompt slows"
                        f" running replies to about 1/(1-SHARE) of their speed (default {defaults.PREFILL_SHARE:g})")
    p.add_argument("--cache-ram", type=_number(0, whole=True), default=defaults.PROMPT_CACHE_MIB, metavar="MIB",
                   help="RAM for the KV of prompts that left their slot, restored when a request comes back to them"
                        f" (default {defaults.PROMPT_CACHE_MIB}; 0 turns it off)")
    p.add_argument("--api-key", default=None, help=f"require Authorization: Bearer KEY (or set {command.KEY_ENV})")
    p.add_argument("--drain-timeout", type=_number(0), default=command.DRAIN_S,
                   help=f"seconds Ctrl-C waits for running replies (default {command.DRAIN_S:g})")


def _add_convert_args(p: argparse.ArgumentParser) -> None:
    # budgets and numbers are parsed by the command, so a bad value is a one-line error (exit 2)
    p.add_argument("src", nargs="?", default=None,
                   help="HF checkpoint directory (safetensors), hf://org/repo, or an F16/BF16/F32 GGUF")
    p.add_argument("-o", "--output", type=Path, default=None, help="the GGUF to write")
    p.add_argument("--quant", default=None, help="budget: the size llama.cpp's stock recipe gives, e.g. Q4_K_M, Q3_K_M, Q2_K")
    p.add_argument("--bpw", default=None, help="budget: bits per weight over all tensors, e.g. 3.5")
    p.add_argument("--size", default=None, help="budget: file size, e.g. 900MB, 1.2GB, 850MiB")
    p.add_argument("--calib", action="append", default=None, metavar="SET|FILE",
                   help="calibration text: code, chat, prose or a text file; repeat or comma-separate (default: code)")
    p.add_argument("--keep-f16", type=Path, default=None, metavar="PATH", help="also keep the F16 GGUF here")
    p.add_argument("--report", type=Path, default=None, metavar="PATH", help="write the report as JSON here")
    p.add_argument("--eval-chunks", default=None, metavar="N",
                   help="512-token chunks of held-out code for the quality report (0 skips it)")
    p.add_argument("--threads", default=None, help="CPU threads (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--no-weigh", dest="weigh", action="store_false",
                   help="skip measuring each tensor role's effect on KLD (faster; plans on raw errors)")
    p.add_argument("--name", default=None, help="register the result under this name (edgerun list, -m NAME, the chat"
                   " app's models screen); without -o it is written into the models folder")
    p.add_argument("--k-quants-only", action="store_true",
                   help="leave llama.cpp's i-quants (IQ2_XXS..IQ4_XS) out of the plan: they are more accurate per"
                   " byte at 2-4 bpw but some decode slower on CPUs")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="also draw the plan against llama.cpp's stock recipes (mean KLD vs size) into this PNG;"
                   " quantizes and evaluates the stock recipes too")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        logging.getLogger("edgerun.llama").setLevel(logging.CRITICAL)
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # its defaults read EDGERUN_THREADS, which may be wrong
        _setup_logging(args.verbose)
        from edgerun import commands

        return getattr(commands, f"cmd_{args.command.replace('-', '_')}")(args)
    except EdgerunError as exc:
        print(f"edgerun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("edgerun: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
