"""`edgerun bench convert`: quality per byte of edgerun convert's measured plan vs llama.cpp's
stock recipes.

One source (an HF checkpoint directory or an F16 GGUF; `scripts/make_hf_fixture.py` makes one
from a catalog GGUF), converted once to F16, and one code imatrix shared by every side:
  - llama.cpp's stock Q3_K_M, Q2_K, IQ3_XXS and IQ2_M (with that imatrix) vs edgerun's plans at the
    tensor bytes of Q3_K_M and of Q2_K, so the same file size to well under 1%: mean KLD against
    the F16, top-1 agreement and perplexity on held-out code; the plans with the i-quants among
    their candidates (the default) and with k-quants only (--k-quants-only);
  - decode tok/s of every file, greedy on one short prompt, the files in ABBA turns (some i-quants
    decode slower on CPUs: the speed stands beside the KLD);
  - the i-quant plan at both sizes calibrated on prose too, evaluated on code;
  - with --timed, `edgerun convert` from the source as a user runs it: wall time per step, peak RSS.
Intermediates are cached under --work, so a re-run resumes.

Claims: at both sizes the plan's mean KLD is at most 0.6 of the best stock recipe's that is no
larger (k- or i-quant), and the k-quants-only plan's at most 0.85 of the stock k-quant recipe's.

With --speed-against REV (a git revision, checked out as a worktree under --work, or a directory
holding a checkout) the scenario measures instead how much faster this tree converts than REV:
`edgerun convert SRC --size S` from scratch (a fresh cache each, S the size of llama.cpp's stock
Q3_K_M of SRC, or --size-of's recipe; no quality report), REV's code and then this tree's, one after the other in one
run, each side's wall time and its steps; then both outputs' mean KLD against the F16 in one
evaluation. Claims: wall time this tree / REV <= 0.35, mean KLD this tree / REV <= 1.05.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from edgerun.bench.scenario import Scenario, claim, count, register
from edgerun.bench.table import align
from edgerun.errors import EdgerunError

SIZES = ("Q3_K_M", "Q2_K")  # the plans are held to these stock recipes' sizes
STOCK = (*SIZES, "IQ3_XXS", "IQ2_M")  # every stock recipe measured
CALIBS = ("code", "prose")
DECODE_PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"


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
    p.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens per decode-speed turn (0 skips it)")
    p.add_argument("--decode-repeat", type=count, default=4, help="ABBA turns of the decode-speed measurement")
    p.add_argument("--speed-against", metavar="REV|DIR", default=None,
                   help="instead: time a whole `edgerun convert` of SRC at stock Q3_K_M's size as of git revision REV"
                   " (or the checkout in DIR) and as this tree, one after the other, and compare the outputs' mean KLD"
                   " (goal: wall time <= 0.35x, KLD <= 1.05x)")
    p.add_argument("--size-of", metavar="RECIPE", default="Q3_K_M",
                   help="with --speed-against: convert to the size of this stock recipe of SRC (default Q3_K_M)")


def _timed_convert(src: str, budget: list[str], out: Path, env: dict, threads: int | None,
                   tree: Path | None = None) -> dict:
    """`edgerun convert SRC -o OUT BUDGET...` as a user runs it (TREE: as that checkout's code runs
    it), in a child process with the cache ENV names: wall time, the report's steps, size, the
    load average before and after, and the peak RSS of this process's children so far (the
    convert and its quantizer child, when it is the first)."""
    rep = out.with_suffix(".json")
    args = ["convert", src, "-o", str(out), *budget, "--calib", "code", "--eval-chunks", "0", "--report", str(rep)]
    args += ["--threads", str(threads)] if threads else []
    if tree:
        ext = Path(importlib.util.find_spec("edgerun._native_ext").origin).parent
        cmd = [sys.executable, "-c", _IN_TREE, str(tree), str(ext), *args]
    else:
        cmd = [sys.executable, "-m", "edgerun.cli", *args]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise EdgerunError(f"edgerun convert ({tree or 'this tree'}) failed: {lines[-1] if lines else proc.returncode}")
    doc = json.loads(rep.read_text())
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB
    return {"wall_s": round(wall, 1), "steps_s": doc["timings_s"], "peak_rss_bytes": rss, "size_bytes": doc["size_bytes"],
            "load_avg_1m": [round(load, 2), round(os.getloadavg()[0], 2)], "output": str(out)}


def _tensor_bytes(path: Path) -> int:
    from edgerun.convert.tensors import n_bytes, open_gguf

    return sum(n_bytes(t) for t in open_gguf(path).tensors)


def _variants(f16: Path, cache: Path, out_dir: Path, opts, calibs: tuple[str, ...], bar) -> dict[str, Path]:
    """The stock recipes and edgerun's plans at SIZES: with i-quants from a code and a prose
    imatrix, with k-quants only from the code one (the stock files take the code one)."""
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
    for ftype in SIZES:
        budget = _tensor_bytes(out[f"stock {ftype}"])
        plans = [(f"edgerun @{ftype} ({calib} calib)", f"edgerun-{ftype}-{calib}", *measured[calib])
                 for calib in calibs]
        imatrix, costs = measured["code"]
        plans.append((f"edgerun k-quants @{ftype}", f"edgerun-k-{ftype}", imatrix,
                      pipeline.only_types(costs, pipeline.CANDIDATE_TYPES)))
        for name, stem, imatrix, costs in plans:
            chosen = plan.choose(costs, budget, fixed_bytes=inv.fixed_bytes)
            ours = out_dir / f"{stem}.gguf"
            quantize(f16, ours, ftype=ftype, overrides=chosen.types, imatrix=imatrix, n_threads=opts.n_threads,
                     progress=bar)
            out[name] = ours
    return out


def decode_speed(paths: dict[str, Path], *, tokens: int, repeat: int, threads: int | None, say) -> dict[str, dict]:
    """Greedy decode tok/s of each GGUF on DECODE_PROMPT, the files in ABBA turns: {name: spread}."""
    from edgerun.bench.stats import spread
    from edgerun.bench.scenario import interleave
    from edgerun.runtime.engine import Context, Model
    from edgerun.settings import EngineSettings

    engine = EngineSettings().replace(n_ctx=256, n_threads=threads)

    def turn(path: Path) -> float:
        with Model(path) as model, Context(model, engine) as ctx:
            prompt = model.tokenize(DECODE_PROMPT, add_special=True)
            ctx.eval(prompt)
            token = int(ctx.logits().argmax())
            start = time.perf_counter()
            for _ in range(tokens):
                ctx.eval([token])
                token = int(ctx.logits().argmax())
            return tokens / (time.perf_counter() - start)

    values = interleave({name: (lambda p=p: turn(p)) for name, p in paths.items()}, repeat, say)
    return {name: spread(v) for name, v in values.items()}


def measure(args: argparse.Namespace, say) -> dict:
    if args.speed_against:
        return measure_speed(args, say)
    from edgerun.convert import pipeline, report
    from edgerun.convert.progress import Bar
    from edgerun.convert.source import prepare_f16

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "EDGERUN_HOME": str(work / "home")}
    cache = work / "home" / "cache" / "convert"
    bar = Bar()
    try:
        timing = (_timed_convert(args.src, ["--quant", "Q3_K_M"], work / "edgerun-convert.gguf", env, args.threads)
                  if args.timed else None)
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
    speeds = decode_speed(variants, tokens=args.decode_tokens, repeat=args.decode_repeat, threads=args.threads,
                          say=say) if args.decode_tokens > 0 else {}
    results = {}
    for (name, path), q in zip(variants.items(), qualities):
        results[name] = report.build(path, q).to_json()
        results[name]["types"] = type_counts(results[name].pop("tensors"))
        results[name]["decode_tok_s"] = speeds.get(name)
    settings = {"src": args.src, "eval_chunks": args.eval_chunks, "calib_chunks": args.calib_chunks,
                "threads": args.threads, "weigh": args.weigh, "prose": args.prose,
                "decode_tokens": args.decode_tokens, "decode_repeat": args.decode_repeat}
    return {"settings": settings, "convert": timing, "results": results, "claims": _claims(results)}


# How a side runs another checkout's edgerun: without the editable install's finder (it maps
# every `edgerun` module to this tree), with the checkout first on the path and this build's
# native extension (its folder added to the package's path).
_IN_TREE = ("import sys; tree, ext = sys.argv.pop(1), sys.argv.pop(1); "
            "sys.meta_path[:] = [f for f in sys.meta_path if 'edgerun' not in getattr(f, 'known_source_files', {})]; "
            "sys.path.insert(0, tree); import edgerun; edgerun.__path__.append(ext); "
            "from edgerun.cli import main; sys.exit(main(sys.argv[1:]))")
SPEED_GOAL, KLD_GOAL = 0.35, 1.05


def reference_tree(rev: str, work: Path) -> tuple[Path, str]:
    """(a checkout of REV, its commit): REV itself when it is a directory, else a git worktree of
    this repository under WORK (reused while it is at REV; `git worktree remove` drops it). The
    checkout runs with this build's native extension."""
    root = Path(__file__).resolve().parents[2]
    git = lambda *a, cwd=root: subprocess.run(["git", "-C", str(cwd), *a], capture_output=True, text=True)  # noqa: E731
    if Path(rev).is_dir():
        tree = Path(rev).resolve()
    else:
        want = git("rev-parse", "--verify", f"{rev}^{{commit}}")
        if want.returncode != 0:
            raise EdgerunError(f"--speed-against {rev}: not a directory nor a git revision of {root}")
        tree = work / f"tree-{want.stdout.strip()[:12]}"
        if not (tree / "edgerun" / "cli.py").is_file():
            added = git("worktree", "add", "--detach", str(tree), want.stdout.strip())
            if added.returncode != 0:
                raise EdgerunError(f"git worktree add {tree} {rev} failed: {added.stderr.strip()}")
    if not (tree / "edgerun" / "cli.py").is_file():
        raise EdgerunError(f"{tree} holds no edgerun checkout (edgerun/cli.py)")
    head = git("rev-parse", "--short=12", "HEAD", cwd=tree)
    return tree, head.stdout.strip() if head.returncode == 0 else str(tree)


