"""`edgerun convert` end to end: SRC -> F16 GGUF -> importance matrix -> per-tensor errors -> each
role's measured KLD per unit of error -> plan -> llama.cpp quantize -> quality report.

Every intermediate lives in a work dir under edgerun's cache, named by a hash of its inputs, and
is written atomically, so an interrupted or repeated run redoes only what is missing."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from edgerun import paths
from edgerun.convert import gains
from edgerun.convert import plan as planner
from edgerun.convert import report
from edgerun.convert.atomic import atomic_path
from edgerun.convert.sensitivity import TensorCost
from edgerun.errors import ConvertError

Progress = Callable[[str, int, int], None]

CALIB_DIR = Path(__file__).resolve().parents[1] / "data" / "calib"
CALIB_SETS = ("code", "chat", "prose")
EVAL_TEXT = CALIB_DIR / "eval_code.txt"  # held out: no file in common with code.txt
# The types a tensor may get. Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL have 32-blocks, for rows that are not whole
# 256-blocks of the k-quants (e.g. the 896-wide rows of Qwen2.5-0.5B).
CANDIDATE_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
# llama.cpp's i-quants (256-blocks, lattice codebooks searched with the importance matrix): more
# accurate per byte than the k-quants at 2-4 bpw, but some decode slower on CPUs. Measured and
# cached apart from CANDIDATE_TYPES, so turning them on or off reuses the other measurements.
I_QUANTS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS")
# An i-quant more than this many bits per weight below the budget's mean is not measured: a
# plan puts no tensor that far below the mean (Q2_K stays a candidate for one that is), and
# the 2-bit i-quants' lattice searches are the slowest part of the sensitivity step (on the 0.5B
# at Q3_K_M's size, 5.4 bpw, about half of it, and the plan took none of them).
I_QUANT_SPAN_BPW = 2.0
# llama.cpp's stock recipes the plan can be compared with (--plot): the nearest smaller and larger
# one, and the next ones while within STOCK_SPAN of the plan's size, are quantized with the same
# imatrix and evaluated beside it.
STOCK_RECIPES = ("IQ2_M", "Q2_K", "IQ3_XXS", "Q3_K_M", "IQ4_XS", "Q4_K_M", "Q5_K_M", "Q6_K")
STOCK_SPAN = (0.6, 1.5)
# Calibration runs at most this many 512-token chunks, spread over the text (calibrate.spread):
# the F16's forward passes are the step's whole cost. On the 0.5B at Q3_K_M's size the plan's KLD
# from 8 chunks spread over the code set is 1.032x that from all 27 (the first 8: 1.002x; 6
# spread: 1.046x), at a third of the time.
CALIB_CHUNKS = 8
EVAL_CHUNKS = 16  # 512-token chunks of held-out code the report's quality figures come from
_CACHE_VERSION = 3  # bump when an intermediate's format or meaning changes


@dataclass(frozen=True)
class ConvertOptions:
    src: str
    output: Path
    quant: str | None = None  # exactly one of quant / bpw / size_bytes
    bpw: float | None = None
    size_bytes: int | None = None
    calib: tuple[str, ...] = ("code",)  # set names or text files
    keep_f16: Path | None = None
    report_path: Path | None = None
    eval_text: Path = EVAL_TEXT
    eval_chunks: int = EVAL_CHUNKS  # 0: skip the quality evaluation
    n_ctx: int = 512
    calib_chunks: int | None = CALIB_CHUNKS  # None: every chunk of the calibration text
    types: tuple[str, ...] = CANDIDATE_TYPES
    weigh: bool = True  # measure each role's KLD per unit of error (gains.py); off: all roles weigh 1
    i_quants: bool = True  # also let the plan pick I_QUANTS (off: --k-quants-only)
    plot: Path | None = None  # also quantize and evaluate the stock recipes near the plan's size, and
    # draw the plan against them (KLD vs size) into this PNG
    # rows per tensor the sensitivity step measures (None: all). On the 0.5B at Q3_K_M's size 64
    # rows give the plan that 128 give (with the gains measured on either), at half the step's cost.
    max_rows: int | None = 64
    n_threads: int | None = None
    work_dir: Path | None = None  # default: <cache>/convert


def check(opts: ConvertOptions) -> None:
    """The cheap checks, before any long step: one budget, known calibration sets, places that
    exist. Raises ConvertError."""
    budgets = [b for b in (opts.quant, opts.bpw, opts.size_bytes) if b is not None]
    if len(budgets) != 1:
        raise ConvertError("give exactly one budget: --quant (e.g. Q4_K_M), --bpw (e.g. 3.5) or --size (e.g. 900MB)")
    if opts.quant is not None:
        from edgerun.convert.quantize import ftype_value

        ftype_value(opts.quant)
    if opts.bpw is not None:
        planner.budget_for_bpw(opts.bpw, 1)
    if not opts.src.startswith("hf://") and not Path(opts.src).expanduser().exists():
        raise ConvertError(f"{opts.src}: no such file or directory; give an HF checkpoint directory, "
                           "hf://org/repo or an F16/BF16/F32 GGUF")
    if opts.plot and not opts.eval_chunks:
        raise ConvertError("comparing with the stock recipes (--plot) needs the quality evaluation; drop --eval-chunks 0")
    for path in (opts.output, opts.report_path, opts.keep_f16, opts.plot):
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            raise ConvertError(f"{path}: its directory does not exist; create it first")
    calibration_text(opts.calib)
    if opts.eval_chunks and not Path(opts.eval_text).is_file():
        raise ConvertError(f"{opts.eval_text}: no such evaluation text file")


def calibration_text(sets: Sequence[str]) -> str:
    """The named built-in sets and/or text files, concatenated."""
    if not sets:
        raise ConvertError("no calibration set; use --calib code, chat, prose or a text file")
    parts = []
    for name in sets:
        path = CALIB_DIR / f"{name}.txt" if name in CALIB_SETS else Path(name).expanduser()
        if not path.is_file():
            raise ConvertError(f"unknown calibration set '{name}': use {', '.join(CALIB_SETS)} or a text file")
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ConvertError(f"{path}: cannot read it as UTF-8 text ({e})") from e
    return "\n\n".join(parts)


def convert(opts: ConvertOptions, *, progress: Progress | None = None) -> report.Report:
    """Run every step (reusing finished intermediates) and return the report; writes opts.output
    and, if asked, opts.report_path and opts.keep_f16."""
    from edgerun.convert.quantize import quantize
    from edgerun.convert.source import prepare_f16

    check(opts)
    work = Path(opts.work_dir or paths.cache_dir() / "convert")
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    clock = _Clock(timings)

    with clock("source"):
        f16 = Path(prepare_f16(opts.src, work / "f16", progress=progress))
    if opts.keep_f16:
        _copy_atomic(f16, Path(opts.keep_f16))
    known: list = []  # the F16's logits on the probes' calibration chunks, if calibration runs now
    with clock("calibrate"):
        imatrix, imatrix_key = cached_imatrix(f16, opts, work, progress, keep=known if opts.weigh else None)
    with clock("sensitivity"):
        whole = inventory_of(f16, set())
        costs = cached_costs(f16, imatrix, imatrix_key, opts, work, progress,
                             bpw=8 * _budget(opts, f16, whole)[0] / sum(whole.n_elements.values()))
    role_gains = None
    if opts.weigh:
        with clock("weigh"):
            role_gains = cached_gains(f16, imatrix, imatrix_key, costs, opts, work, progress, known=known)
        costs = gains.weigh(costs, role_gains)
    inventory = inventory_of(f16, {c.name for c in costs})
    with clock("plan"):
        budget, base = _budget(opts, f16, inventory)
        chosen = planner.choose(costs, budget, fixed_bytes=inventory.fixed_bytes)
    if progress:
        progress("plan", 1, 1)
    checked = None
    with clock("quantize"):
        rival = _k_quant_rival(chosen, costs, opts, budget, inventory)
        if rival is None:
            quantize(f16, Path(opts.output), ftype=base, overrides=chosen.types, imatrix=imatrix,
                     n_threads=opts.n_threads, progress=progress)
        else:
            plans = {"with i-quants": chosen, "k-quants only": rival}
            kept, checked = keep_measured_best(f16, plans, Path(opts.output), base=base, imatrix=imatrix,
                                               text=calibration_text(opts.calib), n_ctx=opts.n_ctx,
                                               n_threads=opts.n_threads, progress=progress)
            chosen = plans[kept]
    quality, stock = None, {}
    if opts.plot:
        with clock("stock"):
            stock = cached_stock(f16, imatrix, imatrix_key, opts, work, budget, inventory, progress)
    if opts.eval_chunks:
        with clock("evaluate"):
            qualities = report.evaluate_many(f16, [Path(opts.output), *stock.values()],
                                             Path(opts.eval_text).read_text(encoding="utf-8"),
                                             n_ctx=opts.n_ctx, max_chunks=opts.eval_chunks,
                                             n_threads=opts.n_threads, progress=progress)
        quality = qualities[0]
        stock = {ftype: report.summary(report.build(path, q).to_json())
                 for (ftype, path), q in zip(stock.items(), qualities[1:])}
    result = report.build(
        Path(opts.output), quality, source=opts.src, f16=str(f16), calib=list(opts.calib),
        eval_text=str(opts.eval_text), budget_bytes=budget, base_ftype=base,
        plan={"error": chosen.error, "tensor_bytes": chosen.nbytes, "exact": chosen.exact,
              "grain_bytes": chosen.grain, "types": chosen.types,
              **({"checked_kld": checked} if checked else {})},
        role_gains=role_gains,
        imatrix={"tokens": imatrix.tokens, "chunks": imatrix.chunks},
        timings_s=timings, peak_rss_bytes=peak_rss_bytes(),
        **({"stock": stock} if stock else {}),
    )
    if opts.report_path:
        result.write(Path(opts.report_path))
    if opts.plot:
        from edgerun.convert.plot import plot

        plot(result.to_json(), Path(opts.plot).expanduser())
    return result


CHECK_CHUNKS = 2  # calibration chunks a plan with i-quants is measured on against its k-quant rival


def _k_quant_rival(chosen, costs: Sequence[TensorCost], opts: ConvertOptions, budget: int,
                   inventory: "Inventory"):
    """The k-quants-only plan at the same budget, when the chosen plan holds i-quants (else None).
    The planner adds up each tensor's measured error, weighed by its role's gain; with many
    tensors on the coarse i-quant grids that sum can promise more than the whole file keeps (the
    1.5B at Q2_K's size: predicted better, measured 0.167 mean KLD against the k-quant plan's
    0.130), so such a plan has to beat its rival measured whole."""
    if not opts.i_quants or not any(t in I_QUANTS and t not in opts.types for t in chosen.types.values()):
        return None
    rival = planner.choose(only_types(costs, opts.types), budget, fixed_bytes=inventory.fixed_bytes)
    return None if rival.types == chosen.types else rival


def keep_measured_best(f16: Path, plans: dict, output: Path, *, base: str, imatrix, text: str, n_ctx: int,
                       n_threads: int | None, progress: Progress | None = None) -> tuple[str, dict[str, float]]:
    """Quantize each of PLANS ({name: Plan}), measure every file's mean KLD against the F16 on the
    first CHECK_CHUNKS chunks of TEXT (calibration text: the report's evaluation stays held out),
    and make OUTPUT the one measured best. Returns (its name, {name: mean KLD})."""
    from edgerun.convert.quantize import quantize

    files = {name: output.with_name(f".{output.name}.check{i}.gguf") for i, name in enumerate(plans)}
    try:
        for name, plan_ in plans.items():
            quantize(f16, files[name], ftype=base, overrides=plan_.types, imatrix=imatrix, n_threads=n_threads,
                     progress=progress)
        if progress:
            progress("check plans", 0, len(plans))
        reference = report.Reference(f16, text, n_ctx=n_ctx, max_chunks=CHECK_CHUNKS, n_threads=n_threads)
        kld = {}
        for i, (name, path) in enumerate(files.items()):
            kld[name] = reference.kld_mean(path)
            if progress:
                progress("check plans", i + 1, len(plans))
        best = min(kld, key=kld.get)
        os.replace(files[best], output)
        return best, kld
    finally:
        for path in files.values():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def cached_stock(f16: Path, imatrix, imatrix_key: str, opts: ConvertOptions, work: Path, budget: int,
                 inv: "Inventory", progress: Progress | None) -> dict[str, Path]:
    """llama.cpp's stock recipes around the plan's tensor bytes (see STOCK_RECIPES), each quantized
    once per input with the same imatrix: {ftype: path}.
    The i-quant recipes only when the plan may use i-quants."""
    from edgerun.convert.quantize import quantize

    recipes = [f for f in STOCK_RECIPES if opts.i_quants or not f.startswith("IQ")]
    sizes = {f: planner.budget_for_types(stock_types(f16, f), inv.n_elements) for f in recipes}
    below = sorted((f for f in recipes if sizes[f] <= budget), key=sizes.get)
    above = sorted((f for f in recipes if sizes[f] > budget), key=sizes.get)
    # the nearest on each side always, the next ones while within STOCK_SPAN: at most 2 + 2
    keep = set(below[-1:] + above[:1])
    keep |= {f for f in below[-2:] + above[:2] if STOCK_SPAN[0] * budget <= sizes[f] <= STOCK_SPAN[1] * budget}
    out = {}
    for ftype in sorted(keep, key=sizes.get):
        path = work / f"stock-{ftype}-{_key('stock', _file_id(f16), imatrix_key, ftype)}.gguf"
        if not path.is_file():
            if progress:
                progress(f"stock {ftype}", 0, 1)
            quantize(f16, path, ftype=ftype, overrides={}, imatrix=imatrix, n_threads=opts.n_threads)
        if progress:
            progress(f"stock {ftype}", 1, 1)
        out[ftype] = path
    return out


class _Clock:
    def __init__(self, timings: dict[str, float]):
        self.timings = timings

    @contextlib.contextmanager
    def __call__(self, step: str):
        start = time.perf_counter()
        yield
        self.timings[step] = round(time.perf_counter() - start, 3)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process or its largest child (the quantizer runs in one);
    Linux reports ru_maxrss in KiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, child) * 1024


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([_CACHE_VERSION, *parts], default=str).encode()).hexdigest()[:16]


def _file_id(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def cached_imatrix(f16: Path, opts: ConvertOptions, work: Path, progress: Progress | None,
                   keep: list | None = None):
    """The importance matrix of opts.calib on F16 and its cache key, computed once per input.
    KEEP: when calibration runs, (tokens, logits) of the chunks the role probes are scored on are
    appended to it (their reference, for free: calibration evaluates every position)."""
    from edgerun.convert.calibrate import collect_imatrix
    from edgerun.convert.imatrix import Imatrix

    text = calibration_text(opts.calib)
    key = _key("imatrix", _file_id(f16), hashlib.sha256(text.encode()).hexdigest(), opts.n_ctx, opts.calib_chunks)
    path = work / f"imatrix-{key}.npz"
    if path.is_file():
        if progress:
            progress("calibrate (cached)", 1, 1)
        return Imatrix.load(path), key
    def on_chunk(i: int, tokens: list[int], ctx) -> None:
        if keep is not None and i < gains.PROBE_CHUNKS:  # the probes' chunk: this one's start
            n = min(len(tokens), _probe_ctx(opts))
            keep.append((tokens[:n], report.evaluated_logits(ctx, n, gains.PROBE_FIRST)))

    imatrix = collect_imatrix(f16, text, n_ctx=opts.n_ctx, max_chunks=opts.calib_chunks,
                              n_threads=opts.n_threads, progress=progress, on_chunk=on_chunk)
    imatrix.save(path)
    return imatrix, key


def cached_costs(f16: Path, imatrix, imatrix_key: str, opts: ConvertOptions, work: Path,
                 progress: Progress | None, bpw: float | None = None) -> list[TensorCost]:
    """Every candidate type's error for every quantizable tensor, computed once per input: the
    base types (opts.types) and, unless --k-quants-only, the i-quants, each cached on its own.
    BPW: the budget's mean bits per weight, where the i-quants far below it are left out (see
    I_QUANT_SPAN_BPW); None measures them all (plans at several budgets)."""
    from edgerun.convert.sensitivity import type_bpw

    costs = _cached_cost_group(f16, imatrix, imatrix_key, opts, tuple(opts.types), work, progress, "sensitivity")
    extra = tuple(t for t in I_QUANTS if t not in opts.types and (bpw is None or type_bpw(t) >= bpw - I_QUANT_SPAN_BPW)
                  ) if opts.i_quants else ()
    if extra:
        more = {c.name: c for c in _cached_cost_group(f16, imatrix, imatrix_key, opts, extra, work, progress,
                                                      "sensitivity (i-quants)")}
        costs = [dataclasses.replace(c, errors={**c.errors, **more[c.name].errors}) for c in costs]
    return costs


def _cached_cost_group(f16: Path, imatrix, imatrix_key: str, opts: ConvertOptions, types: tuple[str, ...],
                       work: Path, progress: Progress | None, label: str) -> list[TensorCost]:
    from edgerun.convert.sensitivity import measure

    key = _key("costs", _file_id(f16), imatrix_key, list(types), opts.max_rows)
    path = work / f"costs-{key}.json"
    if path.is_file():
        if progress:
            progress(f"{label} (cached)", 1, 1)
        return [_cost_from_json(d) for d in json.loads(path.read_text())]
    costs = measure(f16, imatrix, types, max_rows=opts.max_rows, n_threads=opts.n_threads,
                    progress=(lambda _label, done, total: progress(label, done, total)) if progress else None)
    costs = relative_costs(costs)
    report.write_text_atomic(path, json.dumps([asdict(c) for c in costs]))
    return costs


def relative_costs(costs: Sequence[TensorCost]) -> list[TensorCost]:
    """Each error divided by its tensor's signal (sum_rc imp_c W_rc^2, measured with the errors):
    the noise-to-signal ratio of that matmul's output. Absolute errors are not comparable across
    tensors (the inputs of ffn_down are far smaller than the normed inputs of attn_q, and a
    lookup table has no input at all); relative errors are, as each layer's output meets a
    normalized stream. Measured on Qwen2.5-0.5B at the Q3_K_M size, planning on absolute errors
    gave twice the KLD of the stock recipe, on relative errors a fraction of it."""
    return [dataclasses.replace(c, errors={k: v / c.signal for k, v in c.errors.items()}, signal=1.0)
            for c in costs]


def only_types(costs: Sequence[TensorCost], types: Sequence[str]) -> list[TensorCost]:
    """COSTS with only TYPES left among each tensor's candidates (the base types of the i-quant
    measurements; what --k-quants-only plans with)."""
    keep = set(types)
    return [dataclasses.replace(c, errors={t: e for t, e in c.errors.items() if t in keep}) for c in costs]


def cached_gains(f16: Path, imatrix, imatrix_key: str, costs: Sequence[TensorCost], opts: ConvertOptions,
                 work: Path, progress: Progress | None, known: Sequence = ()) -> dict[str, float]:
    """Each tensor role's measured KLD per unit of relative error, computed once per input. The
    probes use the base types only: a gain is a property of the role, and probing with the
    i-quants' extremes would change the measurement, not the role."""
    key = _key("gains", _file_id(f16), imatrix_key, list(opts.types), opts.max_rows, _probe_ctx(opts),
               gains.PROBE_CHUNKS, gains.PROBE_FIRST)
    path = work / f"gains-{key}.json"
    if path.is_file():
        if progress:
            progress("weigh roles (cached)", 1, 1)
        return json.loads(path.read_text())
    measured = gains.measure(f16, only_types(costs, opts.types), calibration_text(opts.calib), work=work / "probe", imatrix=imatrix,
                             n_ctx=_probe_ctx(opts), n_threads=opts.n_threads, progress=progress, known=known)
    report.write_text_atomic(path, json.dumps(measured, indent=1))
    return measured


