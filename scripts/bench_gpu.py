#!/usr/bin/env python3
"""GPU measurements on a CUDA build: edgerun vs llama.cpp's llama-bench, offload plans, speculation.

  bench_gpu.py shapes DIR                 random-weight Q4_K_M models with Qwen2.5's real shapes
  bench_gpu.py throughput DIR --llama-bench BIN   decode tok/s, fully on the GPU, ratios + HBM use
      [--short-prompt] [--graph-key-ab]           ... plus tg128's workload; the upstream CUDA graph key
  bench_gpu.py offload DIR --llama-bench BIN      7B half on the GPU, 1.5B all on the CPU
      [--cpu-threads 16 8]                        ... the CPU rows at these thread counts
  bench_gpu.py probe DIR --llama-bench BIN        where a decode step's time goes (native loop vs run)
  bench_gpu.py gap DIR --llama-bench BIN          edgerun's decode path vs llama-bench, one variable at a time
  bench_gpu.py spec TARGET DRAFT           the real pair: plain vs speculative, GPU and CPU+GPU
  bench_gpu.py specprobe TARGET DRAFT      where a speculative round's time goes, both on the GPU
      [--cpu-target] [--draft-threads 16 1]   ... the target on the CPU; the governor's reply with
                                              the draft computing on these CPU thread counts

Decode speed does not depend on weight values, so throughput uses random weights with the real
shapes; acceptance does, so `spec` needs the real models. Every edgerun number comes from the
user's path (`edgerun run --stats-json`), each in its own process."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {  # Qwen2.5 family: n_embd, n_ff, n_layer, n_head, n_head_kv, tied head
    "0.5b": (896, 4864, 24, 14, 2, True),
    "1.5b": (1536, 8960, 28, 12, 2, False),
    "7b": (3584, 18944, 28, 28, 4, False),
}
N_VOCAB = 151936
PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime."
GEN = 128


# ---- random-weight models with real shapes ------------------------------------------------------

def _vocab(writer) -> None:
    """A byte-level BPE vocab of the real size: llama.cpp needs one to load and to tokenize."""
    from gguf import TokenType

    printable = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    extra = [chr(256 + i) for i in range(256 - len(printable))]  # GPT-2's byte-to-unicode shift
    tokens = printable + extra
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [f"tok{i}" for i in range(N_VOCAB - len(tokens) - len(specials))] + specials
    types = [TokenType.NORMAL] * (N_VOCAB - 3) + [TokenType.CONTROL] * 3
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["t o"])
    writer.add_eos_token_id(N_VOCAB - 1)
    writer.add_bos_token_id(N_VOCAB - 3)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                             "{% endfor %}<|im_start|>assistant\n")


def write_shape_model(name: str, out: Path) -> Path:
    """F16 GGUF with random weights (one random block tiled: values do not change the speed),
    then quantized to Q4_K_M by llama.cpp's quantizer."""
    import gguf
    import llama_cpp

    n_embd, n_ff, n_layer, n_head, n_kv, tied = SHAPES[name]
    head_dim = n_embd // n_head
    f16 = out / f"shape-{name}-f16.gguf"
    final = out / f"shape-{name}-q4_k_m.gguf"
    if final.exists():
        return final
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 20) * 0.02).astype(np.float16)

    def weight(rows: int, cols: int) -> np.ndarray:
        return np.resize(block, rows * cols).reshape(rows, cols)

    w = gguf.GGUFWriter(str(f16), "qwen2")
    w.add_name(f"shape-{name}")
    w.add_context_length(32768)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _vocab(w)
    ones = lambda n: np.ones(n, dtype=np.float32)
    w.add_tensor("token_embd.weight", weight(N_VOCAB, n_embd))
    w.add_tensor("output_norm.weight", ones(n_embd))
    if not tied:
        w.add_tensor("output.weight", weight(N_VOCAB, n_embd))
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones(n_embd))
        w.add_tensor(b + "attn_q.weight", weight(n_embd, n_embd))
        w.add_tensor(b + "attn_q.bias", np.zeros(n_embd, dtype=np.float32))
        w.add_tensor(b + "attn_k.weight", weight(n_kv * head_dim, n_embd))
        w.add_tensor(b + "attn_k.bias", np.zeros(n_kv * head_dim, dtype=np.float32))
        w.add_tensor(b + "attn_v.weight", weight(n_kv * head_dim, n_embd))
        w.add_tensor(b + "attn_v.bias", np.zeros(n_kv * head_dim, dtype=np.float32))
        w.add_tensor(b + "attn_output.weight", weight(n_embd, n_embd))
        w.add_tensor(b + "ffn_norm.weight", ones(n_embd))
        w.add_tensor(b + "ffn_gate.weight", weight(n_ff, n_embd))
        w.add_tensor(b + "ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(b + "ffn_down.weight", weight(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 0
    tmp = final.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params) != 0:
        raise SystemExit(f"quantizing {f16} failed")
    tmp.rename(final)
    f16.unlink()
    return final