def _convert_side(src: str, size: int, side: Path, tree: Path | None, threads: int | None) -> dict:
    """One `edgerun convert` from scratch (its own empty cache under SIDE). TREE: that checkout's code."""
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir(parents=True)
    env = {**os.environ, "EDGERUN_HOME": str(side / "home")}
    timing = _timed_convert(src, ["--size", str(size)], side / "out.gguf", env, threads, tree)
    del timing["peak_rss_bytes"]  # the children's peak so far: the other side's too
    return timing


def measure_speed(args: argparse.Namespace, say) -> dict:
    from edgerun.bench.scenario import commit
    from edgerun.convert import pipeline, report
    from edgerun.convert.progress import Bar
    from edgerun.convert.quantize import quantize
    from edgerun.convert.source import prepare_f16

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree, rev = reference_tree(args.speed_against, work)
    bar = Bar()
    try:
        f16 = Path(prepare_f16(args.src, work / "f16", progress=bar))
        stock = work / f"stock-{args.size_of}.gguf"
        if not stock.is_file():
            quantize(f16, stock, ftype=args.size_of, overrides={}, imatrix=None, n_threads=args.threads, progress=bar)
    finally:
        bar.close()
    size = stock.stat().st_size
    sides = {}
    for name, side_tree in ((f"at {rev}", tree), ("this tree", None)):
        sides[name] = _convert_side(args.src, size, work / ("reference" if side_tree else "this"), side_tree,
                                    args.threads)
        say(f"{name}: {sides[name]['wall_s']:.0f} s, steps {sides[name]['steps_s']}")
    bar = Bar()
    try:
        qualities = report.evaluate_many(f16, [Path(s["output"]) for s in sides.values()],
                                         pipeline.EVAL_TEXT.read_text(encoding="utf-8"), max_chunks=args.eval_chunks,
                                         n_threads=args.threads, progress=bar)
    finally:
        bar.close()
    for side, q in zip(sides.values(), qualities):
        side.update(kld_mean=q.kld_mean, kld_p99=q.kld_p99, top1_agreement=q.top1_agreement, ppl=q.ppl,
                    ppl_ref=q.ppl_ref)
    old, new = sides.values()
    settings = {"src": args.src, "speed_against": args.speed_against, "reference_commit": rev,
                "this_commit": commit(), "size_of": args.size_of, "size_bytes": size, "eval_chunks": args.eval_chunks, "threads": args.threads}
    claims = [claim(f"edgerun convert wall time, this tree / {rev}", new["wall_s"] / old["wall_s"], f"<= {SPEED_GOAL}"),
              claim(f"mean KLD of the output, this tree / {rev}", new["kld_mean"] / old["kld_mean"], f"<= {KLD_GOAL}")]
    return {"settings": settings, "sides": sides, "claims": claims}


