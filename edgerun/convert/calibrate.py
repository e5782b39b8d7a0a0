"""Calibration: run text through a GGUF with llama.cpp and gather the importance matrix.

For every matmul weight W the importance of its input column c is E[x_c^2] over the activations x
that reach it: a quantization error dW then costs about sum_c dW_rc^2 E[x_c^2] per output row,
which is what both the sensitivity measure and llama.cpp's quantizer weigh errors by. The
activations are read by a native eval callback, so this runs at llama.cpp's speed on any
architecture llama.cpp runs."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from edgerun import _native
from edgerun.convert.imatrix import Imatrix
from edgerun.errors import ConvertError, EdgerunError
from edgerun.runtime.engine import Context, Model
from edgerun.settings import EngineSettings, default_threads

Progress = Callable[[str, int, int], None]

MIN_CHUNK_TOKENS = 16  # a shorter tail adds little and would skew nothing, but is not worth a decode


def chunk_tokens(tokens: list[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    """Split into chunks of at most n_ctx tokens, each starting with BOS where the model wants
    one (every chunk is evaluated with a fresh KV cache, as a document start)."""
    body = n_ctx - (1 if bos is not None else 0)
    chunks = []
    for start in range(0, len(tokens), body):
        piece = tokens[start : start + body]
        if len(piece) < MIN_CHUNK_TOKENS and chunks:
            break
        chunks.append(([bos] if bos is not None else []) + piece)
    return chunks


def spread(chunks: list, limit: int | None) -> list:
    """At most LIMIT of CHUNKS, evenly spaced from the first to the last (every one when LIMIT is
    None or not smaller): a text of several sets or files is sampled all through, not only its
    start; the first chunk is always among them."""
    if limit is None or limit >= len(chunks):
        return list(chunks)
    return [chunks[i] for i in np.unique(np.linspace(0, len(chunks) - 1, limit).round().astype(int))]


def collect_imatrix(gguf_path: Path, text: str, *, n_ctx: int = 512, max_chunks: int | None = None,
                    n_threads: int | None = None, progress: Progress | None = None,
                    collector: "_native.ImatrixCollector | None" = None,
                    on_chunk: Callable[[int, list[int], Context], None] | None = None) -> Imatrix:
    """Run `text` through the model in n_ctx chunks and return the importance matrix.

    `collector` lets a caller (a test) pass a prepared native collector, e.g. one capturing a node.
    `on_chunk(i, tokens, ctx)` is called after each chunk's evaluation, while the context holds
    every position's logits (the weigh step keeps the first chunk's as its reference)."""
    if n_ctx < MIN_CHUNK_TOKENS:
        raise ConvertError(f"calibration context of {n_ctx} tokens is too short; use at least {MIN_CHUNK_TOKENS}")
    collector = collector or _native.ImatrixCollector()
    settings = EngineSettings(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                              n_threads=n_threads or default_threads())
    try:
        with Model(gguf_path) as model:
            tokens = model.tokenize(text, add_special=False)
            chunks = spread(chunk_tokens(tokens, n_ctx, model.bos if model.add_bos else None), max_chunks)
            if not tokens or len(chunks[0]) < MIN_CHUNK_TOKENS:
                raise ConvertError(f"calibration text gives {len(tokens)} tokens; give at least {MIN_CHUNK_TOKENS}")
            with Context(model, settings, eval_callback=(collector.callback_address, collector.user_data)) as ctx:
                _run_chunks(ctx, chunks, collector, progress, on_chunk)
    except ConvertError:
        raise
    except EdgerunError as e:
        raise ConvertError(f"{gguf_path}: calibration failed: {e}") from e
    return Imatrix(values=_means(collector.results()), tokens=sum(map(len, chunks)), chunks=len(chunks))


def _run_chunks(ctx: Context, chunks: list[list[int]], collector, progress: Progress | None,
                on_chunk: Callable[[int, list[int], Context], None] | None) -> None:
    for i, chunk in enumerate(chunks):
        ctx.trim(0)
        try:
            # logits for every token: llama.cpp skips the last layer's rows that produce no
            # output, and those rows' activations are calibration data like any other
            ctx.eval(chunk, all_logits=True)
        except EdgerunError as e:
            raise ConvertError(f"calibration stopped: {collector.error or e}") from e
        if collector.error:
            raise ConvertError(f"calibration stopped: {collector.error}")
        if on_chunk:
            on_chunk(i, chunk, ctx)
        if progress:
            progress("calibrate", i + 1, len(chunks))


def _means(results: dict) -> dict[str, np.ndarray]:
    """sum x^2 / rows per matrix; an expert no token was routed to gets 1 (no preference)."""
    values = {}
    for name, (sums, counts) in results.items():
        seen = counts > 0
        mean = np.ones_like(sums)
        mean[seen] = sums[seen] / counts[seen, None]
        values[name] = mean.reshape(-1).astype(np.float32)
    return values