# ---- measurements -------------------------------------------------------------------------------

def llama_bench(binary: str, model: Path, *, ngl: int, threads: int | None = None, reps: int = 3) -> float:
    cmd = [binary, "-m", str(model), "-ngl", str(ngl), "-p", "0", "-n", str(GEN), "-r", str(reps), "-o", "json"]
    if threads:
        cmd += ["-t", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def edgerun_run(model: Path, *args: str, raw: bool = True, reps: int = 3, env: dict | None = None,
                prompt: str = PROMPT) -> dict:
    """Median decode tok/s of `edgerun run` over reps processes, with the last run's stats."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        for _ in range(reps):
            cmd = [sys.executable, "-m", "edgerun.cli", "run", prompt, "-m", str(model), "-n", str(GEN),
                   "--temp", "0", "--ctx", "4096", "--stats-json", str(stats), *args]
            proc = subprocess.run(cmd + (["--raw"] if raw else []), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"edgerun run failed: {proc.stderr.strip().splitlines()[-1:]}")
            runs.append(json.loads(stats.read_text()))
    best = dict(runs[-1])
    best["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in runs)
    best["tokens"] = runs[-1].get("generated_tokens")
    return best


def copy_bandwidth() -> float:
    """Device-to-device copy rate (bytes read + written per second), the ceiling for decode."""
    try:
        import torch
    except ImportError:
        return 4.3e12
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


def cmd_shapes(args) -> None:
    args.dir.mkdir(parents=True, exist_ok=True)
    for name in args.which.split(","):
        t = time.perf_counter()
        path = write_shape_model(name, args.dir)
        print(f"{name}: {path} {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)


def cmd_throughput(args) -> dict:
    """`edgerun run` (a reply to PROMPT) against llama-bench on the same file, fully on the GPU:
    its tg128 (generation from an empty context, after a warm-up), and its tg128 right after a
    prompt of the same length (-d, one rep per process), which is what a reply is. With upstream
    ggml-cuda the first steps after a prompt's batch re-capture the single-token CUDA graph;
    setup.sh's patch (scripts/llama_patches.py) keys captured graphs by shape. --graph-key-ab
    adds, to every row, `edgerun run` and llama-bench -d with the upstream key (EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE), side by side."""
    bw = copy_bandwidth()
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    upstream_key = os.environ | {"EDGERUN_CUDA_GRAPH_KEY_FIRST_NODE": "1"}
    results = {}
    for name in args.which.split(","):
        model = args.dir / f"shape-{name}-q4_k_m.gguf"
        # interleaved rows: the machine's speed drifts by a few percent between minutes, so each
        # ratio compares neighbours
        rows = []
        for _ in range(args.pairs):
            run = edgerun_run(model, "--gpu-layers", "auto", reps=1)
            depth = run["prompt_tokens"]
            run_ours = lambda **kw: edgerun_run(model, "--gpu-layers", "auto", reps=1, **kw)["decode_tok_s"]  # noqa: E731
            bench_at_depth = lambda **kw: _llama_bench_depth(args.llama_bench, model, depth, ngl=99,  # noqa: E731
                                                             threads=None, runs=1, **kw)
            row = {"ours": run["decode_tok_s"], "tg": llama_bench(args.llama_bench, model, ngl=99), "d": bench_at_depth()}
            if args.short_prompt:
                row["ours one-token prompt"] = run_ours(prompt="H")
            if args.graph_key_ab:
                row["ours upstream key"] = run_ours(env=upstream_key)
                row["d upstream key"] = bench_at_depth(env=upstream_key)
            rows.append(row)
        med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
        ours, tg, after = med(lambda r: r["ours"]), med(lambda r: r["tg"]), med(lambda r: r["d"])
        vs_tg, vs_after = med(lambda r: r["ours"] / r["tg"]), med(lambda r: r["ours"] / r["d"])
        size = model.stat().st_size
        results[name] = {"edgerun": ours, "llama_bench_tg": tg, f"llama_bench_d{depth}": after,
                         "ratio_vs_prompted": vs_after, "ratio_vs_tg": vs_tg, "rows": rows,
                         "hbm_utilization": size * ours / bw, "file_bytes": size}
        print(f"{name}: edgerun run {ours:.1f} tok/s after a {depth}-token prompt; llama-bench -d {depth} {after:.1f}"
              f" (median paired ratio {vs_after:.3f}, goal >= 0.98), tg{GEN} {tg:.1f} ({vs_tg:.3f});"
              f" rows {' '.join('/'.join(f'{v:.0f}' for v in r.values()) for r in rows)} ({'/'.join(rows[0])});"
              f" {size / 1e9:.2f} GB x {ours:.0f}/s = {size * ours / 1e12:.2f} TB/s, {size * ours / bw:.0%} of the copy rate",
              flush=True)
        if args.short_prompt:
            short = med(lambda r: r["ours one-token prompt"])
            vs_tg_short = med(lambda r: r["ours one-token prompt"] / r["tg"])
            results[name] |= {"edgerun_one_token_prompt": short, "ratio_one_token_prompt_vs_tg": vs_tg_short}
            print(f"{name}: edgerun run after a one-token prompt (tg{GEN}'s workload) {short:.1f} tok/s,"
                  f" median paired ratio to tg{GEN} {vs_tg_short:.3f}", flush=True)
        if args.graph_key_ab:
            gain, gain_lb = med(lambda r: r["ours"] / r["ours upstream key"]), med(lambda r: r["d"] / r["d upstream key"])
            results[name] |= {"edgerun_upstream_key": med(lambda r: r["ours upstream key"]),
                              "llama_bench_d_upstream_key": med(lambda r: r["d upstream key"]),
                              "key_gain_edgerun": gain, "key_gain_llama_bench_d": gain_lb}
            print(f"{name}: graph key per shape vs upstream (median paired ratios): edgerun run {gain:.3f},"
                  f" llama-bench -d {depth} {gain_lb:.3f}; upstream-key edgerun vs tg{GEN}"
                  f" {med(lambda r: r['ours upstream key'] / r['tg']):.3f}", flush=True)
    return results


def _layers_for(model: Path, max_vram: int) -> int:
    from edgerun.models.gguf_check import inspect
    from edgerun.runner import placement_for
    from edgerun.runtime import devices
    from edgerun.settings import EngineSettings

    info = inspect(model)
    plan = placement_for(info, EngineSettings(n_ctx=4096, max_vram=max_vram),
                         memory=devices.Memory(free_ram=devices.free_ram(), free_vram=max_vram, gpu=True))
    return plan.target.gpu_layers


def cmd_offload(args) -> dict:
    """edgerun's auto plan on a GPU that holds about half the 7B, and the 1.5B all on the CPU, each
    against llama-bench with the same split: interleaved rows (an `edgerun run` process, then
    llama-bench -r 2), medians of the paired ratios; the CPU rows at each of --cpu-threads."""
    from edgerun.runtime import placement

    results = {}

    def rows(label, model, ours_args, ngl, threads):
        pairs = []
        for _ in range(args.pairs):
            ours = edgerun_run(model, *ours_args, "--threads", str(threads), reps=1)["decode_tok_s"]
            pairs.append((ours, llama_bench(args.llama_bench, model, ngl=ngl, threads=threads, reps=2)))
        ratio = statistics.median(o / t for o, t in pairs)
        results[label] = {"edgerun": statistics.median(o for o, _ in pairs), "llama_bench": statistics.median(t for _, t in pairs),
                          "ratio": ratio, "rows": pairs, "ngl": ngl, "threads": threads}
        print(f"{label}: edgerun {results[label]['edgerun']:.1f} tok/s, llama-bench -ngl {ngl} -t {threads}"
              f" {results[label]['llama_bench']:.1f} tok/s, median paired ratio {ratio:.3f};"
              f" rows {' '.join(f'{o:.1f}/{t:.1f}' for o, t in pairs)}", flush=True)

    model = args.dir / "shape-1.5b-q4_k_m.gguf"
    if model.exists():
        for threads in args.cpu_threads:
            rows(f"1.5b all on CPU, {threads} threads", model, ["--gpu-layers", "0"], 0, threads)
    model = args.dir / "shape-7b-q4_k_m.gguf"
    if model.exists():
        half = model.stat().st_size // 2
        cap = half + placement.VRAM_MARGIN + 400 * 2**20  # a GPU that holds about half the weights
        n = _layers_for(model, cap)
        rows(f"7b, {cap / 2**30:.2f} GiB VRAM cap (auto plan: {n} layers)", model,
             ["--max-vram", f"{cap / 2**30:.3f}"], n, args.threads)
        quoted = llama_bench(args.llama_bench, model, ngl=14, threads=args.threads, reps=2)
        print(f"7b llama-bench -ngl 14 -t {args.threads}: {quoted:.1f} tok/s", flush=True)
    return results


def _native_loop(model, settings, tokens: list[int], reps: int = 3) -> float:
    """Median tok/s of GEN greedy decode steps inside one native call (decode, argmax, repeat):
    edgerun's plain stretch without any Python between tokens."""
    import llama_cpp

    from edgerun import _native
    from edgerun.decode.generate import native_params
    from edgerun.runtime.engine import Context
    from edgerun.settings import SamplerSettings

    params = native_params(SamplerSettings(temperature=0.0))
    rng = _native.Rng(0)
    rates = []
    with Context(model, settings) as ctx:
        for _ in range(reps + 1):  # the first call also pays the single-token shape's graph capture
            ctx.prefill(tokens)
            last = _native.sample_context(ctx.address, -1, [], params, rng)
            r = _native.round(target=ctx.address, draft=0, draft_feed=[], draft_n_past=0, last=last,
                              target_n_past=ctx.n_past, k=0, p_min=0.0, proposals=[], history=[], params=params,
                              rule="rejection", rng=rng, plain_steps=GEN, plain_budget_s=60.0)
            rates.append((1 + len(r["more"])) / r["verify_s"])
            llama_cpp.llama_memory_seq_rm(ctx.mem, 0, len(tokens), -1)  # the loop's tokens were never recorded
    return statistics.median(rates[1:])


def cmd_probe(args) -> dict:
    """Where a decode step's time goes, against llama-bench's tg128: edgerun's native plain loop
    (llama_decode + argmax, no Python) at the CLI's 4096-token context and at llama-bench's small
    one, and the whole `edgerun run` path. One shape fully on the GPU, one on the CPU."""
    from edgerun.runtime.engine import Model
    from edgerun.settings import EngineSettings

    results = {}
    for label, name, ngl, threads in (("gpu", "0.5b", 99, None), ("cpu", "1.5b", 0, args.threads)):
        path = args.dir / f"shape-{name}-q4_k_m.gguf"
        row = {"llama_bench": llama_bench(args.llama_bench, path, ngl=ngl, threads=threads)}
        extra = {"n_threads": threads} if threads else {}
        with Model(path, n_gpu_layers=ngl) as model:
            tokens = model.tokenize(PROMPT, add_special=True)
            for n_ctx in (4096, 256):
                row[f"native_loop_ctx{n_ctx}"] = _native_loop(model, EngineSettings(n_ctx=n_ctx, **extra), tokens)
        place = ["--gpu-layers", str(ngl)] + (["--threads", str(threads)] if threads else [])
        row["edgerun_run"] = edgerun_run(path, *place)["decode_tok_s"]
        results[f"{name}_{label}"] = row
        print(f"{name} on {label}: " + ", ".join(f"{k} {v:.1f} tok/s ({v / row['llama_bench']:.3f})"
                                                for k, v in row.items()), flush=True)
    return results


def _llama_bench_depth(binary: str, model: Path, depth: int, *, ngl: int, threads: int | None, runs: int = 3,
                       env: dict | None = None) -> float:
    """llama-bench's tg128 right after a prompt of `depth` tokens (its -d), as in a reply: one
    rep per process (its later reps would restore the prompt's state without running it), the
    median of `runs` processes."""
    cmd = [binary, "-m", str(model), "-ngl", str(ngl), "-p", "0", "-n", str(GEN), "-d", str(depth), "-r", "1",
           "-o", "json"] + (["-t", str(threads)] if threads else [])
    return statistics.median(
        float(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)[0]["avg_ts"])
        for _ in range(runs))


