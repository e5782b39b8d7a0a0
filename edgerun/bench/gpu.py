"""The GPU scenarios of `edgerun bench`: edgerun's decode path against llama.cpp's llama-bench on
the same file and split, and speculation with the real pair at two placements.

    edgerun bench gpu-decode  [--shapes 0.5b,1.5b,7b]   fully on the GPU (goal >= 0.98 each)
    edgerun bench gpu-offload [--threads 16]            7B half on the GPU, 1.5B all on the CPU
    edgerun bench gpu-spec    [--target T --draft D]    plain vs speculative, GPU and CPU+GPU

Every edgerun figure is a user's: an `edgerun run` process (`--stats-json`), so load, warm-up
and the CLI's own path are what is measured. llama-bench is the one setup.sh builds from the same
llama.cpp source with the same flags (`EDGERUN_LLAMA_BENCH=1 scripts/setup.sh`), so both sides
run the same ggml kernels. Decode
and offload use random-weight shapes (bench/shapes.py: speed never depends on weight values);
speculation needs the real models (acceptance does).

A reply decodes after its prompt, so the like-for-like reference is llama-bench's tg128 at the
prompt's depth (`-d N`, one rep per process: its later reps would restore the prompt's state
without running it). tg128 from an empty context is kept beside it: on the 0.5B an 83-token
context alone costs llama.cpp 2-3% of tg128.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from edgerun.bench import shapes
from edgerun.bench.scenario import Scenario, claim, interleave, register
from edgerun.bench.stats import ratio_spread, spread
from edgerun.errors import ConfigError, EngineError

PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime."
_CHECKOUT_BENCH = Path(__file__).resolve().parents[2] / "build" / "bin" / "llama-bench"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return int(text)


def _shape_names(text: str) -> list[str]:
    try:
        return shapes.names(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _common(p: argparse.ArgumentParser) -> None:
    from edgerun import paths

    p.add_argument("--shapes-dir", type=Path, default=paths.cache_dir() / "shapes",
                   help="where random-weight shapes are written and reused (default: the cache's shapes/)")
    p.add_argument("--llama-bench", default=None, metavar="BIN",
                   help="llama-bench binary (default: build/bin/llama-bench from setup.sh, then PATH)")
    p.add_argument("--repeat", type=_positive, default=5, help="interleaved turns of every side (default 5)")
    p.add_argument("-n", "--tokens", type=_positive, default=128, help="tokens per reply (default 128)")
    p.add_argument("--threads", type=_positive, default=16, help="CPU threads of the CPU rows (default 16)")


def _llama_bench_binary(arg: str | None) -> str:
    for candidate in ([arg] if arg else [str(_CHECKOUT_BENCH), "llama-bench"]):
        found = shutil.which(candidate)
        if found:
            return found
    raise ConfigError(f"no llama-bench at {arg or _CHECKOUT_BENCH}: build it with"
                      " `EDGERUN_LLAMA_BENCH=1 scripts/setup.sh`, or pass --llama-bench BIN")


def edgerun_run(model: Path, *flags: str, tokens: int, raw: bool = True) -> dict:
    """One `edgerun run` process at T=0; its --stats-json."""
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        cmd = [sys.executable, "-m", "edgerun.cli", "run", PROMPT, "-m", str(model), "-n", str(tokens),
               "--temp", "0", "--ctx", "4096", "--stats-json", str(stats), *flags, *(["--raw"] if raw else [])]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not stats.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise EngineError(f"`edgerun run` on {model.name} failed: {last}")
        return json.loads(stats.read_text())


def llama_bench(binary: str, model: Path, *, ngl: int, tokens: int, reps: int, depth: int = 0,
                threads: int | None = None) -> float:
    """llama-bench's tg<tokens> (after a prompt of `depth` tokens when depth > 0), in tok/s."""
    cmd = [binary, "-m", str(model), "-ngl", str(ngl), "-p", "0", "-n", str(tokens), "-r", str(reps), "-o", "json"]
    cmd += (["-d", str(depth)] if depth else []) + (["-t", str(threads)] if threads else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"llama-bench on {model.name} failed: {last}")
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def copy_bandwidth() -> float | None:
    """The device's copy rate (bytes read + written per second), decode's ceiling; None without
    torch. 10 copies of 4 GiB: 20 ms each on an H200, well past launch overhead."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    import time

    a = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    rate = 2 * a.numel() * 10 / (time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return rate


# -- gpu-decode -------------------------------------------------------------------------------------


def _decode_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--shapes", type=_shape_names, default=list(shapes.SHAPES),
                   help=f"random-weight shapes, comma-separated (default {','.join(shapes.SHAPES)})")


def _decode_run(args: argparse.Namespace, say) -> dict:
    binary = _llama_bench_binary(args.llama_bench)
    bw = copy_bandwidth()
    rows, claims = {}, []
    for name in args.shapes:
        say(f"{name}: writing the shape (once)" if not shapes.path_of(name, args.shapes_dir).exists() else name)
        model = shapes.ensure(name, args.shapes_dir)
        depth = edgerun_run(model, "--gpu-layers", "auto", tokens=args.tokens)["prompt_tokens"]  # also the warm-up
        sides = {
            "edgerun": lambda: edgerun_run(model, "--gpu-layers", "auto", tokens=args.tokens)["decode_tok_s"],
            "llama_bench_d": lambda: llama_bench(binary, model, ngl=99, tokens=args.tokens, reps=1, depth=depth),
            "llama_bench_tg": lambda: llama_bench(binary, model, ngl=99, tokens=args.tokens, reps=3),
        }
        values = interleave(sides, args.repeat, lambda line, n=name: say(f"{n} {line}"))
        size = model.stat().st_size
        ours = statistics.median(values["edgerun"])
        rows[name] = {"file_bytes": size, "depth": depth, "values": values,
                      "tok_s": {side: spread(v) for side, v in values.items()},
                      "vs_depth": ratio_spread(values["llama_bench_d"], values["edgerun"]),
                      "vs_tg": ratio_spread(values["llama_bench_tg"], values["edgerun"]),
                      "weights_read_tb_s": size * ours / 1e12,
                      "of_copy_rate": size * ours / bw if bw else None}
        claims.append(claim(f"{name}: edgerun run / llama-bench -d {depth}, fully on the GPU", rows[name]["vs_depth"],
                            ">= 0.98"))
    settings = {"shapes": args.shapes, "tokens": args.tokens, "repeat": args.repeat, "llama_bench": binary,
                "prompt": PROMPT}
    return {"settings": settings, "claims": claims, "rows": rows, "copy_bandwidth_bytes_s": bw}


def _decode_report(doc: dict) -> str:
    lines = ["shape  edgerun  llama-bench -d  ratio  tg  ratio  weights read"]
    for name, r in doc["rows"].items():
        t = r["tok_s"]
        share = f", {r['of_copy_rate']:.0%} of the copy rate" if r["of_copy_rate"] else ""
        lines.append(f"{name}  {t['edgerun']['median']:.1f}  {t['llama_bench_d']['median']:.1f} (d {r['depth']})"
                     f"  {r['vs_depth']['median']:.3f}  {t['llama_bench_tg']['median']:.1f}  {r['vs_tg']['median']:.3f}"
                     f"  {r['weights_read_tb_s']:.2f} TB/s{share}")
    return "\n".join(lines)


# -- gpu-offload ------------------------------------------------------------------------------------


OFFLOAD_CASES = ("7b-half", "1.5b-cpu")


def _cases(text: str) -> list[str]:
    out = [c.strip() for c in text.split(",") if c.strip()]
    if not out or set(out) - set(OFFLOAD_CASES):
        raise argparse.ArgumentTypeError(f"unknown offload case in '{text}'; there are: {', '.join(OFFLOAD_CASES)}")
    return out


def _offload_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--cases", type=_cases, default=list(OFFLOAD_CASES),
                   help="7b-half (a VRAM cap of about half the 7B: the auto plan's split), 1.5b-cpu (all on"
                        " the CPU); comma-separated (default both)")


def _auto_layers(model: Path, max_vram: int) -> int:
    """The target layers edgerun's auto plan puts on a GPU with max_vram bytes free."""
    from edgerun.models.gguf_check import inspect
    from edgerun.runner import placement_for
    from edgerun.runtime import devices
    from edgerun.settings import EngineSettings

    memory = devices.Memory(free_ram=devices.free_ram(), free_vram=max_vram, gpu=True)
    return placement_for(inspect(model), EngineSettings(n_ctx=4096, max_vram=max_vram), memory=memory).target.gpu_layers