def _probe_ctx(opts: ConvertOptions) -> int:
    """The probes' chunk length: gains.PROBE_CTX, within the calibration chunks it is cut from."""
    return min(gains.PROBE_CTX, opts.n_ctx)


def _cost_from_json(d: dict) -> TensorCost:
    return TensorCost(name=d["name"], shape=tuple(d["shape"]), n_elements=d["n_elements"],
                      row_len=d["row_len"], errors=d["errors"])


@dataclass(frozen=True)
class Inventory:
    """What the F16 GGUF holds, for turning a CLI budget into bytes of tensor data."""

    n_elements: dict[str, int]  # every tensor
    fixed_bytes: int  # tensors the plan does not choose for (norms, biases): copied as they are
    overhead_bytes: int  # header, metadata, alignment: the file size minus all tensor bytes


def inventory_of(f16: Path, planned: set[str]) -> Inventory:
    from edgerun.convert.tensors import n_bytes, n_elements, open_gguf

    table = open_gguf(f16).tensors
    total = sum(n_bytes(t) for t in table)
    return Inventory(n_elements={t.name: n_elements(t) for t in table},
                     fixed_bytes=sum(n_bytes(t) for t in table if t.name not in planned),
                     overhead_bytes=f16.stat().st_size - total)


def _budget(opts: ConvertOptions, f16: Path, inv: Inventory) -> tuple[int, str]:
    """(bytes of tensor data allowed, llama_ftype name used as the quantizer's base recipe)."""
    if opts.quant is not None:
        return planner.budget_for_types(stock_types(f16, opts.quant), inv.n_elements), opts.quant.upper()
    if opts.bpw is not None:
        budget = planner.budget_for_bpw(opts.bpw, sum(inv.n_elements.values()))
    else:
        # the quantizer adds a few metadata keys, and each tensor may need up to 31 more bytes
        # of alignment padding than in the F16 file: reserve that so the file fits --size
        margin = 16384 + 32 * len(inv.n_elements)
        budget = planner.budget_for_size(opts.size_bytes, inv.overhead_bytes + margin)
    bpw = 8 * budget / sum(inv.n_elements.values())
    return budget, nearest_ftype(bpw)