def cmd_gap(args) -> dict:
    """What separates `edgerun run` from llama-bench, one variable at a time, in one process (the
    CLI's path without printing): stretches of one native call each vs the whole reply in one
    call, the decode left in flight, the pick in the graph, llama.cpp's debug log lines calling
    into Python (before the native filter), and a real prompt (on a GPU llama.cpp
    re-captured its single-token CUDA graph after the prompt's batch before setup.sh's graph-key
    patch) vs a BOS-only one
    (llama-bench's tg test). Variants take turns; each runs twice and the second counts (a
    sampler switch re-plans the graph). --ngl 0 --threads N: the same on the CPU."""
    import ctypes

    from edgerun import _native
    from edgerun.decode import speculative
    from edgerun.decode.generate import generate
    from edgerun.decode.speculative import Round, SpecConfig
    from edgerun.decode.stats import ReplyStats
    from edgerun.runner import Runner
    from edgerun.runtime import llama_log
    from edgerun.settings import EngineSettings, SamplerSettings

    greedy = SamplerSettings(temperature=0.0)
    variants = {  # label: (prompt kind, spec, whole reply in one native call, debug log lines into Python)
        "prompt": ("prompt", SpecConfig(), False, False),
        "prompt one-call": ("prompt", SpecConfig(), True, False),
        "prompt no-overlap": ("prompt", SpecConfig(overlap=False), False, False),
        "prompt no-overlap host-pick": ("prompt", SpecConfig(overlap=False, device_greedy=False), False, False),
        "prompt debug-log": ("prompt", SpecConfig(), False, True),
        "bos": ("bos", SpecConfig(), False, False),
        "bos one-call": ("bos", SpecConfig(), True, False),
    }
    limits = (speculative.PLAIN_STEPS, speculative.PLAIN_BUDGET_S)
    extra = {"n_threads": args.threads} if args.ngl == 0 else {}
    results = {}
    for name in args.which.split(","):
        path = args.dir / f"shape-{name}-q4_k_m.gguf"
        rates = {v: [] for v in variants}
        host = {v: [] for v in variants}
        with Runner(path, EngineSettings(n_ctx=4096, gpu_layers=str(args.ngl), **extra), draft="none") as r:
            tokens = {"prompt": r.raw_tokens(PROMPT), "bos": [r.model.bos]}
            for _ in range(args.reps):
                for label, (kind, spec, one_call, debug_log) in variants.items():
                    # one call: the stretch limits lifted, so no Python runs between tokens
                    speculative.PLAIN_STEPS, speculative.PLAIN_BUDGET_S = (GEN, 60.0) if one_call else limits
                    # debug log: every debug line calls into Python, as before the native filter
                    _native.route_log(ctypes.cast(llama_log._callback, ctypes.c_void_p).value, debug_log)
                    for _ in range(2):
                        r.ctx.trim(0)
                        stats, in_round = ReplyStats(), 0.0
                        for record in generate(r.ctx, tokens[kind], greedy, max_tokens=GEN, spec=spec):
                            stats.add(record)
                            if isinstance(record, Round):
                                in_round += record.verify_s
                    rates[label].append(stats.decode_tok_s)
                    wall = stats.last_t - stats.ttft_s
                    host[label].append(max(0.0, wall - in_round) / wall)
            speculative.PLAIN_STEPS, speculative.PLAIN_BUDGET_S = limits
            llama_log.install()
        depth = len(tokens["prompt"])
        bench = dict(ngl=args.ngl, threads=args.threads if args.ngl == 0 else None)
        row = {"llama_bench_tg": llama_bench(args.llama_bench, path, reps=5, **bench),
               f"llama_bench_d{depth}": _llama_bench_depth(args.llama_bench, path, depth, **bench)}
        row |= {label: statistics.median(v) for label, v in rates.items()}
        results[name] = {"rates": row, "host_share": {k: statistics.median(v) for k, v in host.items()},
                         "samples": rates}
        ref = row["llama_bench_tg"]
        print(f"{name} (ngl {args.ngl}): " + "; ".join(f"{k} {v:.1f} ({v / ref:.3f})" for k, v in row.items()), flush=True)
        print(f"{name} host share of decode wall: " + "; ".join(f"{k} {statistics.median(v):.1%}" for k, v in host.items()),
              flush=True)
    return results


