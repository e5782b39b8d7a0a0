"""`edgerun bench convert`: quality per byte of edgerun convert's measured plan vs llama.cpp's
stock recipes.

One source (an HF checkpoint directory or an F16 GGUF; `scripts/make_hf_fixture.py` makes one
from a catalog GGUF), converted once to F16, and one code imatrix shared by both sides:
  - llama.cpp's stock Q3_K_M and Q2_K (with that imatrix) vs edgerun's plan at the same tensor
    bytes, so the same file size to well under 1%: mean KLD against the F16, top-1 agreement and
    perplexity on held-out code;
  - the plan at both sizes calibrated on prose too, evaluated on code (calibrate like the workload);
  - with --timed, `edgerun convert` from the source as a user runs it: wall time per step, peak RSS.
Intermediates are cached under --work, so a re-run resumes.

Claim: at both sizes the plan's mean KLD is at most 0.85 of the stock recipe's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from edgerun.bench.scenario import Scenario, claim, count, register
from edgerun.bench.table import align
from edgerun.errors import EdgerunError

STOCK = ("Q3_K_M", "Q2_K")
CALIBS = ("code", "prose")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="HF checkpoint directory or F16/BF16 GGUF (scripts/make_hf_fixture.py"
                   " makes one from a GGUF)")
    p.add_argument("--work", type=Path, default=Path("/tmp/edgerun-bench-convert"), help="cache and outputs")
    p.add_argument("--eval-chunks", type=count, default=16, help="512-token chunks of held-out code per evaluation")
    p.add_argument("--calib-chunks", type=count, default=None, help="512-token chunks of calibration text (default all)")
    p.add_argument("--threads", type=count, default=None)
    p.add_argument("--no-prose", dest="prose", action="store_false",
                   help="skip the plans calibrated on prose (half the imatrix, sensitivity and weigh work)")
    p.add_argument("--timed", action="store_true", help="also time `edgerun convert SRC --quant Q3_K_M` from scratch")
    p.add_argument("--no-weigh", dest="weigh", action="store_false",
                   help="plan on raw relative errors (no per-role KLD probes), as edgerun convert --no-weigh")


def _timed_convert(src: str, work: Path, env: dict, threads: int | None) -> dict:
    """`edgerun convert` as a user runs it, in a child process with its own cache."""
    out, rep = work / "edgerun-convert.gguf", work / "edgerun-convert.json"
    cmd = [sys.executable, "-m", "edgerun.cli", "convert", src, "-o", str(out), "--quant", "Q3_K_M",
           "--calib", "code", "--eval-chunks", "0", "--report", str(rep)] + (["--threads", str(threads)] if threads else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise EdgerunError(f"edgerun convert failed with exit code {proc.returncode}")
    doc = json.loads(rep.read_text())
    # ru_maxrss of waited-for children covers the convert process and its quantizer child (KiB)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"wall_s": round(wall, 1), "steps_s": doc["timings_s"], "peak_rss_bytes": rss, "size_bytes": doc["size_bytes"]}


def _tensor_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def _variants(f16: Path, cache: Path, out_dir: Path, opts, calibs: tuple[str, ...], bar) -> dict[str, Path]:
    """Stock Q3_K_M / Q2_K and edgerun's plans at their sizes, from a code and a prose imatrix
    (the stock files take the code one)."""
    from edgerun.convert import gains, pipeline, plan
    from edgerun.convert.quantize import quantize

    measured = {}
    for calib in calibs:
        o = dataclasses.replace(opts, calib=(calib,))
        imatrix, key = pipeline.cached_imatrix(f16, o, cache, bar)
        costs = pipeline.cached_costs(f16, imatrix, key, o, cache, bar)
        if o.weigh:
            costs = gains.weigh(costs, pipeline.cached_gains(f16, imatrix, key, costs, o, cache, bar))
        measured[calib] = (imatrix, costs)
    inv = pipeline.inventory_of(f16, {c.name for c in measured["code"][1]})
    out = {}
    for ftype in STOCK:
        stock = out_dir / f"stock-{ftype}.gguf"
        if not stock.is_file():
            quantize(f16, stock, ftype=ftype, overrides={}, imatrix=measured["code"][0], n_threads=opts.n_threads,
                     progress=bar)
        out[f"stock {ftype}"] = stock
        for calib in calibs:
            imatrix, costs = measured[calib]
            chosen = plan.choose(costs, _tensor_bytes(stock), fixed_bytes=inv.fixed_bytes)
            ours = out_dir / f"edgerun-{ftype}-{calib}.gguf"
            quantize(f16, ours, ftype=ftype, overrides=chosen.types, imatrix=imatrix, n_threads=opts.n_threads,
                     progress=bar)
            out[f"edgerun @{ftype} ({calib} calib)"] = ours
    return out


def measure(args: argparse.Namespace, say) -> dict:
    import os

    from edgerun.convert import pipeline, report
    from edgerun.convert.progress import Bar
    from edgerun.convert.source import prepare_f16

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "EDGERUN_HOME": str(work / "home")}
    cache = work / "home" / "cache" / "convert"
    bar = Bar()
    try:
        timing = _timed_convert(args.src, work, env, args.threads) if args.timed else None
        if timing:
            say(f"edgerun convert --quant Q3_K_M: {timing['wall_s']:.0f} s, peak RSS {timing['peak_rss_bytes'] / 2**30:.2f} GiB")
        f16 = Path(prepare_f16(args.src, cache / "f16", progress=bar))
        opts = pipeline.ConvertOptions(src=args.src, output=work / "unused.gguf", quant="Q3_K_M",
                                       calib_chunks=args.calib_chunks, n_threads=args.threads, weigh=args.weigh)
        variants = _variants(f16, cache, work, opts, CALIBS if args.prose else CALIBS[:1], bar)
        text = pipeline.EVAL_TEXT.read_text(encoding="utf-8")
        qualities = report.evaluate_many(f16, list(variants.values()), text, max_chunks=args.eval_chunks,
                                         n_threads=args.threads, progress=bar)
    finally:
        bar.close()
    results = {}
    for (name, path), q in zip(variants.items(), qualities):
        results[name] = report.build(path, q).to_json()
        results[name].pop("tensors")
    settings = {"src": args.src, "eval_chunks": args.eval_chunks, "calib_chunks": args.calib_chunks,
                "threads": args.threads, "weigh": args.weigh, "prose": args.prose}
    return {"settings": settings, "convert": timing, "results": results, "claims": _claims(results)}


def _claims(results: dict) -> list[dict]:
    out = []
    for ftype in STOCK:
        ours, stock = results[f"edgerun @{ftype} (code calib)"], results[f"stock {ftype}"]
        out.append(claim(f"mean KLD, edgerun / stock {ftype} at its size", ours["kld_mean"] / stock["kld_mean"], "<= 0.85"))
    return out


def report(doc: dict) -> str:
    rows = [["", "size MB", "bpw", "mean KLD", "KLD p99", "top-1", "ppl", "ppl F16"]]
    for name, r in doc["results"].items():
        rows.append([name, f"{r['size_bytes'] / 1e6:.1f}", f"{r['bpw']:.3f}", f"{r['kld_mean']:.5f}",
                     f"{r['kld_p99']:.4f}", f"{r['top1_agreement']:.2%}", f"{r['ppl']:.3f}", f"{r['ppl_ref']:.3f}"])
    lines = align(rows)
    for ftype in STOCK if doc["settings"]["prose"] else ():
        code, prose = (doc["results"][f"edgerun @{ftype} ({c} calib)"] for c in CALIBS)
        lines.append(f"at {ftype}'s size, calibrated on prose vs code (evaluated on code): KLD x"
                     f"{prose['kld_mean'] / code['kld_mean']:.3f}, top-1 {prose['top1_agreement'] - code['top1_agreement']:+.2%}")
    if doc["convert"]:
        c = doc["convert"]
        lines.append(f"edgerun convert --quant Q3_K_M: {c['wall_s']:.0f} s, peak RSS {c['peak_rss_bytes'] / 2**30:.2f} GiB;"
                     f" steps (s): {c['steps_s']}")
    return "\n".join(lines)


register(Scenario("convert", "edgerun convert's plan vs llama.cpp's stock Q3_K_M and Q2_K, mean KLD at equal size"
                  " (goal <= 0.85)", add_args, measure, report))