def nearest_ftype(bpw: float) -> str:
    """The stock recipe closest in size; only the file's general.file_type label comes from it,
    since every planned tensor gets an explicit type."""
    for limit, name in ((3.2, "Q2_K"), (4.2, "Q3_K_M"), (5.0, "Q4_K_M"), (5.9, "Q5_K_M"), (7.0, "Q6_K")):
        if bpw < limit:
            return name
    return "Q8_0"


_DRY_RUN_LINE = re.compile(r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\w+), size =[^(]*(?:\((\w+)\))?\s*$")


def stock_types(f16: Path, ftype: str) -> dict[str, str]:
    """Each tensor's type under llama.cpp's stock recipe `ftype`, from a dry run of its quantizer
    (nothing is written). llama.cpp reports the dry run only in its log, one line per tensor:
    "[  3/291]  blk.0.attn_q.weight - [896, 896, 1, 1], type = f16, size = 1.53 MiB -> 0.43 MiB (q4_K)"."""
    import ctypes

    import llama_cpp

    from edgerun.convert.quantize import ftype_value

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_value(ftype)
    params.dry_run = True
    lines: list[str] = []
    with _capture_llama_log(lines):
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), os.devnull.encode(), ctypes.byref(params))
    types = {}
    for line in lines:
        m = _DRY_RUN_LINE.search(line)
        if m:
            types[m.group(1)] = (m.group(3) or m.group(2)).upper()
    from edgerun.convert.tensors import open_gguf

    expected = len(open_gguf(f16).tensors)
    if rc != 0 or len(types) != expected:
        raise ConvertError(f"llama.cpp's dry run of {ftype} on {f16} reported {len(types)} of {expected} tensors; "
                           "use --size or --bpw instead")
    return types


@contextlib.contextmanager
def _capture_llama_log(lines: list[str]):
    """Collect llama.cpp's INFO lines without letting them reach the terminal."""
    log = logging.getLogger("edgerun.llama")

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = _Collect(logging.INFO)
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def _copy_atomic(src: Path, dst: Path) -> None:
    """--keep-f16: a hard link when on the same file system (instant), else a copy; atomic."""
    with atomic_path(dst.expanduser()) as tmp:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