def cmd_specprobe(args) -> dict:
    """Where a speculative round's time goes with target and draft on the GPU, or the target on the
    CPU with --cpu-target (real pair, T=0, one process): fixed k, the draft fed in one batch or token
    by token (stable shapes), with and without the draft's confidence stop; then the governor's own
    choice, and with --draft-threads that reply with the draft's context on each thread count."""
    import llama_cpp
    from bench_spec import run_once

    from edgerun.decode.speculative import SpecConfig
    from edgerun.runner import Runner
    from edgerun.settings import EngineSettings, SamplerSettings

    greedy = SamplerSettings(temperature=0.0)
    results = {}
    settings = EngineSettings(n_ctx=4096)
    if args.cpu_target:
        settings = settings.replace(gpu_layers="0", n_threads=args.threads)
    with Runner(args.target, settings, draft=str(args.draft)) as r:
        print(f"placement: {r.plan.target.gpu_layers} target layers on the GPU, threads {settings.n_threads}", flush=True)
        state = r.spec.governors["model"]
        print("load-time costs (ms): draft step %.3f, verify %s" % (
            state.draft_step_s * 1e3, " ".join(f"{n}:{t * 1e3:.2f}" for n, t in state.verify_s)), flush=True)
        run_once(r, "Say hello.", greedy, 16, SpecConfig())
        plain = statistics.median(run_once(r, PROMPT, greedy, GEN, SpecConfig())[0].decode_tok_s for _ in range(3))
        results["plain"] = plain
        print(f"plain {plain:.1f} tok/s", flush=True)
        configs = [(f"k={k} stable={stable} p_min={p_min}", SpecConfig(draft=r.draft_ctx, k=k, p_min=p_min, stable_shapes=stable))
                   for stable in (False, True) for p_min in (0.2, 0.0) for k in (3, 5, 7)]
        configs.append(("governor", r.spec))

        def row(label: str, spec: SpecConfig) -> dict:
            s, over = run_once(r, PROMPT, greedy, GEN, spec)
            per = lambda x: x / max(s.rounds, 1) * 1e3
            print(f"{label}: {s.decode_tok_s:.1f} tok/s ({s.decode_tok_s / plain:.3f}), acceptance {s.acceptance_rate:.0%},"
                  f" {s.rounds} rounds, per round draft {per(s.draft_s):.2f} ms verify {per(s.verify_s):.2f} ms,"
                  f" host {over:.1%} [{s.governor}]", flush=True)
            return {"tok_s": s.decode_tok_s, "ratio": s.decode_tok_s / plain, "acceptance": s.acceptance_rate,
                    "rounds": s.rounds, "draft_ms": per(s.draft_s), "verify_ms": per(s.verify_s), "host": over}

        for label, spec in configs:
            results[label] = row(label, spec)
        # the draft's CPU threads (its graph's CPU part: the token embedding lookup), in turns
        for turn in range(3):
            for n in args.draft_threads:
                llama_cpp.llama_set_n_threads(r.draft_ctx.ptr, n, n)
                results.setdefault(f"draft threads {n}", []).append(row(f"draft threads {n}, turn {turn}", r.spec))
    return results