def report_speed(doc: dict) -> str:
    sides = doc["sides"]
    steps = list(dict.fromkeys(k for s in sides.values() for k in s["steps_s"]))
    rows = [["step (s)", *sides]]
    rows += [[step, *(f"{s['steps_s'][step]:.1f}" if step in s["steps_s"] else "-" for s in sides.values())]
             for step in steps]
    rows.append(["wall", *(f"{s['wall_s']:.1f}" for s in sides.values())])
    rows.append(["load (start, end)", *(f"{s['load_avg_1m'][0]:.1f}, {s['load_avg_1m'][1]:.1f}" for s in sides.values())])
    rows.append(["size MB", *(f"{s['size_bytes'] / 1e6:.1f}" for s in sides.values())])
    rows.append(["mean KLD", *(f"{s['kld_mean']:.5f}" for s in sides.values())])
    rows.append(["top-1", *(f"{s['top1_agreement']:.2%}" for s in sides.values())])
    return "\n".join(align(rows))


def type_counts(tensors: dict) -> dict[str, int]:
    """How many tensors of each type a file holds (the plan at a glance)."""
    return dict(Counter(t["type"] for t in tensors.values()).most_common())


def best_stock(results: dict, size_of: str) -> str:
    """The stock recipe with the least mean KLD among those no larger than stock SIZE_OF."""
    limit = results[f"stock {size_of}"]["size_bytes"]
    fits = [f for f in STOCK if results[f"stock {f}"]["size_bytes"] <= limit]
    return min(fits, key=lambda f: results[f"stock {f}"]["kld_mean"])