def _offload_case(case: str, args: argparse.Namespace) -> tuple[Path, list[str], int]:
    """(model, edgerun's placement flags, llama-bench's -ngl at the same split)."""
    from edgerun.runtime import placement

    if case == "1.5b-cpu":
        return shapes.ensure("1.5b", args.shapes_dir), ["--gpu-layers", "0"], 0
    if case == "7b-half":
        model = shapes.ensure("7b", args.shapes_dir)
        cap = model.stat().st_size // 2 + placement.VRAM_MARGIN + (400 << 20)  # plus the 4096-token KV and buffers
        return model, ["--max-vram", f"{cap / 2**30:.3f}"], _auto_layers(model, cap)
    raise AssertionError(case)  # _cases allows no other


def _offload_run(args: argparse.Namespace, say) -> dict:
    binary = _llama_bench_binary(args.llama_bench)
    rows, claims = {}, []
    for case in args.cases:
        model, flags, ngl = _offload_case(case, args)
        flags = [*flags, "--threads", str(args.threads)]
        depth = edgerun_run(model, *flags, tokens=16)["prompt_tokens"]  # also the warm-up: pages the weights in
        # like gpu-decode: the reply decodes after its prompt, so the reference is tg at that depth;
        # tg from an empty context is kept beside it
        sides = {"edgerun": lambda: edgerun_run(model, *flags, tokens=args.tokens)["decode_tok_s"],
                 "llama_bench_d": lambda: llama_bench(binary, model, ngl=ngl, tokens=args.tokens, reps=1,
                                                      depth=depth, threads=args.threads),
                 "llama_bench_tg": lambda: llama_bench(binary, model, ngl=ngl, tokens=args.tokens, reps=2,
                                                       threads=args.threads)}
        values = interleave(sides, args.repeat, lambda line, c=case: say(f"{c} {line}"))
        rows[case] = {"ngl": ngl, "flags": flags, "depth": depth, "values": values,
                      "tok_s": {side: spread(v) for side, v in values.items()},
                      "ratio": ratio_spread(values["llama_bench_d"], values["edgerun"]),
                      "vs_tg": ratio_spread(values["llama_bench_tg"], values["edgerun"])}
        claims.append(claim(f"{case}: edgerun run / llama-bench -ngl {ngl} -t {args.threads} -d {depth}",
                            rows[case]["ratio"], ">= 0.97"))
    settings = {"cases": list(rows), "tokens": args.tokens, "repeat": args.repeat, "threads": args.threads,
                "llama_bench": binary}
    return {"settings": settings, "claims": claims, "rows": rows}