def cmd_spec(args) -> dict:
    """Plain against speculative `edgerun run` processes (chat template, T=0, GEN tokens), in
    interleaved pairs: a host CPU whose speed drifts within the minute moves both sides of a pair
    alike. The ratio printed is the median of the pairs' ratios."""
    results = {}
    scenarios = {
        "gpu_target_gpu_draft": ["--gpu-layers", "auto"],
        "cpu_target_gpu_draft": ["--gpu-layers", "0", "--threads", str(args.threads)],
    }
    for label, place in scenarios.items():
        if args.scenarios and label not in args.scenarios:
            continue
        pairs = []
        for _ in range(args.reps):
            plain = edgerun_run(args.target, *place, "--draft", "none", raw=False, reps=1)
            spec = edgerun_run(args.target, *place, "--draft", str(args.draft), raw=False, reps=1)
            pairs.append((plain, spec))
        ratios = [s["decode_tok_s"] / p["decode_tok_s"] for p, s in pairs]
        ratio = statistics.median(ratios)
        plain_tok_s = statistics.median(p["decode_tok_s"] for p, _ in pairs)
        spec_tok_s = statistics.median(s["decode_tok_s"] for _, s in pairs)
        last = pairs[-1][1]
        results[label] = {"plain": plain_tok_s, "spec": spec_tok_s, "ratio": ratio,
                          "pair_ratios": ratios, "acceptance_rate": last.get("acceptance_rate"),
                          "mean_accepted_len": last.get("mean_accepted_len"), "spec_k": last.get("spec_k"),
                          "governor": last.get("governor")}
        print(f"{label}: plain {plain_tok_s:.1f} tok/s, speculative {spec_tok_s:.1f} tok/s, ratio"
              f" {ratio:.3f} (pairs: {' '.join(f'{r:.3f}' for r in ratios)}); last run:"
              f" acceptance {last.get('acceptance_rate') or 0:.0%}, mean run {last.get('mean_accepted_len') or 0:.2f},"
              f" k {last.get('spec_k')}; governor: {last.get('governor')}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("shapes")
    p.add_argument("dir", type=Path)
    p.add_argument("--which", default="0.5b,1.5b,7b")
    for name in ("throughput", "offload", "probe", "gap"):
        p = sub.add_parser(name)
        p.add_argument("dir", type=Path)
        p.add_argument("--llama-bench", required=True)
        p.add_argument("--which", default="0.5b,1.5b,7b")
        p.add_argument("--threads", type=int, default=16)
        p.add_argument("--pairs", type=int, default=5, help="throughput, offload: interleaved rows")
        p.add_argument("--reps", type=int, default=7, help="gap: turns per variant")
        p.add_argument("--ngl", type=int, default=99, help="gap: target layers on the GPU (0: all on the CPU)")
        p.add_argument("--cpu-threads", type=int, nargs="+", default=[16], help="offload: thread counts of the CPU rows")
        p.add_argument("--short-prompt", action="store_true",
                       help="throughput: also an `edgerun run` of a one-token prompt (tg128's workload) in each row")
        p.add_argument("--graph-key-ab", action="store_true",
                       help="throughput: also run each row with ggml-cuda's upstream CUDA graph key")
    for name in ("spec", "specprobe"):
        p = sub.add_parser(name)
        p.add_argument("target", type=Path)
        p.add_argument("draft", type=Path)
        p.add_argument("--threads", type=int, default=16)
        p.add_argument("--reps", type=int, default=3, help="spec: interleaved plain/speculative pairs")
        p.add_argument("--scenarios", nargs="+", choices=["gpu_target_gpu_draft", "cpu_target_gpu_draft"],
                       help="spec: run only these")
        p.add_argument("--cpu-target", action="store_true", help="specprobe: the target on the CPU (--threads)")
        p.add_argument("--draft-threads", type=int, nargs="*", default=[],
                       help="specprobe: then the governor's reply with the draft on each of these CPU thread counts")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    out = {"shapes": cmd_shapes, "throughput": cmd_throughput, "offload": cmd_offload, "probe": cmd_probe, "gap": cmd_gap,
           "spec": cmd_spec, "specprobe": cmd_specprobe}[args.cmd](args)
    if args.json and out:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