def _claims(results: dict) -> list[dict]:
    out = []
    for ftype in SIZES:
        best = best_stock(results, ftype)
        ours = results[f"edgerun @{ftype} (code calib)"]
        out.append(claim(f"mean KLD, edgerun / best stock recipe at {ftype}'s size ({best})",
                         ours["kld_mean"] / results[f"stock {best}"]["kld_mean"], "<= 0.6"))
    for ftype in SIZES:
        ours, stock = results[f"edgerun k-quants @{ftype}"], results[f"stock {ftype}"]
        out.append(claim(f"mean KLD, edgerun k-quants only / stock {ftype} at its size",
                         ours["kld_mean"] / stock["kld_mean"], "<= 0.85"))
    return out


def report(doc: dict) -> str:
    if "sides" in doc:
        return report_speed(doc)
    rows = [["", "size MB", "bpw", "mean KLD", "KLD p99", "top-1", "ppl", "ppl F16", "decode tok/s"]]
    for name, r in doc["results"].items():
        speed = r.get("decode_tok_s")
        rows.append([name, f"{r['size_bytes'] / 1e6:.1f}", f"{r['bpw']:.3f}", f"{r['kld_mean']:.5f}",
                     f"{r['kld_p99']:.4f}", f"{r['top1_agreement']:.2%}", f"{r['ppl']:.3f}", f"{r['ppl_ref']:.3f}",
                     f"{speed['median']:.1f}" if speed else "-"])
    lines = align(rows)
    for ftype in SIZES if doc["settings"]["prose"] else ():
        code, prose = (doc["results"][f"edgerun @{ftype} ({c} calib)"] for c in CALIBS)
        lines.append(f"at {ftype}'s size, calibrated on prose vs code (evaluated on code): KLD x"
                     f"{prose['kld_mean'] / code['kld_mean']:.3f}, top-1 {prose['top1_agreement'] - code['top1_agreement']:+.2%}")
    for ftype in SIZES:
        lines.append(f"edgerun @{ftype} types: {doc['results'][f'edgerun @{ftype} (code calib)']['types']}")
    if doc["convert"]:
        c = doc["convert"]
        lines.append(f"edgerun convert --quant Q3_K_M: {c['wall_s']:.0f} s, peak RSS {c['peak_rss_bytes'] / 2**30:.2f} GiB;"
                     f" steps (s): {c['steps_s']}")
    return "\n".join(lines)


register(Scenario("convert", "edgerun convert's plan vs llama.cpp's stock recipes (Q3_K_M, Q2_K, IQ3_XXS, IQ2_M), mean"
                  " KLD at equal size (goal <= 0.6 of the best stock; k-quants only <= 0.85)", add_args, measure, report))
