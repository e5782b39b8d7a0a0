#!/usr/bin/env python3
"""Quality per byte: edgerun convert's measured plan against llama.cpp's stock recipes.

One run, one F16 source (an HF fixture made from a catalog GGUF with scripts/make_hf_fixture.py,
converted once by edgerun), one code imatrix shared by both sides:
  - llama.cpp's stock Q3_K_M and Q2_K (with that imatrix) vs edgerun's plan at the same tensor
    bytes (so the same file size to well under 1%): size, mean KLD against the F16, top-1
    agreement and perplexity on held-out code, and KLD_edgerun / KLD_stock (goal <= 0.85);
  - the plan at both sizes calibrated on code vs on prose, all evaluated on code;
  - `edgerun convert` from the HF directory (a subprocess, from scratch): wall time per step and
    peak RSS.

    scripts/bench_quant.py                  # the 1.5B (long: run it on a quiet machine)
    scripts/bench_quant.py --model qwen2.5-coder-0.5b --eval-chunks 4 --calib-chunks 8   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import gguf

from edgerun.convert import gains, pipeline, plan, report
from edgerun.convert.progress import Bar
from edgerun.errors import EdgerunError

STOCK = ("Q3_K_M", "Q2_K")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="catalog name (or path) of the GGUF behind the HF fixture")
    p.add_argument("--work", type=Path, default=Path("/tmp/edgerun-bench-quant"), help="fixture, cache and outputs")
    p.add_argument("--eval-chunks", type=int, default=16, help="512-token chunks of held-out code per evaluation")
    p.add_argument("--calib-chunks", type=int, default=None, help="512-token chunks of calibration text (default all)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-timing", action="store_true", help="skip the timed `edgerun convert` run (quick checks)")
    p.add_argument("--no-weigh", dest="weigh", action="store_false",
                   help="plan on raw relative errors (no per-role KLD probes), as edgerun convert --no-weigh")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def _fixture(model: str, work: Path, bar) -> Path:
    """The HF directory standing in for an F16 checkpoint (made once)."""
    from edgerun.convert.fixture import make_hf_fixture
    from edgerun.models import catalog, fetch

    entry = catalog.load().find(model)
    gguf_path = fetch.pull(entry) if entry else Path(model)
    hf_dir = work / f"hf-{gguf_path.stem}"
    if not (hf_dir / "config.json").is_file():
        make_hf_fixture(gguf_path, hf_dir, dtype="bf16", progress=bar)
    return hf_dir


def _timed_convert(hf_dir: Path, work: Path, env: dict, threads: int | None) -> dict:
    """`edgerun convert` as a user runs it, from scratch (its own cache): time and peak RSS."""
    out, rep = work / "edgerun-convert.gguf", work / "edgerun-convert.json"
    cmd = [sys.executable, "-m", "edgerun.cli", "convert", str(hf_dir), "-o", str(out), "--quant", "Q3_K_M",
           "--calib", "code", "--eval-chunks", "0", "--report", str(rep)]
    if threads:
        cmd += ["--threads", str(threads)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"edgerun convert failed with exit code {proc.returncode}")
    doc = json.loads(rep.read_text())
    # ru_maxrss of waited-for children covers the convert process and its quantizer child (KiB)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"wall_s": round(wall, 1), "steps_s": doc["timings_s"], "peak_rss_bytes": rss,
            "size_bytes": doc["size_bytes"]}


def _tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def _variants(f16: Path, work: Path, opts: pipeline.ConvertOptions, bar) -> dict[str, Path]:
    """Stock Q3_K_M / Q2_K and edgerun's plans at their sizes, all with the code imatrix; plus the
    plans at both sizes from a prose imatrix."""
    from edgerun.convert.quantize import quantize

    cache = work / "cache" / "convert"
    measured = {}
    for calib in ("code", "prose"):
        o = dataclasses.replace(opts, calib=(calib,))
        imatrix, key = pipeline.cached_imatrix(f16, o, cache, bar)
        costs = pipeline.cached_costs(f16, imatrix, key, o, cache, bar)
        if o.weigh:
            costs = gains.weigh(costs, pipeline.cached_gains(f16, imatrix, key, costs, o, cache, bar))
        measured[calib] = (imatrix, costs)
    inv = pipeline.inventory_of(f16, {c.name for c in measured["code"][1]})
    out = {}
    for ftype in STOCK:
        stock = work / f"stock-{ftype}.gguf"
        if not stock.is_file():
            quantize(f16, stock, ftype=ftype, overrides={}, imatrix=measured["code"][0],
                     n_threads=opts.n_threads, progress=bar)
        out[f"stock {ftype}"] = stock
        for calib in ("code", "prose"):
            imatrix, costs = measured[calib]
            chosen = plan.choose(costs, _tensor_bytes(stock), fixed_bytes=inv.fixed_bytes)
            ours = work / f"edgerun-{ftype}-{calib}.gguf"
            quantize(f16, ours, ftype=ftype, overrides=chosen.types, imatrix=imatrix,
                     n_threads=opts.n_threads, progress=bar)
            out[f"edgerun @{ftype} ({calib} calib)"] = ours
    return out


def _table(results: dict[str, dict]) -> str:
    rows = [["", "size MB", "bpw", "mean KLD", "KLD p99", "top-1", "ppl", "ppl F16"]]
    for name, r in results.items():
        rows.append([name, f"{r['size_bytes'] / 1e6:.1f}", f"{r['bpw']:.3f}", f"{r['kld_mean']:.5f}",
                     f"{r['kld_p99']:.4f}", f"{r['top1_agreement']:.2%}", f"{r['ppl']:.3f}", f"{r['ppl_ref']:.3f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _summary(results: dict[str, dict]) -> list[str]:
    lines = []
    for ftype in STOCK:
        stock, ours = results[f"stock {ftype}"], results[f"edgerun @{ftype} (code calib)"]
        ratio = ours["kld_mean"] / stock["kld_mean"]
        size = ours["size_bytes"] / stock["size_bytes"] - 1
        lines.append(f"{ftype}: KLD edgerun/stock = {ratio:.3f} ({'meets' if ratio <= 0.85 else 'misses'} the 0.85 goal),"
                     f" size difference {size:+.2%}")
    for ftype in STOCK:
        code, prose = results[f"edgerun @{ftype} (code calib)"], results[f"edgerun @{ftype} (prose calib)"]
        lines.append(f"{ftype} size, calibration on code vs prose, evaluated on code: KLD {code['kld_mean']:.5f}"
                     f" vs {prose['kld_mean']:.5f} (prose/code = {prose['kld_mean'] / code['kld_mean']:.3f}),"
                     f" top-1 {code['top1_agreement']:.2%} vs {prose['top1_agreement']:.2%}")
    return lines


def main(argv=None) -> int:
    args = _args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "EDGERUN_HOME": str(work / "home")}
    bar = Bar()
    try:
        hf_dir = _fixture(args.model, work, bar)
        timing = None
        if not args.no_timing:
            timing = _timed_convert(hf_dir, work, env, args.threads)
            print(f"edgerun convert {hf_dir.name} --quant Q3_K_M: {timing['wall_s']:.0f} s, peak RSS "
                  f"{timing['peak_rss_bytes'] / 2**30:.2f} GiB; steps (s): {timing['steps_s']}", flush=True)
        # the F16 the timed run wrote (same cache) is reused for every variant
        from edgerun.convert.source import prepare_f16

        f16 = Path(prepare_f16(str(hf_dir), work / "home" / "cache" / "convert" / "f16", progress=bar))
        opts = pipeline.ConvertOptions(src=str(hf_dir), output=work / "unused.gguf", quant="Q3_K_M",
                                       calib_chunks=args.calib_chunks, n_threads=args.threads,
                                       weigh=args.weigh)
        variants = _variants(f16, work / "home", opts, bar)
        text = pipeline.EVAL_TEXT.read_text(encoding="utf-8")
        qualities = report.evaluate_many(f16, list(variants.values()), text, max_chunks=args.eval_chunks,
                                         n_threads=args.threads, progress=bar)
    except EdgerunError as exc:
        print(f"bench_quant: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    results = {name: report.build(path, q).to_json() for (name, path), q in zip(variants.items(), qualities)}
    for r in results.values():
        r.pop("tensors")
    print(_table(results))
    print("\n".join(_summary(results)))
    if args.json:
        report.write_text_atomic(args.json, json.dumps({"model": args.model, "convert": timing,
                                                        "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