def _offload_report(doc: dict) -> str:
    lines = ["case  edgerun  llama-bench -d  ratio  tg  ratio  ngl"]
    for case, r in doc["rows"].items():
        t = r["tok_s"]
        lines.append(f"{case}  {t['edgerun']['median']:.1f}  {t['llama_bench_d']['median']:.1f} (d {r['depth']})"
                     f"  {r['ratio']['median']:.3f}  {t['llama_bench_tg']['median']:.1f}  {r['vs_tg']['median']:.3f}"
                     f"  {r['ngl']}")
    return "\n".join(lines)


# -- gpu-spec ---------------------------------------------------------------------------------------

PLACEMENTS = {  # label: (the target's placement flags, goal of speculative / plain)
    "gpu_target_gpu_draft": (["--gpu-layers", "auto"], ">= 0.97"),
    "cpu_target_gpu_draft": (["--gpu-layers", "0"], ">= 1.5"),
}


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target model (default qwen2.5-coder-1.5b)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model (default qwen2.5-coder-0.5b)")
    p.add_argument("--repeat", type=_positive, default=3, help="interleaved plain/speculative turns (default 3)")
    p.add_argument("-n", "--tokens", type=_positive, default=128, help="tokens per reply (default 128)")
    p.add_argument("--threads", type=_positive, default=16, help="CPU threads of a CPU target (default 16)")


def _spec_run(args: argparse.Namespace, say) -> dict:
    from edgerun.models.fetch import resolve

    target = resolve(args.target)  # a missing model is one line before anything runs
    rows, claims = {}, []
    for label, (place, goal) in PLACEMENTS.items():
        flags = [*place, "--threads", str(args.threads)]
        last: dict = {}

        def spec_side() -> float:
            last.update(edgerun_run(target, *flags, "--draft", args.draft, tokens=args.tokens, raw=False))
            return last["decode_tok_s"]

        sides = {"plain": lambda: edgerun_run(target, *flags, "--draft", "none", tokens=args.tokens,
                                              raw=False)["decode_tok_s"],
                 "speculative": spec_side}
        values = interleave(sides, args.repeat, lambda line, lb=label: say(f"{lb} {line}"))
        rows[label] = {"values": values, "tok_s": {side: spread(v) for side, v in values.items()},
                       "ratio": ratio_spread(values["plain"], values["speculative"]),
                       "last": {k: last.get(k) for k in ("acceptance_rate", "mean_accepted_len", "spec_k", "governor")}}
        claims.append(claim(f"{label}: speculative / plain", rows[label]["ratio"], goal))
    settings = {"target": args.target, "draft": args.draft, "tokens": args.tokens, "repeat": args.repeat,
                "threads": args.threads, "prompt": PROMPT}
    return {"settings": settings, "claims": claims, "rows": rows}


def _spec_report(doc: dict) -> str:
    lines = ["placement  plain  speculative  ratio  acceptance  governor"]
    for label, r in doc["rows"].items():
        t, last = r["tok_s"], r["last"]
        lines.append(f"{label}  {t['plain']['median']:.1f}  {t['speculative']['median']:.1f}  {r['ratio']['median']:.3f}"
                     f"  {last['acceptance_rate'] or 0:.0%}  {last['governor']}")
    return "\n".join(lines)


register(Scenario("gpu-decode", "edgerun run vs llama-bench after the same prompt, fully on the GPU (goal >= 0.98)",
                  _decode_args, _decode_run, _decode_report))
register(Scenario("gpu-offload", "edgerun run vs llama-bench at the same CPU/GPU split (goal >= 0.97)",
                  _offload_args, _offload_run, _offload_report))
register(Scenario("gpu-spec", "speculative vs plain with the real pair, GPU and CPU target (goals 0.97, 1.5)",
                  _spec_args, _spec_run, _spec_report))
